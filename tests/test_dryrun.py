"""``shardplan run --dry-run``: a plan's step as rank 0 of a fake process group, in fake tensors.

Oracles: the collectives the runtime issues against those the cost model prices (each activation
all-reduce of tensor parallelism is one priced item), and the data-parallel gradient buckets
against the parameters' bytes counted by hand."""

import json

import pytest

torch = pytest.importorskip("torch")

from shardplan.capture import capture  # noqa: E402
from shardplan.capture.models import build  # noqa: E402
from shardplan.cluster import get_cluster  # noqa: E402
from shardplan.cost.analytic import AnalyticCostModel  # noqa: E402
from shardplan.cost.tables import build_tables  # noqa: E402
from shardplan.execute.dryrun import dry_run  # noqa: E402
from shardplan.execute.plans import tensor_parallel  # noqa: E402
from shardplan.plan import Plan  # noqa: E402
from shardplan.report.cli import main  # noqa: E402
from shardplan.search.baselines import data_parallel  # noqa: E402

LLAMA = "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,vocab_size=128"


def _tables(name, config, devices, batch, seq):
    from shardplan.capture.models import parse_config

    module, kwargs = build(name, batch=batch, seq=seq, device="meta", **parse_config(config))
    graph = capture(module, (), kwargs, name=name)
    model = AnalyticCostModel(get_cluster("dgx-a100", devices=devices))
    return graph, model, build_tables(graph, model, devices)


def test_tensor_parallel_llama_issues_exactly_the_all_reduces_the_model_prices():
    """Megatron's Llama on 2 ranks: every forward partial sum (o_proj, down_proj) and every input
    gradient of a column-split projection (q, k, v, gate, up: DTensor reduces each on its own) is one
    priced all-reduce of one activation; the runtime issues the same number, of the same bytes."""
    graph, model, tables = _tables("llama", LLAMA, 2, 4, 16)
    choice = tensor_parallel(tables)
    priced = []
    for i, op in enumerate(graph.ops):
        for item in model.node_cost_items(graph, op, tables.configs[i][choice[i]:choice[i] + 1]):
            if item.name in ("output_allreduce", "input_grad_allreduce") and item.seconds[0] > 0:
                priced.append(graph.tensor(item.tensor).nbytes)
    assert len(priced) == 2 * 7  # per layer: 2 forward partial sums, 5 input gradients
    run = dry_run("llama", LLAMA, 4, 16, Plan.from_choice(tables, choice))
    seen = sorted(c.nbytes for c in run.collectives if c.kind == "all_reduce" and c.phase != "gradients")
    assert seen == sorted(priced)
    assert all(c.ranks == 2 for c in run.collectives)
    assert run.to_dict()["by_phase"] == {"forward": 2 * 2 + sum(c.kind == "broadcast" for c in run.collectives),
                                         "backward": 2 * 5, "gradients": 0}


def test_data_parallel_on_64_ranks_reduces_every_parameter_once_without_64_processes():
    """A data-parallel plan for 64 ranks, checked in one process: one mesh axis of 64, the bucketed
    gradient all-reduces carry the parameters' bytes exactly (4 per fp32 parameter, counted from
    the module), over groups of 64, after the backward pass."""
    graph, model, tables = _tables("torch_mlp", "", 64, 64, 1)
    plan = Plan.from_choice(tables, data_parallel(tables))
    run = dry_run("torch_mlp", "", 64, 1, plan)
    assert run.mesh == (64,)
    module, _ = build("torch_mlp", batch=64)
    grads = [c for c in run.collectives if c.phase == "gradients"]
    assert grads and all(c.kind == "all_reduce" and c.ranks == 64 for c in grads)
    assert sum(c.nbytes for c in grads) == 4 * sum(p.numel() for p in module.parameters())


def test_gradient_buckets_report_the_group_they_reduce_over():
    """The MLP's batch split 2 ways on 4 ranks (a 2x2 mesh, the other axis replicating): each
    bucketed gradient all-reduce runs over the batch axis's 2 ranks, and the dry run says so (c10d
    passes the group boxed in a script object; before, the recorder fell back to the world's 4)."""
    graph, model, tables = _tables("torch_mlp", "", 4, 8, 1)
    choice = [tables.index_of(i, tuple(2 if d.kind.name == "BATCH" else 1 for d in op.dims))
              for i, op in enumerate(graph.ops)]
    run = dry_run("torch_mlp", "", 8, 1, Plan.from_choice(tables, choice))
    assert run.mesh == (2, 2)
    grads = [c for c in run.collectives if c.phase == "gradients"]
    assert grads and all(c.kind == "all_reduce" and c.ranks == 2 for c in grads)


def test_cli_dry_run_json_and_refusals(capsys, tmp_path):
    assert main(["run", "--model", "torch_mlp", "--devices", "4", "--batch", "8", "--dry-run", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == 4 and out["predicted_step_seconds"] > 0
    assert out["dry_run"]["mesh"] and out["dry_run"]["collectives"]
    assert main(["run", "--model", "torch_mlp", "--dry-run", "--check"]) == 2
    assert "nothing to --check" in capsys.readouterr().err


def test_mixtral_split_over_its_experts_runs_in_fake_tensors():
    """Expert parallelism in a dry run: transformers' routed experts call a grouped product whose
    fake version refuses fp32 (its library fallback is used), and each rank's expert range is read
    from the weight's placements as plain integers. A random plan, its first MoE block split 2
    (batch) x 2 (experts, tokens gathered) and its second 2 (batch) x 2 (experts, tokens sent by
    all-to-all), applies and steps on a 2x2 mesh; the all-to-alls rank 0 issues are the ones the
    cost model prices: per block, forward the row counts (8 bytes per peer), the rows' expert ids
    (8 bytes a row) and the rows there and back, backward the rows' gradients both ways, where a
    rank's rows are its 8 x 16 / 4 tokens x top-2 (uniform routing, as the fake tensors assume; the
    model prices the busiest rank's, uniform routing's expected maximum)."""
    import numpy as np

    graph, model, tables = _tables("mixtral", "", 4, 8, 16)
    rng = np.random.default_rng(2)
    choice = [int(rng.integers(len(c))) for c in tables.configs]
    blocks = [i for i, op in enumerate(graph.ops) if op.kind == "moe"]
    assert len(blocks) == 2
    for i, split in zip(blocks, ({"batch": 2, "experts": 2}, {"batch": 2, "experts_a2a": 2})):
        choice[i] = tables.index_of(i, tuple(split.get(d.name, 1) for d in graph.ops[i].dims))
    plan = Plan.from_choice(tables, choice)
    run = dry_run("mixtral", "", 8, 16, plan)
    assert run.mesh == (2, 2) and run.collectives
    rows, features = 8 * 16 // 4 * 2, graph.ops[blocks[1]].dim("features").size
    seen = [(c.nbytes, c.ranks, c.phase) for c in run.collectives if c.kind == "all_to_all" and not c.source]
    assert seen == [(8 * 2, 2, "forward"), (8 * rows, 2, "forward")] + [(4 * rows * features, 2, "forward")] * 2 + [
        (4 * rows * features, 2, "backward")] * 2
    items = {it.name: it for it in model.node_cost_items(graph, graph.ops[blocks[1]],
                                                         tables.configs[blocks[1]][[choice[blocks[1]]]])}
    cluster, q = model.cluster, np.array([[2.0, 1.0]])  # two devices of one node
    from shardplan.cluster.model import collective_seconds

    from shardplan.cost.routing import uniform_load

    def a2a(n):
        return float(collective_seconds(cluster, "all_to_all", np.array([float(n)]), q)[0])
    # the model prices the busiest rank's rows, uniform routing's expectation over the 64 tokens of a
    # batch tile (top-2 of 4 experts, 2 groups): L times the mean rows the fake tensors send, in every
    # message but the row counts
    load = uniform_load(8 * 16 / 2, 2, 4, 2)
    assert 1.0 < load < 1.1
    scaled = [(n if j == 0 else n * load, ph) for j, (n, _, ph) in enumerate(seen)]
    priced = items["token_all_to_all"]
    assert float(priced.fwd[0]) == pytest.approx(sum(a2a(n) for n, ph in scaled if ph == "forward"), rel=1e-12)
    assert float(priced.bwd[0]) == pytest.approx(sum(a2a(n) for n, ph in scaled if ph == "backward"), rel=1e-12)
    gathered = {it.name: it for it in model.node_cost_items(graph, graph.ops[blocks[0]],
                                                            tables.configs[blocks[0]][[choice[blocks[0]]]])}
    assert float(gathered["token_all_to_all"].seconds[0]) == 0.0  # the gathered block moves no rows


def test_plan_verify_hf_llama_on_a_2x2_mesh(capsys):
    """``shardplan plan --hf llama --verify``: the searched plan for 4 ranks is applied to the
    full-width model in fake tensors and stepped once; the JSON holds what rank 0 issued."""
    args = ["plan", "--hf", "llama", "--hf-config", "hidden_size=512,intermediate_size=2048,num_hidden_layers=1,"
            "num_attention_heads=8,num_key_value_heads=8,vocab_size=4000", "--devices", "4", "--batch", "8",
            "--seq", "128", "--verify", "--json", "-"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    v = out["verified"]
    assert v["devices"] == 4 and 4 == __import__("math").prod(v["mesh"])
    assert sum(c["count"] for c in v["collectives"].values()) > 0


def test_plan_verify_a_user_module(tmp_path, monkeypatch, capsys):
    """``--module pkg:fn --input-shape``: a user's own CNN, planned and verified on 2 ranks; without a
    PyTorch model (``--model``) --verify is refused, naming what it needs."""
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),\n"
        "                               torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 10))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--module", "my_models:build", "--input-shape", "16,3,8,8", "--devices", "2",
                 "--verify", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verified"]["devices"] == 2 and out["verified"]["mesh"] == [2]
    assert main(["plan", "--model", "mlp", "--devices", "2", "--verify"]) == 2
    assert "give --hf or --module" in capsys.readouterr().err


def test_the_local_copies_of_redistributions_are_the_ones_the_model_prices():
    """Random Llama plans on 2 ranks: the bytes DTensor's redistributions copy locally in a step
    (concatenations after gathers along an inner dim, copies of cuts along one), traced, against
    what the model charges on the plan's edges (``inner_copy_words``, forward and backward). Copies
    the model does not see (inside joins and the per-rank batched matmul) keep them from equal."""
    import numpy as np

    from shardplan.cost.analytic import inner_copy_words
    from shardplan.cost.configs import operand_layouts

    graph, model, tables = _tables("llama", LLAMA, 2, 4, 16)
    priced, traced = [], []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        choice = [int(rng.integers(len(c))) for c in tables.configs]
        total = 0.0
        for e in graph.edges():
            src, dst = graph.ops[e.src], graph.ops[e.dst]
            s = operand_layouts(src, tables.configs[e.src][choice[e.src]:choice[e.src] + 1], src.outputs[e.src_out].axes)
            d = operand_layouts(dst, tables.configs[e.dst][choice[e.dst]:choice[e.dst] + 1], dst.inputs[e.dst_in].axes)
            spec = graph.tensor(e.tensor)
            total += (inner_copy_words(spec.shape, s, d)[0, 0] + inner_copy_words(spec.shape, d, s)[0, 0]) * 4
        priced.append(total)
        traced.append(dry_run("llama", LLAMA, 4, 16, Plan.from_choice(tables, choice)).copy_bytes)
    assert all(p > 0 for p in priced)
    assert all(0.75 < t / p < 1.3 for t, p in zip(traced, priced)), (traced, priced)
    assert 0.85 < sum(traced) / sum(priced) < 1.2


def test_a_64_rank_searched_plan_lays_on_three_mesh_axes_and_steps_in_seconds():
    """The searched plan of a Llama for 64 devices (batch split 8 ways, features 2 ways inside
    groups) lays on a 3-axis mesh; before, the runtime fell back to the 6 axes of 64's prime factors,
    where DTensor's sharding propagation did not finish a step in 95 s. Both the mesh and a dry-run
    step are checked (the step well under a minute here)."""
    import time

    from shardplan.cluster.mesh import factorizations
    from shardplan.execute.apply import choose_mesh
    from shardplan.search.solve import solve

    assert factorizations(8, 2) == [(2, 4), (4, 2)] and factorizations(8, 3) == [(2, 2, 2)]
    assert factorizations(12, 3) == [(2, 2, 3), (2, 3, 2), (3, 2, 2)] and factorizations(7, 2) == []
    config = "hidden_size=512,intermediate_size=1024,num_hidden_layers=1,num_attention_heads=8," \
             "num_key_value_heads=8,vocab_size=512"
    graph, model, tables = _tables("llama", config, 64, 64, 64)
    plan = Plan.from_choice(tables, list(solve(tables, model=model).choice))
    mesh = choose_mesh(graph, plan)
    assert len(mesh) <= 3, mesh
    t0 = time.perf_counter()
    run = dry_run("llama", config, 64, 64, plan)
    assert run.mesh == mesh and run.collectives
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize("extra", [["--dry-run"], ["--plan", "other.json"]])
def test_a_plan_file_that_cannot_be_read_is_refused_in_one_line(tmp_path, capsys, extra):
    """Several plan files, or a dry run: a missing one is named in one line, not a traceback (the check
    for pipeline plans opened the files outside the refusal)."""
    missing = str(tmp_path / "missing.json")
    assert main(["run", "--model", "torch_mlp", "--plan", missing, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.json" in err[0], err


MIXTRAL_8X7B = ("hidden_size=4096,intermediate_size=14336,num_hidden_layers=2,num_attention_heads=32,"
                "num_key_value_heads=8,vocab_size=32000,num_local_experts=8,num_experts_per_tok=2,"
                "max_position_embeddings=4096")


def test_nested_moves_of_the_mixtral_plan_are_one_exchange_each(monkeypatch):
    """The searched Mixtral-8x7B-shaped plan on 8 ranks of dgx-a100 (all-to-alls as on NCCL), on the
    2x2x2 mesh whose blocks the tables priced: its moves of dims split over several mesh axes go by
    one exchange each (execute.exchange), and the step's moves bring in 54% of the bytes DTensor's
    axis-by-axis unsharding does (612 MB against 1158 MB here). The embedding's output, split 8 ways by its
    features, moves to q_proj's batch 4 x features 2: the busiest rank receives its whole tile, what
    the tables price (cost.moves.placed_words), where PaSE's rule of best overlap counts 3/4 of it."""
    from torch.distributed.tensor import Shard

    from shardplan.cost.tables import edge_layouts
    from shardplan.execute import exchange
    from shardplan.execute.launch import capture_model
    from shardplan.search.solve import solve

    graph = capture_model("mixtral", MIXTRAL_8X7B, 8, 2048)
    model = AnalyticCostModel(get_cluster("dgx-a100"))
    tables = build_tables(graph, model, 8)
    choice = solve(tables).choice
    plan = Plan.from_choice(tables, choice)
    logits = 8 * 2048 * 32000 * 4

    def bytes_in(run):
        moved = sum(c.nbytes * (c.ranks - 1) / c.ranks for c in run.collectives
                    if c.source == "redistribution" and c.nbytes < logits // 4)
        return moved + sum(m.busiest_bytes for m in run.exchanges)

    ours = dry_run("mixtral", MIXTRAL_8X7B, 8, 2048, plan, graph, all_to_all=True)
    assert ours.mesh == (2, 2, 2) and ours.exchanges
    tile = 2 * 2048 * 2048 * 4  # batch 8 / 4, hidden 4096 / 2, fp32
    embed_move = [m for m in ours.exchanges if m.src == (Shard(2),) * 3 and m.dst == (Shard(0), Shard(0), Shard(2))]
    assert embed_move and {m.busiest_bytes for m in embed_move} == {tile}
    mesh = model.edge_mesh(8)
    (edge,) = [e for e in graph.edges() if graph.ops[e.src].name == "model.embed_tokens"
               and graph.ops[e.dst].name == "model.layers.0.self_attn.q_proj"]
    src, dst = graph.ops[edge.src], graph.ops[edge.dst]
    s = edge_layouts(src, tables.configs[edge.src][[choice[edge.src]]], src.outputs[edge.src_out].axes, mesh)
    d = edge_layouts(dst, tables.configs[edge.dst][[choice[edge.dst]]], dst.inputs[edge.dst_in].axes, mesh)
    assert model.edge_bytes(graph.tensor(edge.tensor), s, d, mesh)[0][0, 0] == tile
    assert model.edge_bytes(graph.tensor(edge.tensor), s[:, :3], d[:, :3])[0][0, 0] == 0.75 * tile
    with monkeypatch.context() as m:
        m.setattr(exchange, "applies", lambda src, dst: False)
        theirs = dry_run("mixtral", MIXTRAL_8X7B, 8, 2048, plan, graph, all_to_all=True)
    assert not theirs.exchanges
    assert bytes_in(ours) < 0.6 * bytes_in(theirs)


def test_grouped_query_kv_move_as_the_projections_output_priced():
    """Data parallel but both attention matmuls planned split by heads, on a Llama with 2 kv heads for
    4 heads: each layer's forward moves q, k, v and the attention output once, each as the graph
    tensor the plan's edge prices (k and v at the kv projections' size: they move before
    ``repeat_kv`` expands them, not after, which moved twice the bytes), and the logits once for the
    loss. Before attention ran as planned, it ran batch split like q and moved none of them."""
    import numpy as np

    config = LLAMA.replace("num_key_value_heads=4", "num_key_value_heads=2")
    graph, model, tables = _tables("llama", config, 2, 4, 16)
    choice = list(data_parallel(tables))
    for i, op in enumerate(graph.ops):
        if op.kind == "einsum":
            want = [2 if d == "heads" else 1 for d in op.dim_names]
            choice[i] = int(np.flatnonzero((tables.configs[i] == want).all(axis=1))[0])
    run = dry_run("llama", config, 4, 16, Plan.from_choice(tables, choice))
    expected = []
    for layer in range(2):
        attn = f"model.layers.{layer}.self_attn"
        for t in (f"{attn}.q_proj:out", f"{attn}.k_proj:out", f"{attn}.v_proj:out", f"{attn}#einsum1:out"):
            expected.append(graph.tensor(t).nbytes)
    expected.append(graph.tensor(graph.ops[-1].outputs[0].tensor).nbytes)  # the logits
    gathers = [c.nbytes for c in run.collectives if c.phase == "forward" and c.kind == "all_gather"]
    assert graph.tensor("model.layers.0.self_attn.k_proj:out").nbytes * 2 == graph.tensor(
        "model.layers.0.self_attn.q_proj:out").nbytes
    assert sorted(gathers) == sorted(expected)


def test_a_row_split_convolution_exchanges_its_halo_as_priced():
    """The CNN's first convolution split by rows 4 ways (the rest data parallel) on 4 ranks: rank 0
    sends its block's last row to rank 1 in one all-to-all, the forward half of the halo the model
    prices (a 3x3 kernel: one row from each side for a middle rank); the image needs no gradient, so
    none goes back, and the model prices no backward half."""
    graph, model, tables = _tables("torch_cnn", "", 4, 4, 1)
    choice = list(data_parallel(tables))
    i = graph.op_index("conv1")
    choice[i] = tables.index_of(i, tuple(4 if d.name == "height" else 1 for d in graph.ops[i].dims))
    run = dry_run("torch_cnn", "", 4, 1, Plan.from_choice(tables, choice))
    halos = [c for c in run.collectives if c.source == "halo"]
    row = 4 * 3 * 16 * 4  # batch x channels x width x fp32
    assert [(c.kind, c.phase, c.nbytes, c.ranks) for c in halos] == [("all_to_all", "forward", row, 4)]
    items = {it.name: it for it in model.node_cost_items(graph, graph.ops[i], tables.configs[i][choice[i]:choice[i] + 1])}
    assert items["halo"].seconds[0] > 0 and items["halo"].bwd[0] == 0


def test_moves_into_a_pooled_map_are_of_the_pooled_map_as_priced():
    """conv1 split by batch, conv2 by output channels (its input whole on both ranks), on 2 ranks:
    the runtime gathers the pooled map conv2 reads, a quarter of conv1's output, and the cost
    tables price that edge at the bytes each rank lacks of it. With conv1 and conv2 both split by
    rows, each rank pools its own block and conv2 only exchanges one pooled row (its halo) forward
    and its gradient back."""
    graph, model, tables = _tables("torch_cnn", "", 2, 4, 1)
    i1, i2 = graph.op_index("conv1"), graph.op_index("conv2")

    def plan(**splits):
        choice = list(data_parallel(tables))
        for i, ways in ((i1, splits["conv1"]), (i2, splits["conv2"])):
            choice[i] = tables.index_of(i, tuple(ways.get(d.name, 1) for d in graph.ops[i].dims))
        return choice

    choice = plan(conv1={"batch": 2}, conv2={"out_channels": 2})
    run = dry_run("torch_cnn", "", 4, 1, Plan.from_choice(tables, choice))
    pooled = graph.read_spec(graph.ops[i2].inputs[0])
    assert pooled.nbytes == 4 * 16 * 8 * 8 * 4
    gathers = [c.nbytes for c in run.collectives if c.phase == "forward" and c.kind == "all_gather"]
    assert gathers[0] == pooled.nbytes
    edge = next(e for e in tables.edges if (e.src, e.dst) == (i1, i2))
    priced = float(edge.cost[edge.src_class[choice[i1]], edge.dst_class[choice[i2]]])
    from shardplan.cost.tables import edge_layouts
    mesh = model.edge_mesh(2)
    src = edge_layouts(graph.ops[i1], tables.configs[i1][choice[i1]:choice[i1] + 1], graph.ops[i1].outputs[0].axes, mesh)
    dst = edge_layouts(graph.ops[i2], tables.configs[i2][choice[i2]:choice[i2] + 1], graph.ops[i2].inputs[0].axes, mesh)
    fwd, _ = model.edge_bytes(pooled, src, dst, mesh)
    assert float(fwd[0, 0]) == pooled.nbytes / 2 and priced > 0

    choice = plan(conv1={"height": 2}, conv2={"height": 2})
    run = dry_run("torch_cnn", "", 4, 1, Plan.from_choice(tables, choice))
    halos = [(c.phase, c.nbytes) for c in run.collectives if c.source == "halo"]
    assert halos == [("forward", 4 * 3 * 16 * 4), ("forward", 4 * 16 * 8 * 4), ("backward", 4 * 16 * 8 * 4)]
    edge = next(e for e in tables.edges if (e.src, e.dst) == (i1, i2))
    assert float(edge.cost[edge.src_class[choice[i1]], edge.dst_class[choice[i2]]]) == 0.0
    conv1_maps = {pooled.nbytes, graph.tensor("conv1:out").nbytes}  # without LocalPooling: gathered backward
    assert not [c for c in run.collectives if c.source == "redistribution" and c.nbytes in conv1_maps]


def test_a_vocabulary_split_table_sums_its_lookups_in_one_priced_all_reduce():
    """Llama's embedding table split by rows over 2 ranks (the rest data parallel): each rank looks
    up its half of the vocabulary and the partial outputs are summed in one forward all-reduce of the
    embedding's output, the one the model prices (``output_allreduce``); no gradient moves back
    through it (the ids need none), and the table's gradient stays split by rows: it is reduced with
    the other gradients over the batch only, here not at all."""
    graph, model, tables = _tables("llama", LLAMA, 2, 4, 16)
    choice = list(data_parallel(tables))
    i = next(k for k, op in enumerate(graph.ops) if op.kind == "embedding")
    op = graph.ops[i]
    choice[i] = tables.index_of(i, tuple(2 if d.name == "vocab" else 1 for d in op.dims))
    items = model.node_cost_items(graph, op, tables.configs[i][choice[i]:choice[i] + 1])
    priced = [graph.tensor(it.tensor).nbytes for it in items if it.name == "output_allreduce" and it.seconds[0] > 0]
    out = graph.tensor(op.outputs[0].tensor).nbytes
    assert priced == [out] == [4 * 16 * 64 * 4]
    run = dry_run("llama", LLAMA, 4, 16, Plan.from_choice(tables, choice))
    reduced = [c for c in run.collectives if c.kind == "all_reduce" and c.phase != "gradients"]
    assert [(c.phase, c.nbytes, c.ranks) for c in reduced] == [("forward", out, 2)]
    buckets = sum(c.nbytes for c in run.collectives if c.phase == "gradients")
    reduced = {}
    for k, o in enumerate(graph.ops):
        for it in model.node_cost_items(graph, o, tables.configs[k][choice[k]:choice[k] + 1]):
            if it.name == "weight_grad_allreduce" and it.seconds[0] > 0:
                reduced[it.tensor] = graph.tensor(it.tensor).nbytes
    # the table's rows stay put; every other gradient is reduced as priced, but for the first norm's
    # scale: the model prices a folded norm in its reader's layout (q_proj's, batch split), while it
    # runs on the lookup's sum, whole on both ranks, so its gradient is whole (256 bytes, not reduced)
    assert op.inputs[1].tensor not in reduced
    norm = reduced.pop("model.layers.0.input_layernorm.weight")
    assert buckets == sum(reduced.values()) == sum(t.nbytes for t in graph.tensors if t.is_param) - 128 * 64 * 4 - norm
