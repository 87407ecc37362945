"""The front door of the search: exact optimum under a memory cap and a time limit.

    minimise   sum_v time_v(c_v) + sum_(u,v) edge_uv(c_u, c_v)
    subject to sum_v mem_v(c_v) <= M           (bytes per device; memory has no edge terms)

1. Per-op exclusion: a configuration whose own memory exceeds M can never be used.
2. If the leanest plan (each op's least memory, exact since memory is a sum over ops) exceeds M,
   nothing fits: :class:`PlanDoesNotFit` says by how much.
3. Otherwise the exact search runs on time + lambda * memory (Lagrangian relaxation). lambda = 0
   that fits is the proven optimum. Else lambda is raised until the plan fits and bisected; each
   search gives a lower bound ``L(lambda) - lambda * M`` on the capped optimum, so the answer reports
   its worst-case gap to the true optimum and is flagged optimal only when the gap closes.
4. A time limit or Ctrl-C stops the search; the best plan found so far comes back (the best feasible
   Lagrangian plan, else the cheapest fitting baseline or greedy plan), flagged not optimal.
5. Given the cost ``model`` and a cluster with a ``sync_jitter``, the plan is then refined on the
   predicted step (``cost.step.step_seconds``, whose jitter waits are a whole-plan term the sum
   above prices per op): ``search.polish`` descends from the exact plan and from the best baseline
   and keeps the better, so the answer is never predicted slower than data parallelism. A plan the
   refinement changed is flagged not optimal (it is no longer the sum's proven optimum) and its note
   gives both predictions.
6. ``solve_meshes`` (``--mesh auto``) runs all of this once per device mesh (every mesh of at most
   four axes, ``cluster.mesh.candidate_meshes``, or the ones given), each with only the
   configurations that lay on it and moves priced on its blocks, and keeps the mesh whose plan is
   predicted fastest. Ctrl-C between meshes keeps the best mesh so far.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from shardplan.cost.tables import CostTables
from shardplan.search.baselines import all_baselines, greedy
from shardplan.search.exact import SearchInterrupted, exact_search

GIB = 2.0**30


class PlanDoesNotFit(ValueError):
    """No plan fits the device memory; the message says by how much."""


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    cost: float
    optimal: bool
    lower_bound: float
    memory_bytes: float
    method: str
    seconds: float
    searches: int
    note: str = ""
    step_seconds: float | None = None
    """The predicted step (``cost.step.step_seconds``) when ``solve`` was given a jittery model."""


def memory_of(tables: CostTables, choice) -> float:
    return float(sum(n.memory[c] for n, c in zip(tables.nodes, choice)))


def check_fits(tables: CostTables, limit: float) -> list[np.ndarray]:
    """Node costs with configurations over the limit excluded (inf); raise if nothing fits."""
    masked = []
    for op, n in zip(tables.graph.ops, tables.nodes):
        lean = float(n.memory.min())
        if lean > limit:
            raise PlanDoesNotFit(
                f"op {op.name!r} needs {lean / GIB:.3f} GiB per device even in its leanest configuration; "
                f"the device has {limit / GIB:.3f} GiB (short by {(lean - limit) / GIB:.3f} GiB). "
                "Use more devices or devices with more memory.")
        masked.append(np.where(n.memory <= limit, n.total, np.inf))
    leanest = sum(float(n.memory.min()) for n in tables.nodes)
    if leanest > limit:
        raise PlanDoesNotFit(
            f"the leanest plan of {tables.graph.name} on {tables.devices} devices needs {leanest / GIB:.3f} GiB "
            f"per device; the device has {limit / GIB:.3f} GiB (short by {(leanest - limit) / GIB:.3f} GiB). "
            "Use more devices or devices with more memory.")
    return masked


def solve(tables: CostTables, memory_limit_bytes: float | None = None, time_limit_s: float | None = None,
          bisection_steps: int = 12, model=None, polish_seconds: float = 10.0) -> Solution:
    """Cheapest plan that fits; see the module docstring for the method and its guarantees.
    ``model``: the tables' cost model, for step 5 (at most ``polish_seconds`` of it)."""
    start = time.perf_counter()
    deadline = None if time_limit_s is None else start + time_limit_s
    limit = math.inf if memory_limit_bytes is None else float(memory_limit_bytes)
    base = check_fits(tables, limit) if memory_limit_bytes is not None else [n.total for n in tables.nodes]
    mem = [n.memory for n in tables.nodes]
    best: tuple[float, tuple[int, ...]] | None = None
    lower = -math.inf
    searches = 0

    def run(lam: float):
        nonlocal best, lower, searches
        remaining = None if deadline is None else max(deadline - time.perf_counter(), 0.0)
        costs = base if lam == 0 else [b + lam * m for b, m in zip(base, mem)]
        res = exact_search(tables, node_cost=costs, time_limit_s=remaining)
        searches += 1
        used = memory_of(tables, res.choice)
        lower = max(lower, res.cost - lam * limit) if math.isfinite(limit) else res.cost
        if used <= limit:
            true_cost = tables.cost_of(res.choice)
            if best is None or true_cost < best[0]:
                best = (true_cost, res.choice)
        return used

    try:
        used = run(0.0)
        if used > limit:
            scale = float(sum(n.total.min() for n in tables.nodes))
            lo, hi = 0.0, max(scale, 1e-12) / limit  # seconds (or cost units) per byte
            for _ in range(64):  # raise lambda until the plan fits (the leanest plan does)
                if run(hi) <= limit:
                    break
                lo, hi = hi, hi * 4.0
            for _ in range(bisection_steps):
                if best is not None and best[0] - lower <= 1e-9 * abs(best[0]):
                    break
                mid = 0.5 * (lo + hi)
                if run(mid) > limit:
                    lo = mid
                else:
                    hi = mid
    except (SearchInterrupted, KeyboardInterrupt) as exc:
        why = "time limit" if isinstance(exc, SearchInterrupted) else "interrupted"
        return _fallback(tables, base, limit, best, lower, start, searches, why)

    cost, choice = best
    gap_closed = cost - lower <= 1e-9 * abs(cost)
    method, note = "exact", ""
    if not gap_closed:
        # The relaxation is not tight here: a fitting baseline or greedy plan may still do better.
        others = list(all_baselines(tables).items()) + [("greedy", greedy(tables, base))]
        for name, c in others:
            c_cost = tables.cost_of(c)
            if memory_of(tables, c) <= limit and c_cost < cost:
                cost, choice, method = c_cost, tuple(c), name
        note = (f"memory cap: within {100 * (cost - lower) / cost:.2f}% of the optimum (Lagrangian bound)"
                + ("" if method == "exact" else f"; the best plan found is the {method} plan"))
    solution = Solution(tuple(choice), cost, gap_closed, lower if math.isfinite(lower) else cost,
                        memory_of(tables, choice), method, time.perf_counter() - start, searches, note)
    return _refine(solution, tables, model, limit, deadline, polish_seconds, start)


def _refine(sol: Solution, tables: CostTables, model, limit: float, deadline, budget: float, start) -> Solution:
    """Step 5 of the module docstring: polish on the predicted step when the model has jitter waits."""
    from dataclasses import replace

    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.step import StepObjective
    from shardplan.search.polish import polish

    if (not isinstance(model, AnalyticCostModel) or not model.cluster.device.sync_jitter
            or tables.devices <= 1):
        return sol
    stop = time.perf_counter() + budget
    stop = stop if deadline is None else min(stop, deadline)
    objective = StepObjective(model, tables)
    exact_step = objective(list(sol.choice))
    fitting = [(objective(list(c)), name, tuple(c)) for name, c in all_baselines(tables).items()
               if memory_of(tables, c) <= limit]
    starts = [(exact_step, sol.method, sol.choice)] + ([min(fitting)] if fitting else [])
    best = None
    for _, name, c in starts:
        choice, value, _moves = polish(objective, tables, c, limit, stop)
        if best is None or value < best[0]:
            best = (value, name, choice)
    value, name, choice = best
    if choice == sol.choice:
        return replace(sol, step_seconds=value, seconds=time.perf_counter() - start)
    how = f"the {name} plan" + (" refined" if choice != next(c for _, n, c in starts if n == name) else "")
    note = (f"refined on the predicted step with sync_jitter waits: {how}, {value:.6g} s, against "
            f"{exact_step:.6g} s for the exact optimum of the per-op sum")
    return replace(sol, choice=choice, cost=tables.cost_of(choice), optimal=False, memory_bytes=memory_of(tables, choice),
                   method=sol.method + " + polish", seconds=time.perf_counter() - start,
                   note="; ".join(x for x in (sol.note, note) if x), step_seconds=value)


def _fallback(tables, base, limit, best, lower, start, searches, why: str) -> Solution:
    """Best plan known when the search is stopped: a feasible search result, baseline or greedy plan."""
    candidates = [] if best is None else [("exact (stopped)", best[1])]
    candidates += list(all_baselines(tables).items())
    candidates.append(("greedy", tuple(greedy(tables, base))))
    fits = [(tables.cost_of(c), name, tuple(c)) for name, c in candidates if memory_of(tables, c) <= limit]
    if not fits:  # even the baselines overflow: the leanest greedy plan
        lean = greedy(tables, [b + 1e6 * m for b, m in zip(base, (n.memory for n in tables.nodes))])
        fits = [(tables.cost_of(lean), "greedy (leanest)", tuple(lean))]
    cost, name, choice = min(fits)
    bound = lower if math.isfinite(lower) else -math.inf
    return Solution(choice, cost, False, bound, memory_of(tables, choice), name, time.perf_counter() - start,
                    searches, f"search stopped ({why}); best plan so far from {name}, not proven optimal")


@dataclass(frozen=True)
class MeshTry:
    """One mesh ``solve_meshes`` searched: its plan's predicted step (``Solution.step_seconds`` when
    the model predicts one, else its cost; inf when nothing fits there) and memory per device."""

    mesh: tuple[int, ...]
    cost: float
    memory_bytes: float
    note: str = ""


def solve_meshes(graph, model, devices: int, meshes=None, memory_limit_bytes: float | None = None,
                 time_limit_s: float | None = None, progress=None) -> tuple[CostTables, Solution, list[MeshTry]]:
    """(tables, solution, every mesh tried) of the mesh whose plan is predicted fastest (module doc,
    step 6). ``model`` is an ``AnalyticCostModel``; ``meshes`` defaults to every mesh of at most four
    axes; ``time_limit_s`` bounds the whole; ``progress(i, n, mesh)`` is called before each mesh."""
    import dataclasses

    from shardplan.cluster.mesh import candidate_meshes
    from shardplan.cost.tables import build_tables

    meshes = [tuple(m) for m in (meshes or candidate_meshes(devices))]
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    tries: list[MeshTry] = []
    best: tuple[float, CostTables, Solution] | None = None
    for i, mesh in enumerate(meshes):
        if deadline is not None and time.perf_counter() >= deadline and best is not None:
            break
        on = dataclasses.replace(model, mesh=mesh)
        try:
            if progress is not None:
                progress(i, len(meshes), mesh)
            tables = build_tables(graph, on, devices)
            left = None if deadline is None else max(deadline - time.perf_counter(), 0.0)
            sol = solve(tables, memory_limit_bytes, time_limit_s=left, model=on,
                        polish_seconds=max(1.0, 10.0 / len(meshes)))
        except PlanDoesNotFit as exc:
            tries.append(MeshTry(mesh, math.inf, math.nan, str(exc)))
            continue
        except KeyboardInterrupt:
            if best is None:
                raise
            break
        value = sol.step_seconds if sol.step_seconds is not None else sol.cost
        tries.append(MeshTry(mesh, value, sol.memory_bytes, sol.note))
        if best is None or value < best[0]:
            best = (value, tables, sol)
    if best is None:
        raise PlanDoesNotFit(f"no plan fits on any of {len(tries)} meshes of {devices} devices; on "
                             f"{'x'.join(map(str, tries[0].mesh))}: {tries[0].note}")
    return best[1], best[2], tries
