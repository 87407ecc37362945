"""The inter-op (pipeline stage) search as a pure function over arrays: exact under its model.

Layers ``0..L-1`` form a chain. A *stage* covers layers ``k..r`` under an *option* ``o`` (its sub-mesh,
recomputation, ZeRO level...). The caller fills, for every ``(o, k, r)``:

* ``time[o, k, r]``: seconds per microbatch (forward + backward, point-to-point included),
* ``sync[o, k, r]``: seconds of the stage's data-parallel gradient synchronisation per iteration,
* ``max_inflight[o, k, r]``: how many microbatches' activations fit in device memory next to the
  stage's model states (negative when the states alone do not fit),

and ``units[o]``, the device units an option takes (0 when the caller counts devices itself).
A stage with ``j`` stages after it must keep ``inflight[j]`` microbatches (1F1B: ``min(j + 1, m)``).

    minimise   alpha * max_i T_i + beta * sum_i T_i + max_i S_i
    subject to max_inflight_i >= inflight[stages after i],  sum_i units_i <= budget,
               min_stages <= #stages <= max_stages

(1F1B / GPipe: alpha = m - 1, beta = 1: ``(m - 1) max T + sum T``, Narayanan et al. 2021, plus the
slowest stage's gradient synchronisation after the flush.)

Method (Alpa's inter-op pass, Zheng et al. OSDI 2022, with TeraPipe's threshold enumeration): for a
cap ``tau`` on stage time and ``sigma`` on sync time, a DP over (stages left j, device units u,
first layer k) gives the least ``sum T``:

    f_j[u, k] = min_{o, r >= k}  time[o, k, r] + f_{j-1}[u - units[o], r + 1]
                over (o, k, r) with time <= tau, sync <= sigma, max_inflight >= inflight[j - 1]

``tau`` runs over the distinct stage times from the least feasible one (binary search) upward, stopping
once ``alpha * tau + beta * (least sum T)`` cannot beat the best; for each ``tau``, ``sigma`` runs down
from the sync of the solution found to just below it until nothing fits. Every optimum has
``max T = tau*`` and ``max S = sigma*``; the ``tau*`` pass reaches a ``sigma`` cap at or above
``sigma*`` whose solution has ``sum T`` no larger and ``max S`` no larger, so the answer is exact
(``tests/test_pipeline_search.py`` checks it against brute force). Cost per DP:
``O(max_stages * O * U * L^2)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageChoice:
    first: int  # first layer
    last: int  # last layer (inclusive)
    option: int


@dataclass(frozen=True)
class StageSolution:
    stages: tuple[StageChoice, ...]
    value: float  # alpha * max T + beta * sum T + max S
    max_time: float
    sum_time: float
    max_sync: float
    dp_runs: int


def objective(time, sync, stages, alpha: float, beta: float) -> tuple[float, float, float, float]:
    """(value, max T, sum T, max S) of a list of StageChoice."""
    ts = [float(time[s.option, s.first, s.last]) for s in stages]
    ss = [float(sync[s.option, s.first, s.last]) for s in stages]
    return alpha * max(ts) + beta * sum(ts) + max(ss), max(ts), sum(ts), max(ss)


def _dp(time, sync, max_inflight, inflight, units, budget, tau, sigma, max_stages, min_stages):
    """Least sum T under the caps: (sum T, stages) or None."""
    n_opt, L, _ = time.shape
    U = budget + 1
    base = (time <= tau) & (sync <= sigma)
    prev = np.full((U, L + 1), np.inf)
    prev[0, L] = 0.0  # no layers left, no stages, no units
    best, best_at = math.inf, None
    back = []
    for j in range(1, max_stages + 1):
        masked = np.where(base & (max_inflight >= inflight[j - 1]), time, np.inf)  # (O, L, L)
        cur = np.full((U, L + 1), np.inf)
        arg_o = np.zeros((U, L), dtype=np.int64)
        arg_r = np.zeros((U, L), dtype=np.int64)
        for o in range(n_opt):
            uo = int(units[o])
            if uo > budget:
                continue
            shifted = np.full((U, L), np.inf)
            shifted[uo:, :] = prev[:U - uo, 1:]  # f_{j-1}[u - uo, r + 1], indexed by r
            cand = masked[o][None, :, :] + shifted[:, None, :]  # (U, k, r)
            r_best = np.argmin(cand, axis=2)
            v = np.take_along_axis(cand, r_best[..., None], axis=2)[..., 0]
            better = v < cur[:, :L]
            cur[:, :L] = np.where(better, v, cur[:, :L])
            arg_o = np.where(better, o, arg_o)
            arg_r = np.where(better, r_best, arg_r)
        back.append((arg_o, arg_r))
        prev = cur
        if j >= min_stages:
            u = int(np.argmin(cur[:, 0]))
            if cur[u, 0] < best:
                best, best_at = float(cur[u, 0]), (j, u)
        if not np.isfinite(cur).any():
            break
    if best_at is None:
        return None
    j, u = best_at
    stages, k = [], 0
    while j > 0:
        arg_o, arg_r = back[j - 1]
        o, r = int(arg_o[u, k]), int(arg_r[u, k])
        stages.append(StageChoice(k, r, o))
        u -= int(units[o])
        k = r + 1
        j -= 1
    return best, stages


def stage_dp(time: np.ndarray, sync: np.ndarray, max_inflight: np.ndarray, inflight: np.ndarray,
             alpha: float, beta: float = 1.0, units: np.ndarray | None = None, budget: int = 0,
             max_stages: int | None = None, min_stages: int = 1) -> StageSolution | None:
    """Exact optimum of the stage problem (module docstring), or None when no partition fits."""
    time = np.asarray(time, dtype=np.float64)
    sync = np.asarray(sync, dtype=np.float64)
    max_inflight = np.asarray(max_inflight, dtype=np.float64)
    n_opt, L, L2 = time.shape
    if L2 != L or sync.shape != time.shape or max_inflight.shape != time.shape:
        raise ValueError(f"time, sync and max_inflight must all be (options, layers, layers); got "
                         f"{time.shape}, {sync.shape}, {max_inflight.shape}")
    units = np.zeros(n_opt, dtype=np.int64) if units is None else np.asarray(units, dtype=np.int64)
    max_stages = L if max_stages is None else min(max_stages, L)
    inflight = np.asarray(inflight, dtype=np.float64)
    if len(inflight) < max_stages:
        raise ValueError(f"inflight has {len(inflight)} entries; max_stages is {max_stages}")
    runs = 0

    def run(tau, sigma):
        nonlocal runs
        runs += 1
        return _dp(time, sync, max_inflight, inflight, units, budget, tau, sigma, max_stages, min_stages)

    free = run(math.inf, math.inf)
    if free is None:
        return None
    a_min = free[0]
    best_val, best_stages = objective(time, sync, free[1], alpha, beta)[0], free[1]
    taus = [math.inf] if alpha == 0 else np.unique(time[np.isfinite(time)]).tolist()
    lo, hi = 0, len(taus) - 1
    while lo < hi:  # least feasible tau (feasibility grows with tau)
        mid = (lo + hi) // 2
        if run(taus[mid], math.inf) is None:
            lo = mid + 1
        else:
            hi = mid
    sync_values = np.unique(sync[np.isfinite(sync)])
    for tau in taus[lo:]:
        if alpha * tau + beta * a_min >= best_val:
            break
        sigma = math.inf
        while True:
            sol = run(tau, sigma)
            if sol is None:
                break
            val = objective(time, sync, sol[1], alpha, beta)
            if val[0] < best_val:
                best_val, best_stages = val[0], sol[1]
            if alpha * tau + beta * sol[0] >= best_val:
                break
            below = sync_values[sync_values < val[3]]
            if len(below) == 0:
                break
            sigma = float(below[-1])
    val = objective(time, sync, best_stages, alpha, beta)
    return StageSolution(tuple(best_stages), val[0], val[1], val[2], val[3], runs)


def min_peak_memory(static: np.ndarray, act: np.ndarray, inflight: np.ndarray, max_stages: int) -> float:
    """Least possible largest stage memory (bytes) over partitions into at most ``max_stages`` stages.

    ``static[o, k, r]`` and ``act[o, k, r]`` are a stage's fixed bytes and bytes per in-flight
    microbatch; a stage with j stages after it keeps ``inflight[j]``. Minimax DP, O(max_stages O L^2).
    Used to name the memory a model would need when nothing fits.
    """
    n_opt, L, _ = static.shape
    prev = np.full(L + 1, np.inf)
    prev[L] = 0.0  # max over no stages: -inf would do, 0 is the same for bytes >= 0
    best = math.inf
    for j in range(1, min(max_stages, L) + 1):
        mem = (static + inflight[j - 1] * act).min(axis=0)  # (k, r)
        cand = np.maximum(mem, prev[None, 1:])
        cur = np.full(L + 1, np.inf)
        cur[:L] = cand.min(axis=1)
        best = min(best, float(cur[0]))
        prev = cur
    return best
