"""The predicted step of a whole SPMD plan: waits at its sync points, on top of the per-op cost tables.

The cost tables (``cost.analytic``) price each op and edge on its own, so that the exact search's
objective adds up over ops. What ranks wait for their slowest peer depends on how much compute lies
between two sync points of the whole plan: ``jitter_waits`` walks one training step in program order,
``sync_waits`` and ``step_seconds`` price a plan with it, and ``StepObjective`` prices thousands of
plans for a local search (``search.polish``). Formulas in ``docs/cost_model.md``.
"""

from __future__ import annotations

import numpy as np

from shardplan.cost.analytic import PER_ITERATION, AnalyticCostModel


def jitter_waits(jitter: float, fwd, bwd, fwd_sync, bwd_sync, moved, reduces: bool,
                 after_backward: float, horizon: float | None = None,
                 moved_back=None, exponent: float = 0.5) -> dict[tuple[str, int], float]:
    """Seconds waited at each sync point of one training step, in program order (see ``sync_waits``):
    ``{("before fwd", i): s, ("after fwd", i): s, ("after bwd", i): s, ("inputs bwd", i): s,
    ("reduce", -1): s, ("end", -1): s}``, each ``jitter x T ^ exponent``, ``T`` the compute since
    the previous sync point counted up to ``horizon`` seconds (``Device.sync_jitter_exponent``,
    ``Device.sync_jitter_horizon``; None: all of it; no compute, no wait). Per op ``i``: ``fwd[i]``
    and ``bwd[i]`` its compute in each pass (seconds, no stretch), ``fwd_sync[i]`` /
    ``bwd_sync[i]`` whether a critical collective ends that pass, ``moved[i]`` whether a collective
    brings it an input (a redistribution that moves bytes between ranks), ``moved_back[i]`` whether
    one takes an input's gradient back (None: as ``moved``); ``reduces``: a bucketed weight-gradient
    reduction follows the backward pass; ``after_backward``: the bucket copies and updates before the
    step's end. The cost model and the event simulator both place their waits by this one walk."""
    waits: dict[tuple[str, int], float] = {}
    since = 0.0
    moved_back = moved if moved_back is None else moved_back

    def sync(key: tuple[str, int]) -> None:
        nonlocal since
        t = since if horizon is None else min(since, horizon)
        waits[key] = jitter * t ** exponent if t > 0 else 0.0
        since = 0.0

    for i in range(len(fwd)):
        if moved[i]:
            sync(("before fwd", i))
        since += fwd[i]
        if fwd_sync[i]:
            sync(("after fwd", i))
    for i in range(len(fwd) - 1, -1, -1):
        since += bwd[i]
        if bwd_sync[i]:
            sync(("after bwd", i))
        if moved_back[i]:
            sync(("inputs bwd", i))
    if reduces:
        sync(("reduce", -1))
    since += after_backward
    sync(("end", -1))
    return waits


def sync_waits(model: AnalyticCostModel, tables, choice) -> tuple[float, float]:
    """(jitter waits, per-op sync stretch) of one SPMD plan, in seconds per step.

    The cost tables price waiting at sync points per op (``sync_wait``: ``sync_stretch`` x the
    compute of an op whose pass ends in a critical collective), so that the search's objective adds
    up over ops. What the ranks actually wait depends on how much compute lies between two sync
    points, which is a property of the whole plan: after ``T`` seconds of compute since the last
    sync point the slowest rank trails by about ``sync_jitter x T ^ exponent`` (``Device.sync_jitter``
    and ``Device.sync_jitter_exponent``, 0.5 for a random walk; ``T`` counted up to
    ``Device.sync_jitter_horizon``, after which the wait stops growing).
    The walk (``jitter_waits``) follows one step in program order, as ``shardplan run`` takes it:

    * forward, op by op: a redistribution into the op that moves bytes between ranks (a collective;
      not a local cut, which only pays its copies and DTensor's host work) is a sync point before
      its compute; a critical collective of its forward (a partial-sum all-reduce, a statistics
      all-reduce, a halo, the loss gather) is one after it;
    * backward, ops in reverse: the critical collectives of its backward (the input-gradient
      all-reduce) after its compute, then the backward of its incoming redistributions where that
      is a collective (the gradient of an all-gather into a whole op comes back by a local cut);
    * the bucketed weight-gradient reduction after the backward pass, when the plan has one;
    * the bucket copies and the optimizer update, then the end of the step, timed on the slowest
      rank: the last sync point.

    The first figure is the waits' sum (0 on one device); the second is what the tables charged
    instead, the plan's ``sync_wait`` items. ``step_seconds`` swaps one for the other."""
    objective = StepObjective(model, tables, [np.array([c]) for c in choice])
    moved = _edge_pass(objective._edges, len(choice), choice)[1]
    return objective.sync_waits([0] * len(choice), moved)


def _moved(tables, choice) -> tuple[list[bool], list[bool]]:
    """Per op under ``choice``: whether a collective brings it an input in the forward pass, and
    whether one takes an input's gradient back in the backward pass (``EdgeTable.sync_code``)."""
    return _edge_pass(_edge_rows(tables), len(tables.graph.ops), choice)[1]


def _edge_rows(tables) -> list[tuple]:
    """The fields of every edge table that :func:`_edge_pass` reads, unpacked once."""
    return [(e.src, e.dst, e.src_class, e.dst_class, e.cost, e.syncs) for e in tables.edges]


def _edge_pass(edges, ops: int, choice) -> tuple[float, tuple[list[bool], list[bool]]]:
    """The edges' seconds under ``choice`` (configuration indices of the tables) and, per op, whether
    a collective brings it an input and whether one takes a gradient back: one pass over the edges
    (``edges`` from :func:`_edge_rows`; ``EdgeTable.sync_code`` inlined, since the polish prices
    thousands of plans)."""
    fwd, bwd = [False] * ops, [False] * ops
    total = 0.0
    for src, dst, src_class, dst_class, cost, syncs in edges:
        a, b = src_class[choice[src]], dst_class[choice[dst]]
        seconds = float(cost[a, b])
        total += seconds
        code = (3 if seconds > 0 else 0) if syncs is None else syncs[a, b]
        if code & 1:
            fwd[dst] = True
        if code & 2:
            bwd[dst] = True
    return total, (fwd, bwd)


class StepObjective:
    """``step_seconds`` of any assignment of a graph's ops, the parts each (op, configuration) adds to
    the jitter walk computed once, so a local search (``search.polish``) can price thousands of
    plans. ``rows[i]``: which configurations of op ``i`` to prepare (all by default); assignments
    then index into ``rows``."""

    def __init__(self, model: AnalyticCostModel, tables, rows=None):
        graph = tables.graph
        self.tables = tables
        self.jitter = model.cluster.device.sync_jitter if tables.devices > 1 else 0.0
        self.horizon = model.cluster.device.sync_jitter_horizon
        self.exponent = model.cluster.device.sync_jitter_exponent
        rows = rows if rows is not None else [np.arange(len(c)) for c in tables.configs]
        self.rows = rows
        parts = {k: [] for k in ("fwd", "bwd", "fwd_sync", "bwd_sync", "stretch", "reduces", "after")}
        for i, op in enumerate(graph.ops):
            items = model.node_cost_items(graph, op, tables.configs[i][rows[i]])
            n = len(rows[i])

            def total(its, part="seconds"):
                return sum((np.broadcast_to(np.asarray(getattr(it, part), dtype=np.float64), (n,)) for it in its),
                           np.zeros(n))

            work = [it for it in items if it.stream == "compute" and it.name != "sync_wait"
                    and it.name not in PER_ITERATION]
            crit = [it for it in items if it.stream == "comm" and it.critical]
            parts["fwd"].append(total(work, "fwd"))
            parts["bwd"].append(total(work, "bwd"))
            parts["fwd_sync"].append(total(crit, "fwd") > 0)
            parts["bwd_sync"].append(total(crit, "bwd") > 0)
            parts["stretch"].append(total([it for it in items if it.name == "sync_wait"]))
            parts["reduces"].append(total([it for it in items if it.name == "weight_grad_allreduce"]) > 0)
            parts["after"].append(total([it for it in items if it.name in PER_ITERATION]))
        self.parts = parts

        # the parts flattened, op after op, so that one plan's are read by one fancy index
        self._offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])[:-1]]).astype(np.int64)
        self._flat = {k: np.concatenate([np.asarray(v, dtype=np.float64) for v in parts[k]]) for k in parts}
        self._totals = np.concatenate([np.asarray(n.total, dtype=np.float64)[r] for n, r in zip(tables.nodes, rows)])
        self._edges = _edge_rows(tables)

    def sync_waits(self, choice, moved) -> tuple[float, float]:
        """(jitter waits, per-op sync stretch) of ``choice`` (indices into ``rows``), as
        :func:`sync_waits` defines them; ``moved``: per op, whether a collective brings it an input
        and whether one takes the gradient back (``_moved``)."""
        return self._waits(self._offsets + np.asarray(choice, dtype=np.int64), moved)

    def _waits(self, idx: np.ndarray, moved) -> tuple[float, float]:
        f = self._flat
        stretch = float(f["stretch"][idx].sum())
        if not self.jitter:
            return 0.0, stretch
        waits = jitter_waits(
            self.jitter,
            fwd=f["fwd"][idx].tolist(),
            bwd=f["bwd"][idx].tolist(),
            fwd_sync=(f["fwd_sync"][idx] > 0).tolist(),
            bwd_sync=(f["bwd_sync"][idx] > 0).tolist(),
            moved=moved[0],
            moved_back=moved[1],
            reduces=bool(f["reduces"][idx].any()),
            after_backward=float(f["after"][idx].sum()),
            horizon=self.horizon, exponent=self.exponent)
        return sum(waits.values()), stretch

    def __call__(self, choice) -> float:
        """Predicted seconds of one step of ``choice`` (configuration indices of the tables; ``rows``
        must be all configurations): ``step_seconds``."""
        idx = self._offsets + np.asarray(choice, dtype=np.int64)
        edges, moved = _edge_pass(self._edges, len(self.rows), choice)
        cost = float(self._totals[idx].sum()) + edges
        if not self.jitter:
            return cost
        waits, stretch = self._waits(idx, moved)
        return cost - stretch + waits


def step_seconds(model, tables, choice) -> float:
    """Predicted seconds of one training step of an SPMD plan: the tables' cost (``cost_of``, the
    search's objective) with the per-op sync stretch replaced by the plan's jitter waits
    (:func:`sync_waits`) when the device has a ``sync_jitter``; ``cost_of`` for any other model."""
    cost = tables.cost_of(choice)
    if not isinstance(model, AnalyticCostModel) or not model.cluster.device.sync_jitter:
        return cost
    waits, stretch = sync_waits(model, tables, choice)
    return cost - stretch + waits
