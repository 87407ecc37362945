"""Joins of two activations (residual adds, SwiGLU's product) run in the layout the plan gives them.

Oracles: single-device training (the step still equals it), the plan (the join's output placements at
run time are the planned ones), and the graph (every join op of the captured graph is found at run
time). The ranks are threads.
"""

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

from shardplan.cluster import get_cluster  # noqa: E402
from shardplan.cost.analytic import AnalyticCostModel  # noqa: E402
from shardplan.cost.tables import build_tables  # noqa: E402
from shardplan.execute import apply  # noqa: E402
from shardplan.execute import joins as joins_mod  # noqa: E402
from shardplan.execute.joins import input_placements  # noqa: E402
from shardplan.execute.threaded import run_threaded  # noqa: E402
from shardplan.plan import Plan  # noqa: E402
from shardplan.search.baselines import data_parallel  # noqa: E402
from test_apply import reference  # noqa: E402  (tests/ is on the path: pytest's default import mode)


def test_input_placements_by_hand():
    """An output (8, 4, 6) split on dims 0 and 2: an input of the same shape is split alike; one of
    shape (6,) (a bias broadcast along the leading dims) keeps only the last dim's split; one of shape
    (8, 1, 6) broadcasts along dim 1 and keeps both; one of shape (4, 1) keeps neither."""
    out = (Shard(0), Shard(2))
    assert input_placements((8, 4, 6), (8, 4, 6), out) == [Shard(0), Shard(2)]
    assert input_placements((6,), (8, 4, 6), out) == [Replicate(), Shard(0)]
    assert input_placements((8, 1, 6), (8, 4, 6), (Shard(1), Shard(0))) == [Replicate(), Shard(0)]
    assert input_placements((4, 1), (8, 4, 6), out) == [Replicate(), Replicate()]
    assert input_placements((8, 4, 6), (8, 4, 6), (Replicate(),)) == [Replicate()]


def _run(module, kwargs, graph, plan, devices, monkeypatch):
    """Every rank's (loss, gradients, joins placed, {tagged tensor: placements}) of one step."""
    seen: dict = {}
    original = joins_mod.tag

    def recording(value, name):
        if isinstance(value, DTensor):
            seen.setdefault(name, tuple(value.placements))
        return original(value, name)

    monkeypatch.setattr(joins_mod, "tag", recording)
    return _steps(module, kwargs, graph, plan, (devices,), "last_joins_placed"), seen


def _steps(module, kwargs, graph, plan, shape, counter):
    """Every rank's (loss, full gradients, the parallel module's ``counter``) of one step on a mesh
    of ``shape`` (threaded ranks)."""
    def rank_fn(rank):
        local = copy.deepcopy(module)
        pm = apply(local, graph, plan, init_device_mesh("cpu", shape))
        out = pm(**kwargs)
        logits = getattr(out, "logits", out)
        loss = (logits.full_tensor() if isinstance(logits, DTensor) else logits).float().pow(2).mean()
        with pm.context():
            loss.backward()
            pm.reduce_gradients()
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in local.named_parameters() if p.grad is not None}
        return loss.item(), grads, getattr(pm, counter)

    return run_threaded(math.prod(shape), rank_fn)


def _assert_equal(results, loss, ref):
    scale = max(float(g.abs().max()) for g in ref.values())
    for got_loss, grads, _ in results:
        assert got_loss == pytest.approx(loss, rel=1e-5)
        assert set(grads) == set(ref)
        for n, g in grads.items():
            assert torch.allclose(g, ref[n], rtol=1e-5, atol=1e-6 * scale), n


def _with_split(tables, graph, choice, op_name, split: dict) -> list:
    """``choice`` with op ``op_name`` set to the configuration that splits its dims as ``split`` says."""
    i = next(k for k, op in enumerate(graph.ops) if op.name == op_name)
    want = [split.get(d, 1) for d in graph.ops[i].dim_names]
    j = int(np.flatnonzero((tables.configs[i] == want).all(axis=1))[0])
    return list(choice[:i]) + [j] + list(choice[i + 1:])


def test_a_skip_connection_runs_split_as_planned(monkeypatch):
    """The CNN's skip connection (``relu(conv3(x)) + x``), planned split by width while every other
    op is data parallel: it runs width-split (DTensor's propagation ran it split by batch, its
    inputs' layout), and the step equals single device."""
    module, kwargs, graph, loss, ref = reference("torch_cnn")
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=2)), 2)
    choice = _with_split(tables, graph, data_parallel(tables), "add", {"width": 2})
    results, seen = _run(module, kwargs, graph, Plan.from_choice(tables, choice), 2, monkeypatch)
    _assert_equal(results, loss, ref)
    width = graph.ops[next(k for k, op in enumerate(graph.ops) if op.name == "add")].dim_names.index("width")
    assert seen["add:out"] == (Shard(width),)
    assert all(placed == 1 for _, _, placed in results)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_every_join_of_a_transformer_is_found_at_run_time(name, monkeypatch):
    """Data parallel but every join (residual adds, SwiGLU's product, BERT's embedding sums) planned
    replicated: each runs replicated, one per join op of the graph is found, and the step equals
    single device."""
    module, kwargs, graph, loss, ref = reference(name)
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=2)), 2)
    joins = [op for op in graph.ops if op.kind == "elementwise"
             and len({o.tensor for o in op.inputs if not graph.tensor(o.tensor).is_param}) > 1]
    assert joins
    choice = list(data_parallel(tables))
    for op in joins:
        choice = _with_split(tables, graph, choice, op.name, {})
    results, seen = _run(module, kwargs, graph, Plan.from_choice(tables, choice), 2, monkeypatch)
    _assert_equal(results, loss, ref)
    assert all(placed == len(joins) for _, _, placed in results)
    for op in joins:
        assert seen[op.outputs[0].tensor] == (Replicate(),), op.name


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_attention_matmuls_run_in_their_planned_layout(name, monkeypatch):
    """Random plans on 2 and on 2x2 ranks: every batched matmul of attention (``q @ k^T``, ``p @ v``)
    runs with the roles its op's planned split gives each mesh axis, not in the layout ``q`` arrives
    in (before, a plan splitting attention by heads after batch-split projections ran it batch
    split), and the step still equals single device. Llama's example has grouped-query attention
    (2 kv heads for 4); GPT-2's q, k and v are views of one fused projection."""
    from shardplan.execute import matmul as matmul_mod
    from shardplan.execute.joins import planned_roles

    module, kwargs, graph, loss, ref = reference(name)
    einsums = [i for i, op in enumerate(graph.ops) if op.kind == "einsum"]
    assert len(einsums) == 4
    seen: list = []
    original = matmul_mod.local_matmul

    def recording(a, b):
        seen.append(tuple(matmul_mod.matmul_roles(a, b)))
        return original(a, b)

    monkeypatch.setattr(matmul_mod, "local_matmul", recording)
    for devices, shape, seeds in ((2, (2,), range(4)), (4, (2, 2), range(2))):
        tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=devices)), devices)
        for seed in seeds:
            rng = np.random.default_rng(seed)
            choice = [int(rng.integers(len(c))) for c in tables.configs]
            plan = Plan.from_choice(tables, choice)
            opmeshes = plan.mesh_view(graph, shape)[1]
            want = [planned_roles(graph.ops[i], opmeshes[i], shape) for i in einsums]
            seen.clear()

            results = _steps(module, kwargs, graph, plan, shape, "last_matmuls_placed")
            _assert_equal(results, loss, ref)
            assert all(placed == len(einsums) for _, _, placed in results)
            assert sorted(seen) == sorted(want * devices), (seed, seen, want)
