"""Plans made for a given device mesh (``--mesh 8x8``, ``AnalyticCostModel(mesh=...)``).

Oracles: the brute-force filter of every configuration by whether it lays on the mesh
(``cluster.mesh.assign``), the plan file read back, and the runtime's own choice of mesh in a dry
run (fake process group) with no fallback warning."""

import json
import warnings

import numpy as np
import pytest

from shardplan.cluster import get_cluster
from shardplan.cluster.mesh import MeshError, assign
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.configs import ConfigSpace, enumerate_configs
from shardplan.cost.tables import build_tables
from shardplan.plan import Plan
from shardplan.report.cli import main
from shardplan.zoo import build_model


@pytest.mark.parametrize("mesh", [(2, 4), (4, 2), (8,), (2, 2, 2)])
def test_configurations_on_a_mesh_are_those_that_lay_on_it(mesh):
    """Every op of the built-in MLP and AlexNet on 8 devices: the configurations searched on a mesh are
    exactly those of the unconstrained space that ``assign`` lays on it (each split factor a product
    of whole mesh axes), in the same order; on 2x2x2, the primes' mesh, that is all of them."""
    for name in ("mlp", "alexnet"):
        graph = build_model(name, 8)
        free = ConfigSpace(devices=8)
        on = ConfigSpace(devices=8, mesh=mesh)
        for op in graph.ops:
            every = enumerate_configs(op, free)
            want = []
            for row in every:
                try:
                    assign(op, tuple(int(f) for f in row), mesh)
                    want.append(row)
                except MeshError:
                    pass
            got = enumerate_configs(op, on)
            assert np.array_equal(got, np.array(want, dtype=np.int64).reshape(len(want), len(op.dims))), op.name
            if mesh == (2, 2, 2):
                assert len(got) == len(every)
    assert len(enumerate_configs(build_model("mlp", 8).ops[0], ConfigSpace(devices=8, mesh=(8,)))) < len(
        enumerate_configs(build_model("mlp", 8).ops[0], ConfigSpace(devices=8)))


def test_a_mesh_of_another_size_is_refused():
    with pytest.raises(ValueError, match="mesh 3x3 does not hold 8 devices"):
        ConfigSpace(devices=8, mesh=(3, 3))
    graph = build_model("mlp", 8)
    with pytest.raises(ValueError, match="mesh 2x2 holds 4 devices; planning for 8"):
        build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100"), mesh=(2, 2)), 8)


def test_the_plan_remembers_its_mesh_and_old_plan_files_still_read():
    graph = build_model("mlp", 8)
    model = AnalyticCostModel(get_cluster("dgx-a100"), mesh=(2, 4))
    tables = build_tables(graph, model, 8)
    assert tables.mesh == (2, 4) and model.edge_mesh(8) == (2, 4)
    from shardplan.search.solve import solve

    plan = Plan.from_choice(tables, solve(tables).choice)
    assert plan.mesh == (2, 4)
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.mesh == (2, 4)
    raw = json.loads(plan.to_json())
    del raw["mesh"]
    assert Plan.from_dict(raw).mesh is None  # files written before --mesh
    free = Plan.from_choice(build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100")), 8),
                            [0] * len(graph.ops))
    assert free.mesh is None and "mesh" not in free.to_dict()


def test_cli_plan_on_a_mesh_and_its_refusals(capsys):
    assert main(["plan", "--model", "mlp", "--devices", "8", "--mesh", "2x4", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mesh"] == [2, 4]
    for layer in out["layers"]:
        assert all(f in (1, 2, 4, 8) for f in layer["split"].values())
    for argv, message in ((["--mesh", "3x3"], "--mesh 3x3 holds 9 devices; planning for 8"),
                          (["--mesh", "2xa"], "expected sizes joined by x"),
                          (["--mesh", "2x4", "--cost-model", "pase"], "PaSE's model splits freely")):
        assert main(["plan", "--model", "mlp", "--devices", "8", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_mesh_auto_keeps_the_mesh_whose_plan_is_cheapest():
    """``solve_meshes`` on AlexNet over 8 devices: it tries the four meshes of 8 with up to four axes
    (8, 2x4, 4x2, 2x2x2), and its answer is the cheapest of the plans ``solve`` finds on each mesh
    alone, with that mesh's tables."""
    from shardplan.cluster.mesh import candidate_meshes
    from shardplan.search.solve import solve, solve_meshes

    graph = build_model("alexnet", 8)
    model = AnalyticCostModel(get_cluster("dgx-a100"))
    assert candidate_meshes(8) == [(8,), (2, 4), (4, 2), (2, 2, 2)] and candidate_meshes(1) == [(1,)]
    tables, sol, tried = solve_meshes(graph, model, 8)
    alone = {}
    for mesh in candidate_meshes(8):
        on = AnalyticCostModel(model.cluster, mesh=mesh)
        alone[mesh] = solve(build_tables(graph, on, 8), model=on).cost
    assert [t.mesh for t in tried] == candidate_meshes(8)
    assert [t.cost for t in tried] == pytest.approx([alone[m] for m in candidate_meshes(8)], rel=1e-12)
    assert sol.cost == pytest.approx(min(alone.values()), rel=1e-12)
    assert alone[tables.mesh] == pytest.approx(sol.cost, rel=1e-12)


def test_mesh_auto_stopped_keeps_the_best_so_far_and_says_when_nothing_fits():
    from shardplan.search.solve import PlanDoesNotFit, solve_meshes

    graph = build_model("alexnet", 8)
    model = AnalyticCostModel(get_cluster("dgx-a100"))

    def stop_at_third(i, n, mesh):
        if i == 2:
            raise KeyboardInterrupt

    tables, sol, tried = solve_meshes(graph, model, 8, progress=stop_at_third)
    assert [t.mesh for t in tried] == [(8,), (2, 4)] and tables.mesh in ((8,), (2, 4))
    with pytest.raises(PlanDoesNotFit, match="no plan fits on any of 4 meshes of 8 devices"):
        solve_meshes(graph, model, 8, memory_limit_bytes=1.0)


def test_cli_mesh_auto(capsys):
    assert main(["plan", "--model", "alexnet", "--devices", "8", "--mesh", "auto", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    tried = {tuple(t["mesh"]): t["predicted"] for t in out["meshes_tried"]}
    assert set(tried) == {(8,), (2, 4), (4, 2), (2, 2, 2)}
    assert tuple(out["mesh"]) in tried and out["cost"] == pytest.approx(min(tried.values()), rel=1e-9)


torch = pytest.importorskip("torch")


def test_a_64_rank_plan_made_for_a_mesh_runs_on_it_without_a_fallback():
    """A 7B-wide Llama layer for 64 devices planned on 4x4x4: the runtime lays it on 4x4x4 (``choose_mesh`` takes
    the plan's mesh), with no warning that moves may bring more than priced, and a dry-run step on
    that mesh works; laid on a mesh it was not made for, it is refused with the reason."""
    from shardplan.capture import capture
    from shardplan.capture.models import build, parse_config
    from shardplan.execute.apply import ApplyError, choose_mesh
    from shardplan.execute.dryrun import dry_run
    from shardplan.search.solve import solve

    config = "hidden_size=4096,intermediate_size=11008,num_hidden_layers=1,num_attention_heads=32," \
             "num_key_value_heads=32,vocab_size=32000"  # a 7B-wide layer: the search splits two dims
    module, kwargs = build("llama", batch=64, seq=512, device="meta", **parse_config(config))
    graph = capture(module, (), kwargs, name="llama")
    model = AnalyticCostModel(get_cluster("dgx-a100", devices=64), mesh=(4, 4, 4))
    tables = build_tables(graph, model, 64)
    plan = Plan.from_choice(tables, list(solve(tables, model=model).choice))
    assert plan.mesh == (4, 4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # choose_mesh's fallback warning would fail here
        assert choose_mesh(graph, plan) == (4, 4, 4)
        run = dry_run("llama", config, 64, 512, plan, graph)
    assert run.mesh == (4, 4, 4) and run.collectives
    import dataclasses

    elsewhere = dataclasses.replace(plan, mesh=(64,))
    assert any(len([f for _, f in p.split if f > 1]) > 1 for p in plan.ops)  # two dims split: not on (64,)
    with pytest.raises(ApplyError, match="was made for mesh 64"):
        choose_mesh(graph, elsewhere)


def test_run_lays_a_plan_file_on_the_mesh_asked_for_and_refuses_another(tmp_path):
    """``shardplan run --plan F --mesh M`` (``execute.launch.prepare``): a plan file made for M runs
    on M; one made for another mesh is refused before any process starts, naming both."""
    import dataclasses

    from shardplan.execute.apply import ApplyError
    from shardplan.execute.launch import capture_model, prepare
    from shardplan.search.solve import solve

    graph = capture_model("llama", "", 4, 16)
    on = AnalyticCostModel(get_cluster("dgx-a100", devices=8), mesh=(2, 4))
    tables = build_tables(graph, on, 8)
    path = tmp_path / "plan.json"
    path.write_text(Plan.from_choice(tables, list(solve(tables, model=on).choice)).to_json())
    plan, predicted = prepare("llama", "", 4, 16, 8, on, str(path), graph)
    assert plan.mesh == (2, 4) and predicted > 0
    with pytest.raises(ApplyError, match="was made for mesh 2x4; --mesh asks for 4x2"):
        prepare("llama", "", 4, 16, 8, dataclasses.replace(on, mesh=(4, 2)), str(path), graph)


def test_plan_says_when_the_runtime_cannot_run_its_priced_blocks(capsys):
    """The free plan of the 7B-wide Llama for 64 ranks is priced on the six axes of 64's primes and
    the runtime runs it on 2x4x8 (``cluster.mesh.runtime_mesh``, as ``choose_mesh`` does): the plan's
    JSON says so; planned with ``--mesh 2x4x8`` it runs where it was priced and says nothing."""
    hf = ["--hf", "llama", "--hf-config", "hidden_size=4096,intermediate_size=11008,num_hidden_layers=2,"
          "num_attention_heads=32,num_key_value_heads=32,vocab_size=32000", "--devices", "64", "--batch", "64",
          "--seq", "512", "--json", "-"]
    assert main(["plan", *hf]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runtime_mesh"] == [2, 4, 8] and "6-axis mesh 2x2x2x2x2x2" in out["runtime_mesh_note"]
    assert main(["plan", *hf, "--mesh", "2x4x8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mesh"] == [2, 4, 8] and "runtime_mesh_note" not in out


def test_run_mesh_auto_searches_every_mesh_then_runs_on_the_best(capsys):
    """``shardplan run --mesh auto --dry-run``: the plan is searched on 4 and 2x2 and stepped on the
    one predicted faster; with ``--plan`` the flag is refused (a plan file has its own mesh)."""
    from shardplan.cluster.mesh import candidate_meshes

    assert main(["run", "--model", "llama", "--devices", "4", "--mesh", "auto", "--dry-run", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert tuple(out["dry_run"]["mesh"]) in candidate_meshes(4) and out["predicted_step_seconds"] > 0
    assert main(["run", "--model", "llama", "--devices", "4", "--mesh", "auto", "--plan", "x.json", "--dry-run"]) == 2
    assert "with --plan give the plan's own mesh" in capsys.readouterr().err
