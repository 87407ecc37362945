"""Baseline plans, priced by the same tables as the searched plan.

* ``data_parallel``: every op splits only its batch dims, as far as the devices allow.
* ``owt``: Krizhevsky's "one weird trick" (arXiv 1404.5997): convolutions and everything else data
  parallel, fully connected layers model parallel (output features split over all devices).
* ``megatron``: Megatron-LM's tensor parallelism (Shoeybi et al. 2019) times data parallelism: heads,
  FFN hidden and vocabulary split t ways inside a node, batch split p / t ways; norms, residual adds
  and other ops batch-split only. t is the best of 1, 2, 4, 8 under the tables (tuned by an expert).
* ``greedy``: ops in graph order, each taking the configuration cheapest given those already chosen;
  the fallback plan when an exact search is stopped early.
Each returns one configuration index per op, or None where the baseline does not apply to the graph.
"""

from __future__ import annotations

import math

import numpy as np

from shardplan.cost.tables import CostTables
from shardplan.ir.graph import DimKind

TENSOR_PARALLEL_DIMS = ("heads", "ffn", "vocab")


def _closest(tables: CostTables, i: int, target: dict[str, int]) -> int:
    """The configuration of op i nearest (in log split factors) to ``target``; other dims unsplit."""
    op, cfgs = tables.graph.ops[i], tables.configs[i]
    want = np.array([target.get(d.name, 1) for d in op.dims], dtype=np.float64)
    distance = np.abs(np.log2(cfgs) - np.log2(want)).sum(axis=1)
    # prefer using more devices when two rows are equally near: subtract a tiny bonus
    distance -= 1e-6 * np.log2(cfgs.prod(axis=1))
    return int(np.argmin(distance))


def _batch_target(op, ways: int) -> dict[str, int]:
    """Spread ``ways`` over the op's batch dims, outermost first, each as far as its size allows."""
    target = {}
    for d in op.dims:
        if d.kind is DimKind.BATCH and d.splittable and ways > 1:
            f = math.gcd(d.size, ways)
            if f > 1:
                target[d.name] = f
                ways //= f
    return target


def data_parallel(tables: CostTables) -> list[int]:
    """Every op splits only its batch dims, as many ways as the devices allow (largest fitting factor)."""
    choice = []
    for i, op in enumerate(tables.graph.ops):
        batch_only = np.array([[c == 1 or d.kind is DimKind.BATCH for c, d in zip(row, op.dims)]
                               for row in tables.configs[i]]).all(axis=1)
        ways = np.where(batch_only, tables.configs[i].prod(axis=1), 0)
        choice.append(int(np.argmax(ways)))
    return choice


def owt(tables: CostTables) -> list[int] | None:
    """Data-parallel convolutions, model-parallel fully connected layers; None without convs."""
    graph = tables.graph
    if not any(op.kind == "conv" for op in graph.ops):
        return None
    choice = data_parallel(tables)
    for i, op in enumerate(graph.ops):
        if op.kind != "fc":
            continue
        weight = next(o for o in op.inputs if graph.tensor(o.tensor).is_param)
        out = set(op.outputs[0].dims())
        feature = [d.name for d in op.dims if d.name in weight.dims() and d.name in out]
        choice[i] = _closest(tables, i, {name: tables.devices for name in feature[:1]})
    return choice


def megatron(tables: CostTables, max_tensor_parallel: int = 8) -> list[int] | None:
    """Megatron-LM tensor x data parallelism with the best t <= ``max_tensor_parallel``; None if no TP dims."""
    graph, p = tables.graph, tables.devices
    if not any(d.name in TENSOR_PARALLEL_DIMS for op in graph.ops for d in op.dims):
        return None
    best, best_cost = None, math.inf
    t = 1
    while t <= min(p, max_tensor_parallel):
        if p % t == 0:
            choice = []
            for i, op in enumerate(graph.ops):
                target = _batch_target(op, p // t)
                tp = [d.name for d in op.dims if d.name in TENSOR_PARALLEL_DIMS]
                if tp:
                    target[tp[0]] = t
                choice.append(_closest(tables, i, target))
            cost = tables.cost_of(choice)
            if cost < best_cost:
                best, best_cost = choice, cost
        t *= 2
    return best


def greedy(tables: CostTables, node_cost: list[np.ndarray] | None = None) -> list[int]:
    """Ops in graph order; each takes the configuration cheapest given the ones already chosen."""
    n = len(tables.graph.ops)
    node_cost = node_cost or [nc.total for nc in tables.nodes]
    incoming: list[list] = [[] for _ in range(n)]
    for e in tables.edges:
        incoming[max(e.src, e.dst)].append(e)
    choice: list[int] = []
    for i in range(n):
        cost = np.array(node_cost[i], dtype=np.float64, copy=True)
        for e in incoming[i]:
            if e.dst == i:
                cost += e.cost[e.src_class[choice[e.src]], e.dst_class]
            else:
                cost += e.cost[e.src_class, e.dst_class[choice[e.dst]]]
        choice.append(int(np.argmin(cost)))
    return choice


BASELINES = {"data_parallel": data_parallel, "owt": owt, "megatron": megatron}
"""The expert baselines reported next to every plan (greedy is a fallback, not a baseline)."""


def all_baselines(tables: CostTables) -> dict[str, list[int]]:
    """Every baseline that applies to the graph, by name."""
    out = {}
    for name, fn in BASELINES.items():
        choice = fn(tables)
        if choice is not None:
            out[name] = choice
    return out
