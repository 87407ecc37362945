"""Local refinement of a plan on an objective that does not add up over ops.

The exact search minimises a sum of per-op and per-edge costs, which is what makes it exact. The
predicted step of a plan on a cluster with a ``sync_jitter`` (``cost.step.step_seconds``) has one
term that is not such a sum: a rank waits at a sync point for about ``sync_jitter x sqrt(T)``, ``T``
the compute since the *previous* sync point, so what a redistribution costs depends on where the
plan's other sync points fall. The search prices that wait per op instead (``sync_stretch``); where
the two disagree, the exact plan may be predicted slower than another plan, data parallelism
included (a Llama whose embedding and first projection the search replicated: 1-3% slower than
data parallel by ``step_seconds``).

``polish`` is a first-improvement local search (coordinate descent): op by op, every other
configuration that keeps the plan within the memory limit is priced by the whole-plan objective and
taken when it lowers it; passes repeat until none improves or the time runs out. It starts from the
exact plan and from each baseline (data parallel and the rest) and keeps the best, so the result is
never predicted slower than any of them. It is a local search: exact only for the additive objective
the exact search solved, a refinement here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from shardplan.cost.tables import CostTables


def polish(objective: Callable[[list[int]], float], tables: CostTables, start: Sequence[int],
           memory_limit_bytes: float = math.inf, deadline: float | None = None) -> tuple[tuple[int, ...], float, int]:
    """(choice, objective value, moves taken) of coordinate descent from ``start``; ``deadline`` is a
    ``time.perf_counter()`` instant after which (or a Ctrl-C upon which) the best plan so far comes
    back."""
    best = list(start)
    value = objective(best)
    kept = tuple(best)
    memory = sum(float(n.memory[c]) for n, c in zip(tables.nodes, best))
    moves, improved = 0, True
    try:
        while improved:
            improved = False
            for i, node in enumerate(tables.nodes):
                if deadline is not None and time.perf_counter() > deadline:
                    return kept, value, moves
                current = best[i]
                for c in range(len(tables.configs[i])):
                    if c == current:
                        continue
                    mem = memory - float(node.memory[current]) + float(node.memory[c])
                    if mem > memory_limit_bytes:
                        continue
                    best[i] = c
                    v = objective(best)
                    if v < value * (1.0 - 1e-12):
                        value, current, memory, improved = v, c, mem, True
                        kept = tuple(best)
                        moves += 1
                    best[i] = current
    except KeyboardInterrupt:
        pass
    return kept, value, moves
