"""The strategy search as an integer linear program, solved with HiGHS (a rival to ``exact``).

Variables (``cost.tables`` notation: op ``v`` has configurations ``k``, edge ``e = (s, d)`` sees them
through the layout classes ``src_class`` / ``dst_class``):

* ``x[v,k] in {0, 1}``: op ``v`` runs configuration ``k``;  ``sum_k x[v,k] = 1``.
* ``y[e,a,b] >= 0`` (continuous): edge ``e`` joins producer layout class ``a`` and consumer class
  ``b``, with the *marginal* (local-polytope) constraints

      sum_b y[e,a,b] = sum_{k: src_class[k] = a} x[s,k]      for every class a of s
      sum_a y[e,a,b] = sum_{k: dst_class[k] = b} x[d,k]      for every class b of d

Objective ``sum_v,k n_v[k] x[v,k] + sum_e,a,b cost_e[a,b] y[e,a,b]``; optional memory row
``sum_v,k mem_v[k] x[v,k] <= M`` (memory has no edge terms, ``search.solve``).

Why the marginals are exact for binary x: with ``x[s,k*] = 1`` and ``x[d,l*] = 1``, the class
indicators are one-hot at ``a* = src_class[k*]`` and ``b* = dst_class[l*]``; the y's are a
non-negative table whose row sums are zero outside row a* and whose column sums are zero outside
column b*, so the only non-zero entry is ``y[e,a*,b*] = 1`` and the edge term is exactly
``cost_e[a*, b*]``. The y's therefore need no integrality (only the x's branch), and working over
layout classes keeps the model at ``sum_e L_s * L_d`` edge variables instead of ``K_s * K_d``
(the standard linearisation of a pairwise objective, the local polytope of MAP inference). An infinite entry gets no y (the pair is forbidden); an infinite node cost or a
configuration whose own memory exceeds M gets no x (pre-dropped, as in ``search.solve``).

The objective is scaled by a typical plan cost (cheapest node costs plus mean edge costs) so
HiGHS's absolute tolerances mean the same thing for costs in seconds (~1e-3) as for PaSE's
FLOP-like units; the relative and absolute MIP gap targets are 0, so ``optimal`` means HiGHS proved
the incumbent optimal to its tolerances. The reported ``cost`` is always recomputed from the tables
(``CostTables.cost_of``) and ``lower_bound`` is HiGHS's dual bound (unscaled, clipped to the cost).

Unlike ``solve``'s Lagrangian bisection, the memory row is exact: the ILP proves the capped optimum
where the relaxation leaves a gap (vgg16, DGX A100, 8 GPUs, a cap 30 % of the way from the leanest
plan to the free optimum's memory: ILP 4.609 ms proven optimal, ``solve`` 5.220 ms not proven).
Sources: the marginal (local-polytope) linearisation, Wainwright and Jordan, "Graphical Models,
Exponential Families, and Variational Inference" (2008), section 8.4; HiGHS, Huangfu and Hall,
"Parallelizing the dual revised simplex method" (2018), with its branch-and-cut MIP solver.

The model is assembled as numpy arrays (rowwise CSR) and handed over with one ``passModel`` call.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from shardplan.cost.tables import CostTables
from shardplan.search.baselines import all_baselines, greedy
from shardplan.search.solve import PlanDoesNotFit, Solution, check_fits, memory_of

_ROWWISE = 2  # HiGHS MatrixFormat::kRowwise
_MINIMIZE = 1  # HiGHS ObjSense::kMinimize
_INTEGER = 1  # HiGHS HighsVarType::kInteger


@dataclass(frozen=True)
class ILPModel:
    """The assembled program as arrays (rowwise CSR), kept so tests and benchmarks can inspect it."""

    num_col: int
    cost: np.ndarray  # scaled objective coefficients
    lower: np.ndarray
    upper: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    start: np.ndarray  # int32 row starts
    index: np.ndarray  # int32 column indices
    value: np.ndarray
    integrality: np.ndarray  # int32: 1 for the x columns
    x_cols: tuple  # per op: (kept configuration indices, their column numbers)
    scale: float  # objective = scale * (HiGHS objective)

    @property
    def num_row(self) -> int:
        return len(self.row_lower)

    @property
    def num_nz(self) -> int:
        return len(self.index)


def build_ilp(tables: CostTables, memory_limit_bytes: float | None = None,
              node_cost: list[np.ndarray] | None = None) -> ILPModel:
    """Assemble the program of the module docstring as CSR arrays (no per-nonzero Python calls)."""
    limit = math.inf if memory_limit_bytes is None else float(memory_limit_bytes)
    if node_cost is None:
        node_cost = check_fits(tables, limit) if memory_limit_bytes is not None else [n.total for n in tables.nodes]
    node = [np.asarray(c, dtype=np.float64).copy() for c in node_cost]
    n_ops = len(node)
    # Self-loop edges (src == dst) depend on one op only: fold them into its node cost.
    edges = []
    for e in tables.edges:
        if e.src == e.dst:
            node[e.src] += e.cost[e.src_class, e.dst_class]
        else:
            edges.append(e)
    # x columns: finite-cost configurations only
    x_cols, col_cost, next_col = [], [], 0
    for v in range(n_ops):
        kept = np.nonzero(np.isfinite(node[v]))[0]
        if len(kept) == 0:
            op = tables.graph.ops[v].name if v < len(tables.graph.ops) else str(v)
            raise PlanDoesNotFit(f"op {op!r} has no configuration of finite cost"
                                 + ("" if memory_limit_bytes is None else " within the memory cap"))
        x_cols.append((kept, next_col + np.arange(len(kept))))
        col_cost.append(node[v][kept])
        next_col += len(kept)
    n_x = next_col
    # reference scale, about one plan's cost: cheapest node costs plus the mean finite edge entries
    ref = float(sum(c.min() for c in col_cost))
    ref += float(sum(e.cost[np.isfinite(e.cost)].mean() for e in edges if np.isfinite(e.cost).any()))
    if not (math.isfinite(ref) and ref > 0):
        finite = np.concatenate(col_cost + [e.cost[np.isfinite(e.cost)] for e in edges] + [np.zeros(1)])
        ref = float(np.abs(finite).max())
    scale = ref if ref > 0 else 1.0

    rows_r, rows_c, rows_v = [], [], []  # COO triplets, concatenated at the end
    row_lo, row_hi = [], []
    n_row = 0
    # one configuration per op
    for v in range(n_ops):
        rows_r.append(np.full(len(x_cols[v][1]), n_row))
        rows_c.append(x_cols[v][1])
        rows_v.append(np.ones(len(x_cols[v][1])))
        n_row += 1
    row_lo.append(np.ones(n_ops))
    row_hi.append(np.ones(n_ops))
    # edge variables and marginal rows
    y_cost = []
    for e in edges:
        ls, ld = e.cost.shape
        a, b = np.nonzero(np.isfinite(e.cost))
        cols = next_col + np.arange(len(a))
        next_col += len(a)
        y_cost.append(e.cost[a, b])
        src_rows, dst_rows = n_row, n_row + ls
        n_row += ls + ld
        # + y in its row-class and column-class rows
        rows_r += [src_rows + a, dst_rows + b]
        rows_c += [cols, cols]
        rows_v += [np.ones(len(a)), np.ones(len(a))]
        # - x of the configurations in each class
        for cls, rows, (kept, xc) in ((e.src_class, src_rows, x_cols[e.src]), (e.dst_class, dst_rows, x_cols[e.dst])):
            rows_r.append(rows + cls[kept])
            rows_c.append(xc)
            rows_v.append(-np.ones(len(kept)))
        row_lo.append(np.zeros(ls + ld))
        row_hi.append(np.zeros(ls + ld))
    if math.isfinite(limit):
        rows_r.append(np.full(n_x, n_row))
        rows_c.append(np.concatenate([xc for _, xc in x_cols]))
        rows_v.append(np.concatenate([tables.nodes[v].memory[kept] for v, (kept, _) in enumerate(x_cols)]))
        row_lo.append(np.array([-np.inf]))
        row_hi.append(np.array([limit]))
        n_row += 1
    r = np.concatenate(rows_r).astype(np.int64)
    c = np.concatenate(rows_c).astype(np.int32)
    val = np.concatenate(rows_v).astype(np.float64)
    order = np.argsort(r, kind="stable")
    start = np.zeros(n_row + 1, dtype=np.int32)
    np.cumsum(np.bincount(r, minlength=n_row), out=start[1:])
    cost = np.concatenate(col_cost + y_cost) / scale
    num_col = next_col
    integrality = np.zeros(num_col, dtype=np.int32)
    integrality[:n_x] = _INTEGER
    upper = np.full(num_col, np.inf)
    upper[:n_x] = 1.0
    return ILPModel(num_col, cost, np.zeros(num_col), upper, np.concatenate(row_lo), np.concatenate(row_hi),
                    start[:-1].copy(), c[order], val[order], integrality, tuple(x_cols), scale)


def _quiet_highs(highspy):
    """A Highs instance; its C++ banner (printed once per process, before any option can be set) goes to
    /dev/null, so ``--json -`` output stays one JSON object."""
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def ilp_search(tables: CostTables, memory_limit_bytes: float | None = None,
               time_limit_s: float | None = None) -> Solution:
    """Cheapest plan (under an optional memory cap) by HiGHS's branch and cut; see the module docstring.

    Past ``time_limit_s`` or on Ctrl-C the best incumbent comes back flagged not optimal (or, with
    none, the cheapest fitting baseline / greedy plan). HiGHS checks its clock between simplex
    iterations, so a tiny limit on a large model can overrun by a fraction of a second (about 0.8 s
    on the 204-op transformer; Ctrl-C waits for the same check). ``note`` holds the MIP gap, the
    model size and the measured build / load / solve times.
    """
    import highspy

    start = time.perf_counter()
    limit = math.inf if memory_limit_bytes is None else float(memory_limit_bytes)
    model = build_ilp(tables, memory_limit_bytes)
    built = time.perf_counter()
    h = _quiet_highs(highspy)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 0.0)
    if time_limit_s is not None:
        h.setOptionValue("time_limit", max(float(time_limit_s) - (built - start), 1e-3))
    status = h.passModel(model.num_col, model.num_row, model.num_nz, _ROWWISE, _MINIMIZE, 0.0,
                         model.cost, model.lower, model.upper, model.row_lower, model.row_upper,
                         model.start, model.index, model.value, model.integrality)
    if status == highspy.HighsStatus.kError:
        raise RuntimeError(f"HiGHS rejected the ILP for {tables.graph.name} ({model.num_col} columns, "
                           f"{model.num_row} rows)")
    passed = time.perf_counter()
    h.HandleKeyboardInterrupt = True  # Ctrl-C cancels the solve; the incumbent comes back, not optimal
    h.solve()
    solved = time.perf_counter()
    ms = h.getModelStatus()
    info = h.getInfo()
    times = f"build {built - start:.3f} s, load {passed - built:.3f} s, solve {solved - passed:.3f} s"
    size = f"{model.num_col} columns ({sum(len(k) for k, _ in model.x_cols)} binary), {model.num_row} rows"
    if ms == highspy.HighsModelStatus.kInfeasible:
        if math.isfinite(limit):
            raise PlanDoesNotFit(f"no plan of {tables.graph.name} on {tables.devices} devices fits "
                                 f"{limit / 2**30:.3f} GiB per device (HiGHS: infeasible)")
        raise PlanDoesNotFit(f"every plan of {tables.graph.name} on {tables.devices} devices has an infinite "
                             "cost (HiGHS: infeasible): some edge forbids every configuration pair")
    bound = float(info.mip_dual_bound) * model.scale if math.isfinite(float(info.mip_dual_bound)) else -math.inf
    choice = None
    if info.primal_solution_status == 2:  # kSolutionStatusFeasible
        x = np.asarray(h.getSolution().col_value)
        choice = tuple(int(kept[np.argmax(x[cols])]) for kept, cols in model.x_cols)
    optimal = ms == highspy.HighsModelStatus.kOptimal and choice is not None
    method = "ilp"
    if choice is None:  # stopped before any incumbent: the best fitting baseline or greedy plan
        cands = list(all_baselines(tables).items()) + [("greedy", greedy(tables))]
        fits = [(tables.cost_of(ch), name, tuple(ch)) for name, ch in cands if memory_of(tables, ch) <= limit]
        if not fits:
            raise PlanDoesNotFit(f"HiGHS found no plan within the time limit and no baseline fits "
                                 f"{limit / 2**30:.3f} GiB per device")
        _, method, choice = min(fits)
        method = f"ilp (stopped; {method})"
    cost = tables.cost_of(choice)
    bound = min(bound, cost)
    gap = (cost - bound) / abs(cost) if cost != 0 and math.isfinite(bound) else (0.0 if bound == cost else math.inf)
    why = "optimal" if optimal else f"stopped ({ms.name if hasattr(ms, 'name') else ms})"
    note = f"HiGHS {why}; MIP gap {100 * gap:.4g}%; {size}; {times}"
    return Solution(tuple(choice), cost, optimal, bound, memory_of(tables, choice), method,
                    time.perf_counter() - start, 1, note)
