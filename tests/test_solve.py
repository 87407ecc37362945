"""The memory-capped front door against a constrained brute force; plans as values; baselines."""

import itertools
import math

import numpy as np
import pytest

from shardplan.cluster import get_cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.pase import PaseCostModel
from shardplan.cost.tables import build_tables
from shardplan.plan import Plan, PlanError
from shardplan.search.baselines import all_baselines, greedy
from shardplan.search.exact import exact_search
from shardplan.search.solve import PlanDoesNotFit, memory_of, solve
from shardplan.zoo import build_model
from test_analytic import cluster, random_graph


def constrained_brute_force(tables, limit):
    best, best_cost = None, math.inf
    for choice in itertools.product(*(range(k) for k in tables.num_configs)):
        if memory_of(tables, choice) <= limit:
            c = tables.cost_of(choice)
            if c < best_cost:
                best, best_cost = choice, c
    return best, best_cost


@pytest.mark.parametrize("seed", range(40))
def test_memory_cap_against_brute_force(seed):
    rng = np.random.default_rng(9000 + seed)
    for _ in range(20):
        tables = build_tables(random_graph(rng), AnalyticCostModel(cluster(per_node=2, nodes=2)), 4)
        if np.prod([float(k) for k in tables.num_configs]) <= 20_000:
            break
    else:
        pytest.skip("no small graph drawn")
    free = exact_search(tables)
    lean = sum(float(n.memory.min()) for n in tables.nodes)
    top = memory_of(tables, free.choice)
    limit = lean + rng.random() * (top - lean)
    _, want = constrained_brute_force(tables, limit)
    got = solve(tables, memory_limit_bytes=limit)
    assert got.memory_bytes <= limit
    assert tables.cost_of(got.choice) == pytest.approx(got.cost, rel=1e-12)
    assert got.lower_bound <= want * (1 + 1e-12)  # the bound is a true lower bound
    assert got.cost >= want * (1 - 1e-12)
    if got.optimal:
        assert got.cost == pytest.approx(want, rel=1e-12)


def test_too_small_memory_says_by_how_much():
    tables = build_tables(build_model("mlp"), AnalyticCostModel(get_cluster("dgx-a100", devices=8)), 8)
    lean = sum(float(n.memory.min()) for n in tables.nodes)
    with pytest.raises(PlanDoesNotFit, match="short by"):
        solve(tables, memory_limit_bytes=lean * 0.9)
    assert solve(tables, memory_limit_bytes=lean).memory_bytes <= lean


def test_time_limit_returns_best_so_far():
    tables = build_tables(build_model("transformer"), PaseCostModel(), 32)
    got = solve(tables, time_limit_s=0.0)
    assert not got.optimal and "not proven optimal" in got.note
    assert got.cost <= min(tables.cost_of(c) for c in all_baselines(tables).values())


@pytest.mark.parametrize("name", ["alexnet", "mlp", "rnnlm", "vgg16", "gnmt"])
@pytest.mark.parametrize("cost_model", ["pase", "analytic"])
def test_never_worse_than_any_baseline(name, cost_model):
    model = PaseCostModel() if cost_model == "pase" else AnalyticCostModel(get_cluster("dgx-a100", devices=8))
    tables = build_tables(build_model(name), model, 8)
    best = exact_search(tables).cost
    for base, choice in all_baselines(tables).items():
        assert best <= tables.cost_of(choice) * (1 + 1e-12), base
    assert best <= tables.cost_of(greedy(tables)) * (1 + 1e-12)


def test_plan_json_round_trip_and_mismatch():
    tables = build_tables(build_model("alexnet"), PaseCostModel(), 8)
    result = exact_search(tables)
    plan = Plan.from_choice(tables, result.choice)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.to_choice(tables) == list(result.choice)
    other = build_tables(build_model("mlp"), PaseCostModel(), 8)
    with pytest.raises(PlanError, match="alexnet"):
        again.to_choice(other)
    with pytest.raises(PlanError, match="devices"):
        again.to_choice(build_tables(build_model("alexnet"), PaseCostModel(), 4))
    raw = plan.to_dict()
    raw["schema_version"] = 99
    with pytest.raises(PlanError, match="schema_version"):
        Plan.from_dict(raw)
    del raw["schema_version"]
    with pytest.raises(PlanError):
        Plan.from_dict(raw)


def test_mesh_view():
    from shardplan.cluster.mesh import MeshError

    tables = build_tables(build_model("transformer"), AnalyticCostModel(get_cluster("dgx-a100", devices=16)), 16)
    plan = Plan.from_choice(tables, exact_search(tables).choice)
    mesh, ops = plan.mesh_view(tables.graph)
    assert mesh == (2, 2, 2, 2)
    for op_plan, m in zip(plan.ops, ops):
        got = {d: 1 for d, _ in op_plan.split}
        for dim, axes in m.axes:
            for a in axes:
                got[dim] *= mesh[a]
        assert got == dict(op_plan.split)
    with pytest.raises(MeshError, match="devices"):
        plan.mesh_view(tables.graph, (4, 2))
    # a 4-way split cannot use a mesh made of a 16-way axis alone
    split4 = [op for op in plan.ops if 4 in dict(op.split).values()]
    if split4:
        with pytest.raises(MeshError, match="does not map"):
            plan.mesh_view(tables.graph, (16,))
