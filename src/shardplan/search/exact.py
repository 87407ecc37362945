"""Exact strategy search: variable elimination (PaSE's dynamic program) over layout classes.

Problem (``cost.tables``): choose one configuration ``c_v`` per op to minimise

    F(c) = sum_v n_v(c_v) + sum_(u,v) e_uv(pi_uv(c_u), rho_uv(c_v))

where ``pi``/``rho`` map a configuration to the layout of the tensor crossing the edge.

Recurrence. Eliminate the ops one at a time in an order ``v_1..v_n``. Eliminating ``v`` with the
set of factors ``F_v`` that mention it (edge tables and factors made by earlier eliminations) and
their other variables ``U_v`` (PaSE's *dependent set* D(i)) produces

    g_v(x_U) = min_{c_v} [ n_v(c_v) + sum_{f in F_v} f(x_U, c_v) ]

PaSE does this over full configurations, ``K^(|D|+1)`` work per op. Two observations make it much
cheaper and stay exact:

1. A factor sees a variable only through a *class* of its configurations (the layout of one
   tensor, or a join of such layouts). So ``g_v`` is computed over the joint classes of each
   ``u in U_v``, and ``v`` itself only ranges over its joint classes with ``n_v`` reduced to its
   minimum inside each class (a segment-min). A conv with 100 configurations whose output is
   split only by batch and channels has a handful of output layouts.
2. The elimination order is chosen greedily to minimise the size of the table it builds
   (min-weight; PaSE's GENERATESEQ is the same greedy with plain degrees).

Work per elimination is ``|J_v| * prod_{u in U_v} |J_u|`` (J = joint classes), done with numpy
broadcasting in chunks; memory is bounded by the chunk size. The argmin is recovered by
back-substitution in reverse order (each op's local problem given its already-fixed neighbours),
so no strategy columns travel through the tables.

Complexity: O(sum_v |J_v| prod |J_u|) time, O(sum of factor sizes) memory. Exact: the result equals
brute force on every graph (``tests/test_exact_search.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from shardplan.cost.tables import CostTables

CHUNK_ELEMENTS = 1 << 20  # 8 MB of float64 per broadcast block (measured best on the Transformer)


class SearchInterrupted(Exception):
    """The time limit passed (or the user pressed Ctrl-C) before the search finished."""


@dataclass
class _Factor:
    vars: tuple[int, ...]
    maps: tuple[np.ndarray, ...]  # per var: (K_var,) config -> class index into table axis
    table: np.ndarray


@dataclass(frozen=True)
class ExactResult:
    choice: tuple[int, ...]
    cost: float
    order: tuple[int, ...]
    max_table: int
    work: float
    seconds: float


def _joint(maps: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Joint partition of several class maps of one variable.

    Returns (inverse: config -> joint class, per input map: joint class -> that map's class).
    """
    if len(maps) == 1:
        m = maps[0]
        n = int(m.max()) + 1 if len(m) else 0
        return m, [np.arange(n)]
    stacked = np.stack(maps, axis=1)
    uniq, inverse = np.unique(stacked, axis=0, return_inverse=True)
    return inverse.reshape(-1), [uniq[:, j] for j in range(len(maps))]


def _take(t: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    """``t`` re-indexed along one axis; a contiguous run of indices is a cheap slice, not a gather."""
    if len(index) and index[-1] - index[0] == len(index) - 1 and np.all(np.diff(index) == 1):
        if len(index) == t.shape[axis]:
            return t
        sl = [slice(None)] * t.ndim
        sl[axis] = slice(int(index[0]), int(index[-1]) + 1)
        return t[tuple(sl)]
    return np.take(t, index, axis=axis)


def _segment_min(values: np.ndarray, classes: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, np.inf)
    np.minimum.at(out, classes, values)
    return out


class _Eliminator:
    def __init__(self, tables: CostTables, node_cost: list[np.ndarray], deadline: float | None):
        self.node = node_cost
        self.deadline = deadline
        n = len(node_cost)
        self.factors_of: list[set[int]] = [set() for _ in range(n)]
        self.factors: dict[int, _Factor] = {}
        self.next_id = 0
        for e in tables.edges:
            if e.src == e.dst:
                continue
            self._add(_Factor((e.src, e.dst), (e.src_class, e.dst_class), e.cost.astype(np.float64)))
        self.constant = 0.0
        self.max_table = 0
        self.work = 0.0
        self.history: list[tuple[int, list[_Factor]]] = []
        self.buffer = np.empty(0)  # reused accumulator of one chunk

    def _add(self, f: _Factor) -> None:
        fid = self.next_id
        self.next_id += 1
        self.factors[fid] = f
        for v in f.vars:
            self.factors_of[v].add(fid)

    def _classes_of(self, v: int, fids) -> int:
        maps = [self.factors[f].maps[self.factors[f].vars.index(v)] for f in fids]
        if not maps:
            return 1
        inv, _ = _joint(maps)
        return int(inv.max()) + 1

    def score(self, v: int) -> float:
        """Work of eliminating v now: joint classes of v times those of each neighbour."""
        fids = self.factors_of[v]
        work = float(self._classes_of(v, fids))
        neigh: dict[int, list[int]] = {}
        for f in fids:
            for u in self.factors[f].vars:
                if u != v:
                    neigh.setdefault(u, []).append(f)
        for u, fs in neigh.items():
            work *= self._classes_of(u, fs)
        return work

    def eliminate(self, v: int) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise SearchInterrupted
        fids = sorted(self.factors_of[v])
        facs = [self.factors.pop(f) for f in fids]
        for f, fac in zip(fids, facs):
            for u in fac.vars:
                self.factors_of[u].discard(f)
        self.history.append((v, facs))
        if not facs:
            self.constant += float(np.min(self.node[v]))
            return
        # joint classes of v and of every neighbour
        v_inv, v_back = _joint([fac.maps[fac.vars.index(v)] for fac in facs])
        nv_classes = len(v_back[0])
        nv = _segment_min(self.node[v], v_inv, nv_classes)
        others: list[int] = []
        for fac in facs:
            for u in fac.vars:
                if u != v and u not in others:
                    others.append(u)
        u_info = {}
        for u in others:
            holders = [i for i, fac in enumerate(facs) if u in fac.vars]
            inv, back = _joint([facs[i].maps[facs[i].vars.index(u)] for i in holders])
            u_info[u] = (inv, dict(zip(holders, back)))
        shape = tuple(len(next(iter(u_info[u][1].values()))) for u in others)
        size = int(np.prod(shape, dtype=np.float64)) if shape else 1
        self.max_table = max(self.max_table, size * nv_classes)
        self.work += float(size) * nv_classes
        # Re-index every factor onto (v, others...) joint classes and sum in chunks of v's classes.
        # v goes first so that the min over it is an elementwise minimum of contiguous slices.
        step = max(1, CHUNK_ELEMENTS // max(size, 1))
        result = None
        k = len(others)
        for lo in range(0, nv_classes, step):
            hi = min(nv_classes, lo + step)
            acc = None
            for i, fac in enumerate(facs):
                t = fac.table
                for axis, u in enumerate(fac.vars):
                    t = _take(t, v_back[i][lo:hi] if u == v else u_info[u][1][i], axis)
                # axis order (v, others...) with broadcast axes for the others this factor lacks
                pos = [0 if u == v else 1 + others.index(u) for u in fac.vars]
                t = t.transpose(np.argsort(pos))
                full = [1] * (k + 1)
                for axis, p in enumerate(sorted(pos)):
                    full[p] = t.shape[axis]
                t = t.reshape(full)
                if acc is None:
                    n_acc = (hi - lo) * size
                    if len(self.buffer) < n_acc:
                        self.buffer = np.empty(n_acc)
                    acc = self.buffer[:n_acc].reshape((hi - lo,) + shape)
                    np.add(t, nv[lo:hi].reshape((-1,) + (1,) * k), out=acc)
                else:
                    acc += t
            if result is None:
                result = acc.min(axis=0)
            elif hi - lo == 1:
                np.minimum(result, acc[0], out=result)
            else:
                np.minimum(result, np.minimum.reduce(acc, axis=0), out=result)
        if not others:
            self.constant += float(result)
            return
        self._add(_Factor(tuple(others), tuple(u_info[u][0] for u in others), result))

    def back_substitute(self) -> list[int]:
        """Fix each op, last eliminated first, to its best configuration given fixed neighbours."""
        choice = [-1] * len(self.node)
        for v, facs in reversed(self.history):
            total = self.node[v].astype(np.float64).copy()
            for fac in facs:
                idx = tuple(fac.maps[j] if u == v else int(fac.maps[j][choice[u]])
                            for j, u in enumerate(fac.vars))
                total += fac.table[idx]
            choice[v] = int(np.argmin(total))
        return choice


def exact_search(tables: CostTables, node_cost: list[np.ndarray] | None = None,
                 time_limit_s: float | None = None) -> ExactResult:
    """Minimise the tables' objective exactly; raise :class:`SearchInterrupted` past the limit.

    ``node_cost`` overrides the node costs (the memory-constrained search adds a penalty).
    """
    start = time.perf_counter()
    node = [np.asarray(n, dtype=np.float64) for n in (node_cost or [n.total for n in tables.nodes])]
    deadline = None if time_limit_s is None else start + time_limit_s
    elim = _Eliminator(tables, node, deadline)
    remaining = set(range(len(node)))
    scores = {v: elim.score(v) for v in remaining}
    order = []
    while remaining:
        v = min(remaining, key=lambda x: (scores[x], x))
        touched = {u for f in elim.factors_of[v] for u in elim.factors[f].vars}
        elim.eliminate(v)
        remaining.discard(v)
        order.append(v)
        for u in touched:
            if u in remaining:
                scores[u] = elim.score(u)
    choice = elim.back_substitute()
    cost = sum(float(node[v][c]) for v, c in enumerate(choice)) + tables.edge_cost_of(choice)
    return ExactResult(tuple(choice), cost, tuple(order), elim.max_table, elim.work, time.perf_counter() - start)
