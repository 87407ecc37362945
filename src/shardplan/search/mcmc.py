"""FlexFlow's randomized search: Metropolis-Hastings over whole plans (a rival to ``exact``).

Jia, Zaharia and Aiken, "Beyond Data and Model Parallelism for Deep Neural Networks", SysML 2019,
section 6 (execution optimizer). Starting from a plan (data parallel by default, as FlexFlow does),
each step proposes a neighbour that differs in **one** op's configuration, the op and its new
configuration drawn uniformly at random, and accepts it with probability

    min(1, exp(-beta * (cost(new) - cost(old))))

(the proposal is symmetric, so this is Metropolis-Hastings with target ``exp(-beta * cost)``). The
best plan ever visited is returned. FlexFlow prices each plan with its execution simulator; here
``objective`` is any callable ``choice -> float`` (a simulator plugged in later), and without one the
tables' objective is used with an O(degree) *delta* evaluation: only the changed op's node cost and
its incident edge tables (precomputed per op) are re-read, so a proposal costs a few microseconds.

Temperature. ``beta = 1 / temperature``. FlexFlow leaves beta as a tuning constant; the default here
is relative to the starting plan and the graph size: ``temperature = 0.03 * cost(init) / n`` with
``n`` the number of ops that can move, i.e. a step that worsens the plan by 3 % of an average op's
share of the starting cost is accepted with probability 1/e. One proposal changes one op, so the
cost changes it makes scale with cost / n, not with the whole cost; a fixed fraction of the whole
cost is too hot on 200-op graphs. Measured on the zoo (analytic model, DGX A100, 8 GPUs, 1e5
proposals, factors 0.003 / 0.01 / 0.03 / 0.1): 0.03 reached the optimum on alexnet, vgg16 and
gnmt, while 0.003 and 0.1 each missed it on one of them by 1-3 %; on the transformer and resnet101
every factor stayed 5-7 % above the optimum, since there most single-op moves are uphill (a
change of layout pays redistribution on both sides until its neighbours follow). Costs in seconds
or in FLOP-like units behave alike.

Memory cap: configurations whose own memory exceeds the cap are never proposed, and a proposal that
takes the plan's total memory over the cap is rejected. If the starting plan does not fit, the
search starts from the leanest plan (each op's least-memory configuration), which fits whenever any
plan does (``search.solve.check_fits`` raises otherwise).

Stopping: after ``max_iters`` proposals or ``time_limit_s`` seconds, whichever comes first, or on
Ctrl-C; the best plan so far comes back, never flagged optimal (no bound: ``lower_bound`` is -inf).
Given ``seed`` and ``max_iters`` (with ``time_limit_s=None``) the result is deterministic.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import numpy as np

from shardplan.cost.tables import CostTables
from shardplan.search.baselines import data_parallel, greedy
from shardplan.search.solve import Solution, check_fits, memory_of

DEFAULT_RELATIVE_TEMPERATURE = 0.03  # of the starting cost per movable op
_BLOCK = 4096  # random numbers drawn per refill
_CLOCK_EVERY = 1024  # proposals between clock reads


def _initial(tables: CostTables, init, node: list[np.ndarray]) -> tuple[list[int], str]:
    if isinstance(init, str):
        if init == "data_parallel":
            return data_parallel(tables), init
        if init == "greedy":
            return greedy(tables, node), init
        if init == "leanest":
            return [int(np.argmin(n.memory)) for n in tables.nodes], init
        raise ValueError(f"unknown init {init!r}; use 'data_parallel', 'greedy', 'leanest' or a choice sequence")
    choice = [int(c) for c in init]
    if len(choice) != len(tables.nodes):
        raise ValueError(f"init has {len(choice)} entries; {tables.graph.name} has {len(tables.nodes)} ops")
    for v, (c, k) in enumerate(zip(choice, tables.num_configs)):
        if not 0 <= c < k:
            raise ValueError(f"init: op {tables.graph.ops[v].name!r} has {k} configurations, got index {c}")
    return choice, "given plan"


def mcmc_search(tables: CostTables, objective: Callable[[Sequence[int]], float] | None = None,
                time_limit_s: float | None = 10.0, max_iters: int | None = None, seed: int = 0,
                memory_limit_bytes: float | None = None, init="data_parallel",
                temperature: float | None = None) -> Solution:
    """Metropolis-Hastings over plans (FlexFlow); see the module docstring.

    ``init`` is "data_parallel" (FlexFlow's start), "greedy", "leanest" or a choice sequence.
    ``temperature`` is in the objective's unit (default: 3 % of the starting cost per movable op).
    """
    if time_limit_s is None and max_iters is None:
        raise ValueError("mcmc_search needs time_limit_s or max_iters (or both)")
    start = time.perf_counter()
    deadline = None if time_limit_s is None else start + float(time_limit_s)
    limit = math.inf if memory_limit_bytes is None else float(memory_limit_bytes)
    node = check_fits(tables, limit) if memory_limit_bytes is not None else [n.total for n in tables.nodes]
    n_ops = len(node)
    mem = [np.asarray(n.memory, dtype=np.float64) for n in tables.nodes]
    # proposable configurations per op: finite cost and fitting on their own
    allowed = [np.nonzero(np.isfinite(c))[0] for c in node]
    movable = np.array([v for v in range(n_ops) if len(allowed[v]) > 1], dtype=np.int64)

    cur, init_name = _initial(tables, init, node)
    if memory_of(tables, cur) > limit or not all(math.isfinite(node[v][c]) for v, c in enumerate(cur)):
        cur, init_name = [int(np.argmin(m)) for m in mem], f"leanest (the {init_name} plan does not fit)"
    cur_mem = memory_of(tables, cur)

    # incident edges per op, as (edge cost table, my class map, other op, other class map, i am src)
    incident: list[list[tuple]] = [[] for _ in range(n_ops)]
    self_loops: list[list] = [[] for _ in range(n_ops)]
    for e in tables.edges:
        if e.src == e.dst:
            self_loops[e.src].append(e)
            continue
        incident[e.src].append((e.cost, e.src_class, e.dst, e.dst_class, True))
        incident[e.dst].append((e.cost, e.dst_class, e.src, e.src_class, False))

    def local(v: int, k: int, choice) -> float:
        """Node cost of v at k plus every edge term touching v (the rest of ``choice`` fixed)."""
        total = float(node[v][k])
        for cost, mine, u, theirs, is_src in incident[v]:
            total += float(cost[mine[k], theirs[choice[u]]] if is_src else cost[theirs[choice[u]], mine[k]])
        for e in self_loops[v]:
            total += float(e.cost[e.src_class[k], e.dst_class[k]])
        return total

    def full(choice) -> float:
        if objective is not None:
            return float(objective(list(choice)))
        return sum(float(node[v][c]) for v, c in enumerate(choice)) + tables.edge_cost_of(choice)

    cur_cost = full(cur)
    init_cost = cur_cost
    if temperature is None:
        share = abs(init_cost) / max(len(movable), 1)
        temperature = DEFAULT_RELATIVE_TEMPERATURE * share if math.isfinite(init_cost) else 1.0
        if temperature <= 0:
            temperature = 1.0
    beta = 1.0 / float(temperature)
    best, best_cost = list(cur), cur_cost

    rng = np.random.default_rng(seed)
    iters = accepted = 0
    why = "iteration limit"
    if len(movable) == 0:
        why = "no op has a second configuration"
        max_iters = 0
    try:
        while max_iters is None or iters < max_iters:
            block = _BLOCK if max_iters is None else min(_BLOCK, max_iters - iters)
            ops = movable[rng.integers(0, len(movable), block)]
            picks = rng.random(block)
            coins = rng.random(block)
            for i in range(block):
                if iters % _CLOCK_EVERY == 0 and deadline is not None and time.perf_counter() > deadline:
                    why = "time limit"
                    raise StopIteration
                iters += 1
                v = int(ops[i])
                choices = allowed[v]
                old = cur[v]
                # uniform over the op's other allowed configurations (a symmetric proposal)
                j = int(picks[i] * (len(choices) - 1))
                new = int(choices[j])
                if new == old:
                    new = int(choices[-1])
                new_mem = cur_mem - mem[v][old] + mem[v][new]
                if new_mem > limit:
                    continue
                if objective is None:
                    delta = local(v, new, cur) - local(v, old, cur)
                    if not math.isfinite(delta):
                        continue
                    if delta > 0 and coins[i] >= math.exp(-beta * delta):
                        continue
                    cur[v] = new
                    cur_cost += delta
                else:
                    cur[v] = new
                    cost = full(cur)
                    delta = cost - cur_cost
                    if not math.isfinite(cost) or (delta > 0 and coins[i] >= math.exp(-beta * delta)):
                        cur[v] = old
                        continue
                    cur_cost = cost
                cur_mem = new_mem
                accepted += 1
                if cur_cost < best_cost:
                    best, best_cost = list(cur), cur_cost
    except StopIteration:
        pass
    except KeyboardInterrupt:
        why = "Ctrl-C"
    elapsed = time.perf_counter() - start
    true_cost = full(best) if objective is not None else tables.cost_of(best)
    rate = iters / elapsed if elapsed > 0 else math.inf
    note = (f"{iters} proposals ({rate:,.0f}/s), {accepted} accepted; stopped by {why}; start {init_name} "
            f"at {init_cost:.6g}; temperature {temperature:.3g}"
            + ("" if objective is None else "; objective: user callable"))
    return Solution(tuple(best), true_cost, False, -math.inf, memory_of(tables, best), "mcmc", elapsed, 1, note)
