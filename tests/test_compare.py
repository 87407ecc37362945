"""``shardplan compare`` / ``simulate``: every method on the same tables; the exact plan never loses under
the cost model it minimises; the simulator's view reported as measured."""

import json
import math

import pytest

from shardplan.cluster.presets import get_cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.tables import build_tables
from shardplan.report.cli import main
from shardplan.report.compare import compare
from shardplan.search.baselines import all_baselines
from shardplan.search.mcmc import mcmc_search
from shardplan.search.solve import memory_of, solve
from shardplan.zoo import MODELS, build_model


@pytest.mark.parametrize("devices", [8, 64])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_exact_never_worse_than_rivals_under_the_cost_model(name, devices):
    c = get_cluster("dgx-a100", devices=devices)
    limit = c.device.memory_bytes
    tables = build_tables(build_model(name), AnalyticCostModel(c), devices)
    exact = solve(tables, memory_limit_bytes=limit)
    assert exact.optimal, exact.note
    rivals = dict(all_baselines(tables))
    rivals["mcmc"] = mcmc_search(tables, time_limit_s=None, max_iters=3000, seed=1, memory_limit_bytes=limit).choice
    for rival, choice in rivals.items():
        if memory_of(tables, choice) <= limit:
            assert exact.cost <= tables.cost_of(choice) * (1 + 1e-12), (name, devices, rival)


def test_compare_runs_every_method_and_reports_the_simulator():
    cmp = compare(build_model("alexnet"), get_cluster("dgx-a100"), 8, mcmc_iters=300, mcmc_seconds=30, seed=0)
    names = [m.name for m in cmp.methods]
    assert names[:4] == ["exact", "ilp", "mcmc", "optcnn"] and "data_parallel" in names and "owt" in names
    exact, ilp = cmp.get("exact"), cmp.get("ilp")
    assert exact.optimal and ilp.optimal and ilp.cost == pytest.approx(exact.cost, rel=1e-9)
    assert cmp.get("optcnn").cost == pytest.approx(exact.cost, rel=1e-9)
    for m in cmp.methods:
        assert m.cost >= exact.cost * (1 - 1e-12) or not m.fits, m.name
        assert m.simulated_seconds > 0 and m.peak_memory_bytes > 0 and m.search_seconds >= 0
    assert cmp.speedup("data_parallel") == 1.0
    assert cmp.speedup("exact") == pytest.approx(cmp.get("data_parallel").simulated_seconds / exact.simulated_seconds)
    # the same seed and proposal budget give the same MCMC plan
    again = compare(build_model("alexnet"), get_cluster("dgx-a100"), 8, mcmc_iters=300, mcmc_seconds=30, seed=0)
    assert again.get("mcmc").choice == cmp.get("mcmc").choice


def test_compare_cli_json(capsys):
    assert main(["compare", "--model", "mlp", "--devices", "8", "--mcmc-iters", "200", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"exact", "ilp", "mcmc", "data_parallel"} <= set(out["methods"])
    for name, row in out["methods"].items():
        if row["cost"] is None:
            assert row["note"], name  # a method that does not apply says why
            continue
        assert set(row) >= {"cost", "simulated_seconds", "search_seconds", "peak_memory_bytes"}
        assert math.isfinite(row["simulated_seconds"]) and row["peak_memory_bytes"] > 0
    best = min(r["cost"] for r in out["methods"].values() if r["cost"] is not None)
    assert out["methods"]["exact"]["cost"] <= best * (1 + 1e-12)  # a tie may differ in the last bit (sum order)
    assert main(["compare", "--model", "nosuch", "--devices", "8"]) == 2
    assert "unknown model 'nosuch'" in capsys.readouterr().err


def test_simulate_cli_writes_trace_and_png(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "alexnet", "--devices", "8", "--json", str(plan)]) == 0
    capsys.readouterr()
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["simulate", "--plan", str(plan), "--trace", str(trace), "--png", str(png), "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    cost = json.loads(plan.read_text())["cost"]
    assert 0 < out["iteration_seconds"] and out["plan_cost"] == cost
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" and e["dur"] > 0 for e in events)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--plan", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_simulate_cli_pipeline_plan(tmp_path, capsys):
    plan = tmp_path / "pp.json"
    assert main(["plan", "--model", "gpt", "--size", "1.3b", "--pipeline", "--devices", "16", "--memory-limit", "6",
                 "--json", str(plan)]) == 0  # 6 GiB forces two stages
    capsys.readouterr()
    assert main(["simulate", "--plan", str(plan), "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    raw = json.loads(plan.read_text())
    assert len(raw["stages"]) >= 2 and out["bubble_fraction"] > 0
    # equal stages, 1F1B: the event replay of the schedule reproduces the planner's closed form
    # (m - 1) max T + sum T + max S
    assert out["iteration_seconds"] == pytest.approx(raw["cost"], rel=1e-6)
