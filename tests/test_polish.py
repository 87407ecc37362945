"""The refinement on the predicted step (``search.polish``, ``solve(..., model=)``): its objective
equals ``step_seconds``; brute force over every plan of small graphs bounds it from below; it is a
local optimum, never worse than where it started, within the memory limit."""

import dataclasses
import itertools

import numpy as np
import pytest

from shardplan.cluster import get_cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.step import StepObjective, step_seconds
from shardplan.cost.tables import build_tables
from shardplan.search.baselines import all_baselines
from shardplan.search.polish import polish
from shardplan.search.solve import memory_of, solve
from shardplan.zoo import build_model
from test_analytic import cluster, random_graph


def jittery(cl, jitter=0.01, stretch=0.2):
    return dataclasses.replace(cl, device=dataclasses.replace(cl.device, sync_jitter=jitter, sync_stretch=stretch))


@pytest.mark.parametrize("name", ["mlp", "transformer", "alexnet", "rnnlm"])
def test_step_objective_equals_step_seconds(name):
    """The objective prepared over every configuration at once prices a plan as ``step_seconds`` does
    from that plan's configurations alone (the same walk, other array paths)."""
    model = AnalyticCostModel(jittery(get_cluster("dgx-a100", devices=8)))
    tables = build_tables(build_model(name), model, 8)
    objective = StepObjective(model, tables)
    rng = np.random.default_rng(0)
    plans = list(all_baselines(tables).values()) + [[int(rng.integers(k)) for k in tables.num_configs]
                                                    for _ in range(5)]
    for choice in plans:
        assert objective(list(choice)) == pytest.approx(step_seconds(model, tables, choice), rel=1e-12)
    plain = AnalyticCostModel(get_cluster("dgx-a100", devices=8))  # no jitter: the tables' own cost
    tables = build_tables(build_model(name), plain, 8)
    assert StepObjective(plain, tables)(plans[0]) == pytest.approx(tables.cost_of(plans[0]), rel=1e-12)


def small_tables(seed, jitter):
    rng = np.random.default_rng(7000 + seed)
    model = AnalyticCostModel(jittery(cluster(per_node=2, nodes=2), jitter=jitter, stretch=0.0))
    for _ in range(30):
        tables = build_tables(random_graph(rng), model, 4)
        if 16 <= np.prod([float(k) for k in tables.num_configs]) <= 20_000:
            return model, tables
    pytest.skip("no small graph drawn")


def local_optimum(objective, tables, choice, value, limit=float("inf")):
    for i, k in enumerate(tables.num_configs):
        for c in range(k):
            trial = list(choice)
            trial[i] = c
            if memory_of(tables, trial) <= limit and objective(trial) < value * (1 - 1e-9):
                return False
    return True


@pytest.mark.parametrize("seed", range(12))
def test_polish_against_brute_force(seed):
    """On small random graphs with a jitter so large that the waits dominate (the per-op sum and the
    step then disagree): the polished plan is no slower than the exact plan it started from, no
    faster than the best plan by brute force, within the memory limit, and no single op's change
    improves it (a local search: brute force may still know a better plan further away)."""
    model, tables = small_tables(seed, jitter=5.0)
    objective = StepObjective(model, tables)
    values = {c: objective(list(c)) for c in itertools.product(*(range(k) for k in tables.num_configs))}
    best = min(values.values())
    lean = sum(float(n.memory.min()) for n in tables.nodes)
    limit = lean + 0.5 * (max(memory_of(tables, c) for c in values) - lean)
    start = solve(tables, memory_limit_bytes=limit).choice
    choice, value, moves = polish(objective, tables, start, limit)
    assert value == pytest.approx(objective(list(choice)), rel=1e-12)
    assert memory_of(tables, choice) <= limit
    assert best * (1 - 1e-12) <= value <= values[tuple(start)] * (1 + 1e-12)
    assert local_optimum(objective, tables, choice, value, limit)
    assert (moves > 0) == (value < values[tuple(start)])


@pytest.mark.parametrize("name,devices", [("mlp", 8), ("gnmt", 2), ("transformer", 2)])
def test_polish_lowers_the_step_the_per_op_sum_mispriced(name, devices):
    """Zoo models on a DGX with a jitter: the exact plan of the per-op sum is predicted slower than
    a neighbour of it; ``solve(model=...)`` returns the neighbour, says so, and no single op's
    change improves it further."""
    model = AnalyticCostModel(jittery(get_cluster("dgx-a100", devices=8)))
    tables = build_tables(build_model(name), model, devices)
    exact, sol = solve(tables), solve(tables, model=model)
    objective = StepObjective(model, tables)
    before = objective(list(exact.choice))
    assert sol.step_seconds == pytest.approx(step_seconds(model, tables, sol.choice), rel=1e-12)
    assert sol.step_seconds < before * (1 - 1e-6)
    assert not sol.optimal and sol.method == "exact + polish" and "refined on the predicted step" in sol.note
    assert sol.cost == pytest.approx(tables.cost_of(sol.choice)) and sol.cost >= exact.cost
    assert local_optimum(objective, tables, sol.choice, sol.step_seconds)


@pytest.mark.parametrize("name", ["mlp", "transformer", "alexnet"])
def test_solve_with_a_jittery_model_is_never_predicted_slower_than_a_baseline(name):
    model = AnalyticCostModel(jittery(get_cluster("dgx-a100", devices=8)))
    tables = build_tables(build_model(name), model, 8)
    sol = solve(tables, model=model)
    assert sol.step_seconds == pytest.approx(step_seconds(model, tables, sol.choice), rel=1e-12)
    for base, choice in all_baselines(tables).items():
        assert sol.step_seconds <= step_seconds(model, tables, choice) * (1 + 1e-12), base
