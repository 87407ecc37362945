"""The stage DP equals brute force on small random layer chains (random per-layer costs as arrays)."""

import itertools
import math

import numpy as np
import pytest

from shardplan.search.stage_dp import min_peak_memory, objective, stage_dp, StageChoice


def random_problem(rng, L, n_opt):
    """Per-layer costs and memories as arrays, summed into (option, first, last) stage arrays."""
    layer_t = rng.uniform(0.5, 2.0, size=(n_opt, L))
    layer_act = rng.uniform(0.5, 2.0, size=(n_opt, L))
    layer_static = rng.uniform(0.5, 3.0, size=(n_opt, L))
    layer_sync = rng.uniform(0.0, 1.0, size=(n_opt, L))
    extra = rng.uniform(0.0, 0.5, size=n_opt)  # point-to-point per stage
    limit = rng.uniform(6.0, 14.0)
    time = np.full((n_opt, L, L), np.inf)
    sync = np.full((n_opt, L, L), np.inf)
    maxin = np.full((n_opt, L, L), -np.inf)
    static = np.full((n_opt, L, L), np.inf)
    act = np.full((n_opt, L, L), np.inf)
    for o in range(n_opt):
        for k in range(L):
            for r in range(k, L):
                time[o, k, r] = layer_t[o, k:r + 1].sum() + extra[o]
                sync[o, k, r] = layer_sync[o, k:r + 1].sum()
                static[o, k, r] = layer_static[o, k:r + 1].sum()
                act[o, k, r] = layer_act[o, k:r + 1].sum()
                maxin[o, k, r] = (limit - static[o, k, r]) / act[o, k, r]
    return time, sync, maxin, static, act, limit


def compositions(L, max_stages):
    for p in range(1, max_stages + 1):
        for cuts in itertools.combinations(range(1, L), p - 1):
            bounds = (0,) + cuts + (L,)
            yield [(bounds[i], bounds[i + 1] - 1) for i in range(p)]


def brute_force(time, sync, maxin, inflight, alpha, beta, units, budget, max_stages, min_stages=1):
    n_opt, L, _ = time.shape
    best = math.inf
    for parts in compositions(L, max_stages):
        p = len(parts)
        if p < min_stages:
            continue
        for opts in itertools.product(range(n_opt), repeat=p):
            if sum(units[o] for o in opts) > budget:
                continue
            if any(maxin[o, k, r] < inflight[p - 1 - i] for i, ((k, r), o) in enumerate(zip(parts, opts))):
                continue
            stages = [StageChoice(k, r, o) for (k, r), o in zip(parts, opts)]
            best = min(best, objective(time, sync, stages, alpha, beta)[0])
    return best


@pytest.mark.parametrize("seed", range(40))
def test_stage_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(2, 7))
    n_opt = int(rng.integers(1, 4))
    time, sync, maxin, _, _, _ = random_problem(rng, L, n_opt)
    m = int(rng.integers(1, 9))
    schedule = rng.choice(["1f1b", "gpipe"])
    max_stages = int(rng.integers(1, L + 1))
    inflight = np.array([min(j + 1, m) if schedule == "1f1b" else m for j in range(max_stages)], float)
    if seed % 2:  # stages of different device counts under a budget (Alpa's form)
        units = rng.integers(1, 4, size=n_opt)
        budget = int(rng.integers(2, 9))
    else:
        units, budget = np.zeros(n_opt, dtype=int), 0
    alpha, beta = float(m - 1), 1.0
    if seed % 5 == 0:  # interleaved-style weights
        alpha, beta = m - 0.5, 0.5
    expect = brute_force(time, sync, maxin, inflight, alpha, beta, units, budget, max_stages)
    got = stage_dp(time, sync, maxin, inflight, alpha, beta, units=units, budget=budget, max_stages=max_stages)
    if math.isinf(expect):
        assert got is None
        return
    assert got is not None
    assert got.value == pytest.approx(expect, rel=1e-12)
    # the returned stages are a valid partition with that value
    assert got.stages[0].first == 0 and got.stages[-1].last == L - 1
    assert all(a.last + 1 == b.first for a, b in zip(got.stages, got.stages[1:]))
    assert objective(time, sync, list(got.stages), alpha, beta)[0] == pytest.approx(got.value)


def test_nothing_fits_returns_none():
    time = np.full((1, 2, 2), np.inf)
    time[0, 0, 0] = time[0, 1, 1] = time[0, 0, 1] = 1.0
    sync = np.zeros_like(time)
    maxin = np.full_like(time, -1.0)  # model states alone overflow
    assert stage_dp(time, sync, maxin, np.ones(2), alpha=3.0) is None


@pytest.mark.parametrize("seed", range(10))
def test_min_peak_memory_equals_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    L, n_opt = int(rng.integers(2, 7)), int(rng.integers(1, 3))
    _, _, _, static, act, _ = random_problem(rng, L, n_opt)
    max_stages = int(rng.integers(1, L + 1))
    inflight = np.array([j + 1 for j in range(max_stages)], float)
    expect = min(max(min(static[o, k, r] + inflight[len(parts) - 1 - i] * act[o, k, r] for o in range(n_opt))
                     for i, (k, r) in enumerate(parts))
                 for parts in compositions(L, max_stages))
    assert min_peak_memory(static, act, inflight, max_stages) == pytest.approx(expect)
