"""Load imbalance of routed experts (``cost.routing``), priced and run.

Oracles: closed forms of normal order statistics, a Monte-Carlo simulation of uniform top-k routing,
hand-summed expert shares, transformers' own router logits (for the measured profile), the rows each
rank's experts run at run time (threaded ranks), and the cost model with the load folded into the
op by hand."""

import dataclasses
import math

import numpy as np
import pytest

from shardplan.cost.routing import normal_max, profile_load, uniform_load


def test_expected_maximum_of_normals_matches_closed_forms():
    """E[max of g standard normals]: 0 for one, 1/sqrt(pi) for two, 3/(2 sqrt(pi)) for three, and
    Tippett's tabulated 1.02938 for four and 1.42360 for eight."""
    assert normal_max(1) == 0.0
    assert normal_max(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert normal_max(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), abs=1e-6)
    assert normal_max(4) == pytest.approx(1.02938, abs=1e-5)
    assert normal_max(8) == pytest.approx(1.42360, abs=1e-5)


@pytest.mark.parametrize("tokens,top_k,experts", [(512, 2, 8), (256, 1, 4), (1024, 2, 16)])
def test_uniform_routing_busiest_group_matches_a_simulation(tokens, top_k, experts):
    """Tokens each choosing ``top_k`` distinct experts uniformly at random, 800 draws: the mean over
    draws of the busiest group's rows over the mean rows agrees with the formula within 0.4% for
    every group count that divides the experts (the simulated means' standard error is 0.05-0.15%)."""
    rng = np.random.default_rng(0)
    draws = 800
    choice = np.argsort(rng.random((draws, tokens, experts)), axis=2)[:, :, :top_k]
    counts = np.stack([np.bincount(c.reshape(-1), minlength=experts) for c in choice])
    for g in (2, 4, 8):
        if experts % g:
            continue
        groups = counts.reshape(draws, g, -1).sum(axis=2)
        simulated = float(np.mean(groups.max(axis=1) / (tokens * top_k / g)))
        assert uniform_load(tokens, top_k, experts, g) == pytest.approx(simulated, abs=0.004), g
    assert uniform_load(tokens, top_k, experts, 1) == 1.0
    assert uniform_load(tokens, experts, experts, 2) == 1.0  # every token to every expert: balanced


def test_profile_load_sums_blocks_of_consecutive_experts():
    """Shares 0.1, 0.2, 0.3, 0.4: on 2 groups the blocks hold 0.3 and 0.7, the busiest 1.4x the mean;
    on 4 groups 0.4 is 1.6x; on one group 1; three groups do not split 4 experts."""
    shares = [0.1, 0.2, 0.3, 0.4]
    assert profile_load(shares, 2) == pytest.approx(1.4)
    assert profile_load(shares, 4) == pytest.approx(1.6)
    assert profile_load(shares, 1) == 1.0
    with pytest.raises(ValueError, match="4 experts do not split into 3"):
        profile_load(shares, 3)


def test_tile_load_takes_the_busiest_group_of_the_busiest_batch_tile():
    """4 samples x 4 experts. Whole batch on 2 groups: blocks get 12 and 20 rows of 32, the busiest
    20 / 16. Two tiles of 2 samples on 2 groups: cells (4, 12), (8, 8), the busiest 12 over the mean
    8; the whole batch's profile (1.25) would miss it. Cells that do not divide are refused."""
    from shardplan.cost.routing import tile_load

    rows = [[1, 1, 3, 3], [1, 1, 3, 3], [2, 2, 2, 2], [2, 2, 2, 2]]
    assert tile_load(rows, 1, 2) == pytest.approx(20 / 16)
    assert tile_load(rows, 1, 2) == pytest.approx(profile_load(np.sum(rows, axis=0), 2))
    assert tile_load(rows, 2, 2) == pytest.approx(12 / 8)
    assert tile_load(rows, 2, 1) == pytest.approx(16 / 16)
    assert tile_load(rows, 1, 1) == 1.0
    with pytest.raises(ValueError, match="4 samples x 4 experts do not split into 3 tiles x 2 groups"):
        tile_load(rows, 3, 2)


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral():
    """(module, kwargs, graph with the measured routing) of the small example Mixtral."""
    from shardplan.capture import capture
    from shardplan.capture.models import build
    from shardplan.capture.moe import measure_routing

    torch.manual_seed(0)
    module, kwargs = build("mixtral", batch=4, seq=16)
    module.eval()
    graph = capture(module, (), kwargs, name="mixtral")
    return module, kwargs, measure_routing(graph, module, kwargs)


def test_measured_routing_is_the_routers_top_k(mixtral):
    """Each block's profile counts the experts of the top-k of transformers' own router logits
    (``output_router_logits``), row for row, and sums to one."""
    module, kwargs, graph = mixtral
    with torch.no_grad():
        logits = module(**kwargs, output_router_logits=True).router_logits
    blocks = [op for op in graph.ops if op.kind == "moe"]
    assert len(blocks) == len(logits) == 2
    for op, lg in zip(blocks, logits):
        k, e = op.attr("top_k"), op.dim("experts").size
        counts = torch.bincount(lg.topk(k, dim=-1).indices.reshape(-1), minlength=e).double()
        assert op.attr("expert_shares") == pytest.approx((counts / counts.sum()).tolist(), abs=1e-12)


def test_meta_models_have_no_routing_to_measure():
    from shardplan.capture import capture
    from shardplan.capture.models import build
    from shardplan.capture.moe import measure_routing
    from shardplan.capture.values import CaptureError

    module, kwargs = build("mixtral", batch=2, seq=8, device="meta")
    graph = capture(module, (), kwargs, name="mixtral")
    with pytest.raises(CaptureError, match="meta device"):
        measure_routing(graph, module, kwargs)


def _tables(graph, devices, **kw):
    from shardplan.cluster import get_cluster
    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.tables import build_tables

    model = AnalyticCostModel(get_cluster("dgx-a100", devices=devices), **kw)
    return model, build_tables(graph, model, devices)


def _items(model, graph, op, config) -> dict:
    return {it.name: it.seconds[0] for it in model.node_cost_items(graph, op, config[None, :])}


def test_the_busiest_group_is_priced_as_its_load_folded_in_by_hand(mixtral):
    """A block split 2 ways by all-to-all with a measured profile of load L: its token all-to-alls
    cost what the uniform price costs with top-k scaled by L (every row move carries L x the mean
    rows), its compute what it costs with L - 1 more of the experts' GEMM FLOPs, and with the
    imbalance off both are the mean's. A profile of equal shares prices exactly as the mean."""
    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.routing import A2A

    _, _, graph = mixtral
    model, tables = _tables(graph, 2)
    i = next(k for k, op in enumerate(graph.ops) if op.kind == "moe")
    op = graph.ops[i]
    config = np.array([2 if d == A2A else 1 for d in op.dim_names])
    load = profile_load(op.attr("expert_shares"), 2)
    assert load > 1.0
    off = AnalyticCostModel(model.cluster, expert_imbalance=False)
    on = _items(model, graph, op, config)
    attrs = dict(op.attrs)
    scaled = dataclasses.replace(op, attrs=tuple(sorted({**attrs, "top_k": attrs["top_k"] * load}.items())))
    assert on["token_all_to_all"] == pytest.approx(_items(off, graph, scaled, config)["token_all_to_all"], rel=1e-12)
    heavier = dataclasses.replace(op, flops=op.flops + (load - 1) * attrs["grouped_flops"])
    assert on["compute"] == pytest.approx(_items(off, graph, heavier, config)["compute"], rel=1e-12)
    # the tiny block is memory-bound; with 10^4 times its FLOPs the busiest group's GEMMs show
    big = dataclasses.replace(op, flops=op.flops * 1e4,
                              attrs=tuple(sorted({**attrs, "grouped_flops": attrs["grouped_flops"] * 1e4}.items())))
    assert _items(model, graph, big, config)["compute"] > _items(off, graph, big, config)["compute"]
    even = dataclasses.replace(op, attrs=tuple(sorted({**attrs, "expert_shares": (0.25,) * 4,
                                                       "expert_rows": ((8,) * 4,) * 4}.items())))
    assert _items(model, graph, even, config) == pytest.approx(_items(off, graph, op, config), rel=1e-12)


def test_each_ranks_experts_run_the_rows_the_profile_gives_them(mixtral):
    """Expert parallel on 2 threaded ranks, by all-to-all and gathered: after a forward, each rank's
    experts ran exactly its block's share of the block's (token, choice) rows, so the busiest rank
    runs ``profile_load`` x the mean, the load the cost model prices."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from shardplan.execute.apply import apply
    from shardplan.execute.plans import expert_parallel
    from shardplan.execute.threaded import run_threaded
    from shardplan.plan import Plan

    module, kwargs, graph = mixtral
    _, tables = _tables(graph, 2)
    blocks = [op for op in graph.ops if op.kind == "moe"]
    tokens = kwargs["input_ids"].numel()
    for dispatch in ("all_to_all", "gather"):
        plan = Plan.from_choice(tables, expert_parallel(tables, dispatch))

        def rank_fn(rank):
            local = copy.deepcopy(module)
            pm = apply(local, graph, plan, init_device_mesh("cpu", (2,)))
            with torch.no_grad(), pm.context():
                pm(**kwargs)
            return [local.get_submodule(op.name + ".experts").last_rows for op in blocks]

        rows = run_threaded(2, rank_fn)
        for j, op in enumerate(blocks):
            shares = np.array(op.attr("expert_shares")).reshape(2, -1).sum(axis=1)
            total = tokens * op.attr("top_k")
            assert [r[j] for r in rows] == [round(s * total) for s in shares], (dispatch, op.name)
            assert max(r[j] for r in rows) / (total / 2) == pytest.approx(profile_load(op.attr("expert_shares"), 2))


def test_batch_tiles_route_on_their_own_ranks(mixtral):
    """4 threaded ranks as 2 (batch) x 2 (experts, all-to-all): each rank's experts run the rows its
    batch tile's samples send its block (``expert_rows`` summed by hand), so the busiest rank runs
    ``tile_load(rows, 2, 2)`` x the mean, which the model prices for that configuration."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from shardplan.cost.routing import A2A
    from shardplan.execute.apply import apply, choose_mesh
    from shardplan.execute.threaded import run_threaded
    from shardplan.cost.routing import tile_load
    from shardplan.plan import Plan

    module, kwargs, graph = mixtral
    model, tables = _tables(graph, 4)
    choice = [0] * len(graph.ops)
    blocks = [i for i, op in enumerate(graph.ops) if op.kind == "moe"]
    for i, op in enumerate(graph.ops):
        split = {"batch": 2, A2A: 2} if op.kind == "moe" else {"batch": 4}
        choice[i] = tables.index_of(i, tuple(split.get(d.name, 1) for d in op.dims))
    plan = Plan.from_choice(tables, choice)
    shape = choose_mesh(graph, plan)

    def rank_fn(rank):
        local = copy.deepcopy(module)
        pm = apply(local, graph, plan, init_device_mesh("cpu", shape))
        with torch.no_grad(), pm.context():
            pm(**kwargs)
        return [local.get_submodule(graph.ops[i].name + ".experts").last_rows for i in blocks]

    ran = run_threaded(4, rank_fn)
    for j, i in enumerate(blocks):
        op = graph.ops[i]
        rows = np.array(op.attr("expert_rows"))  # (4 samples, 4 experts)
        cells = rows.reshape(2, 2, 2, 2).sum(axis=(1, 3))  # (tile, group)
        assert sorted(r[j] for r in ran) == sorted(cells.reshape(-1).tolist()), op.name
        mean = rows.sum() / 4
        load = float(model.expert_load(op, tables.configs[i][[choice[i]]].astype(float))[0])
        assert load == pytest.approx(max(r[j] for r in ran) / mean) == pytest.approx(tile_load(rows, 2, 2))
