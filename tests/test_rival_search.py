"""The rival searches (ILP, FlexFlow's MCMC, OptCNN's reduction) against the exact search and brute force."""

import math
import time

import numpy as np
import pytest

from shardplan.cluster import get_cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.tables import CostTables, EdgeTable, NodeCosts, build_tables
from shardplan.ir.graph import Dim, DimKind, Graph, Op
from shardplan.search import NotReducible, Solution, ilp_search, mcmc_search, optcnn_search
from shardplan.search.baselines import data_parallel
from shardplan.search.brute_force import brute_force
from shardplan.search.exact import exact_search
from shardplan.search.ilp import build_ilp
from shardplan.search.solve import PlanDoesNotFit, memory_of, solve
from shardplan.zoo import build_model
from test_exact_search import random_tables
from test_solve import constrained_brute_force

REL = 1e-9


# -- random tables on a given edge structure -----------------------------------------------------

def dummy_graph(n: int, name: str) -> Graph:
    """n ops with one batch dim each: enough graph for the searches (names, data_parallel)."""
    ops = tuple(Op(f"op{i}", "dummy", (Dim("batch", 64, DimKind.BATCH),), (), ()) for i in range(n))
    return Graph(name, ops, ())


def tables_on(rng, n: int, pairs, kmax: int = 5, kmin: int = 1, inf_fraction: float = 0.0,
              name: str = "random") -> CostTables:
    """Random node / memory / edge costs on ops 0..n-1 and the given (src, dst) pairs (repeats allowed)."""
    configs, nodes = [], []
    for _ in range(n):
        k = int(rng.integers(kmin, kmax + 1))
        configs.append(np.arange(1, k + 1).reshape(k, 1))
        tot = rng.random(k) * 10
        nodes.append(NodeCosts(tot, tot, np.zeros(k), rng.random(k) * 100))
    edges = []
    for s, d in pairs:
        ls, ld = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        cost = rng.random((ls, ld)) * 10
        if inf_fraction:
            cost[rng.random((ls, ld)) < inf_fraction] = np.inf
            cost[0, 0] = min(cost[0, 0], 10.0)  # some plan stays finite: all configs in class 0
        src_class = rng.integers(0, ls, len(configs[s]))
        dst_class = rng.integers(0, ld, len(configs[d]))
        src_class[0] = dst_class[0] = 0
        edges.append(EdgeTable(int(s), int(d), src_class, dst_class, cost))
    return CostTables(dummy_graph(n, name), 1, "random", "unit", tuple(configs), tuple(nodes), tuple(edges))


def chain(n):
    return [(i, i + 1) for i in range(n - 1)]


def tree(rng, n):
    return [(int(rng.integers(0, i)), i) for i in range(1, n)]


def diamond(n):
    """0 -> 1..n-2 -> n-1 (n-2 parallel branches)."""
    return [(0, i) for i in range(1, n - 1)] + [(i, n - 1) for i in range(1, n - 1)]


def small_dag(rng, n):
    pairs = chain(n)
    for _ in range(n):
        s, d = sorted(rng.choice(n, 2, replace=False))
        pairs.append((int(s), int(d)))
    return pairs


def series_parallel(rng, n):
    """A two-terminal series-parallel multigraph grown by series, parallel and pendant moves."""
    pairs, nodes = [(0, 1)], 2
    while nodes < n:
        i = int(rng.integers(len(pairs)))
        u, w = pairs[i]
        move = rng.random()
        if move < 0.45:  # series: subdivide u-w
            pairs[i] = (u, nodes)
            pairs.append((nodes, w))
        elif move < 0.85:  # parallel: a second path u-x-w (a chain with a parallel branch)
            pairs += [(u, nodes), (nodes, w)]
        else:  # pendant op (a loss, an input)
            pairs.append((u, nodes))
        nodes += 1
        if rng.random() < 0.15:  # a literal parallel edge (two tensors between the same ops)
            pairs.append(pairs[int(rng.integers(len(pairs)))])
    return [(a, b) if rng.random() < 0.5 else (b, a) for a, b in pairs]


STRUCTURES = {
    "chain": lambda rng: chain(int(rng.integers(2, 7))),
    "tree": lambda rng: tree(rng, int(rng.integers(3, 7))),
    "diamond": lambda rng: diamond(int(rng.integers(4, 7))),
    "dag": lambda rng: small_dag(rng, int(rng.integers(4, 7))),
}


def structured(seed: int, kind: str, **kw) -> CostTables:
    rng = np.random.default_rng(seed)
    pairs = STRUCTURES[kind](rng)
    n = 1 + max(max(p) for p in pairs)
    return tables_on(rng, n, pairs, name=f"{kind}{seed}", **kw)


def analytic8(name):
    return build_tables(build_model(name), AnalyticCostModel(get_cluster("dgx-a100", devices=8)), 8)


# -- ILP -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_ilp_equals_exact_and_brute_force_on_random_tables(seed):
    tables = random_tables(np.random.default_rng(1000 + seed))
    _, want = brute_force(tables)
    got = ilp_search(tables)
    assert isinstance(got, Solution) and got.method == "ilp" and got.optimal
    assert got.cost == pytest.approx(want, rel=REL)
    assert exact_search(tables).cost == pytest.approx(want, rel=REL)
    assert tables.cost_of(got.choice) == pytest.approx(got.cost, rel=1e-12)
    assert got.lower_bound <= got.cost and got.lower_bound == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("kind", sorted(STRUCTURES))
@pytest.mark.parametrize("seed", range(5))
def test_ilp_on_chains_trees_diamonds_dags(kind, seed):
    tables = structured(seed, kind, inf_fraction=0.2 if seed % 2 else 0.0)
    _, want = brute_force(tables)
    assert math.isfinite(want)
    got = ilp_search(tables)
    assert got.optimal and got.cost == pytest.approx(want, rel=REL)
    assert exact_search(tables).cost == pytest.approx(want, rel=REL)


@pytest.mark.parametrize("seed", range(10))
def test_ilp_memory_cap_against_constrained_brute_force_and_solve(seed):
    rng = np.random.default_rng(500 + seed)
    kind = sorted(STRUCTURES)[seed % len(STRUCTURES)]
    tables = structured(500 + seed, kind)
    lean = sum(float(n.memory.min()) for n in tables.nodes)
    free = memory_of(tables, exact_search(tables).choice)
    limit = lean + rng.random() * max(free - lean, 0.0)
    _, want = constrained_brute_force(tables, limit)
    got = ilp_search(tables, memory_limit_bytes=limit)
    assert got.memory_bytes <= limit
    assert got.optimal and got.cost == pytest.approx(want, rel=REL)
    ref = solve(tables, memory_limit_bytes=limit)
    assert ref.lower_bound <= got.cost * (1 + REL)
    if ref.optimal:
        assert got.cost == pytest.approx(ref.cost, rel=REL)


def test_ilp_memory_cap_too_small_says_so():
    tables = structured(3, "chain")
    lean = sum(float(n.memory.min()) for n in tables.nodes)
    with pytest.raises(PlanDoesNotFit, match="short by"):
        ilp_search(tables, memory_limit_bytes=0.9 * lean)
    tables.edges[0].cost[...] = np.inf  # an edge that forbids every pair
    with pytest.raises(PlanDoesNotFit, match="infinite cost"):
        ilp_search(tables)


@pytest.mark.parametrize("name", ["alexnet", "vgg16"])
def test_ilp_on_zoo_matches_exact_with_zero_gap(name):
    tables = analytic8(name)
    want = exact_search(tables).cost
    got = ilp_search(tables)
    assert got.optimal and got.cost == pytest.approx(want, rel=REL)
    assert (got.cost - got.lower_bound) / got.cost < 1e-6
    assert "MIP gap" in got.note and "solve" in got.note


def test_ilp_build_is_fast_and_time_limit_flags_not_optimal():
    tables = analytic8("transformer")  # 204 ops, 7617 configurations
    t0 = time.perf_counter()
    model = build_ilp(tables)
    assert time.perf_counter() - t0 < 1.0
    assert model.num_col > sum(tables.num_configs) and model.integrality.sum() == sum(tables.num_configs)
    got = ilp_search(tables, time_limit_s=0.05)
    assert not got.optimal
    assert got.cost >= exact_search(tables).cost * (1 - REL)
    assert got.cost <= tables.cost_of(data_parallel(tables)) * (1 + REL)


# -- OptCNN ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(25))
def test_optcnn_equals_exact_on_series_parallel_graphs(seed):
    rng = np.random.default_rng(2000 + seed)
    pairs = series_parallel(rng, int(rng.integers(3, 14)))
    n = 1 + max(max(p) for p in pairs)
    tables = tables_on(rng, n, pairs, kmax=6, name=f"sp{seed}")
    got = optcnn_search(tables)
    want = exact_search(tables).cost
    assert got.method == "optcnn" and got.optimal
    assert got.cost == pytest.approx(want, rel=REL)
    assert tables.cost_of(got.choice) == pytest.approx(got.cost, rel=1e-12)
    if np.prod([float(k) for k in tables.num_configs]) <= 50_000:
        assert got.cost == pytest.approx(brute_force(tables)[1], rel=REL)


@pytest.mark.parametrize("name", ["mlp", "alexnet", "vgg16", "gnmt"])
def test_optcnn_reduces_zoo_graphs_to_the_exact_optimum(name):
    tables = analytic8(name)
    got = optcnn_search(tables)
    assert got.cost == pytest.approx(exact_search(tables).cost, rel=REL)


def test_optcnn_refuses_k4_and_the_transformer():
    rng = np.random.default_rng(7)
    k4 = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    tables = tables_on(rng, 4, k4, kmin=40, kmax=40, name="k4")
    with pytest.raises(NotReducible, match=r"leaves 4 of 4 ops of k4.*series-parallel"):
        optcnn_search(tables)
    # with few configurations the irreducible core is enumerated, still exactly
    small = tables_on(rng, 6, k4 + [(0, 4), (4, 5)], name="k4small")
    got = optcnn_search(small)
    assert got.cost == pytest.approx(brute_force(small)[1], rel=REL)
    assert "4 ops enumerated" in got.note
    with pytest.raises(NotReducible, match="transformer"):
        optcnn_search(analytic8("transformer"))


# -- MCMC ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_mcmc_never_beats_the_optimum_and_prices_its_plan(seed):
    kind = sorted(STRUCTURES)[seed % len(STRUCTURES)]
    tables = structured(3000 + seed, kind, inf_fraction=0.2 if seed % 3 == 0 else 0.0)
    best = exact_search(tables).cost
    got = mcmc_search(tables, time_limit_s=None, max_iters=2000, seed=seed, init="greedy")
    assert got.method == "mcmc" and not got.optimal
    assert got.cost >= best * (1 - 1e-12)
    assert tables.cost_of(got.choice) == pytest.approx(got.cost, rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_mcmc_finds_the_optimum_on_tiny_tables(seed):
    rng = np.random.default_rng(4000 + seed)
    tables = tables_on(rng, 4, small_dag(rng, 4), kmax=4)
    _, want = brute_force(tables)
    got = mcmc_search(tables, time_limit_s=None, max_iters=20_000, seed=seed, init="data_parallel")
    assert got.cost == pytest.approx(want, rel=REL)


@pytest.mark.parametrize("seed", range(6))
def test_mcmc_respects_the_memory_cap(seed):
    rng = np.random.default_rng(5000 + seed)
    tables = structured(5000 + seed, "dag")
    lean = sum(float(n.memory.min()) for n in tables.nodes)
    top = sum(float(n.memory.max()) for n in tables.nodes)
    limit = lean + 0.3 * rng.random() * (top - lean)
    got = mcmc_search(tables, time_limit_s=None, max_iters=5000, seed=seed, memory_limit_bytes=limit)
    assert got.memory_bytes <= limit
    _, want = constrained_brute_force(tables, limit)
    assert got.cost >= want * (1 - 1e-12)


def test_mcmc_is_deterministic_and_the_objective_hook_matches_the_delta_path():
    tables = structured(11, "dag")
    a = mcmc_search(tables, time_limit_s=None, max_iters=3000, seed=5)
    b = mcmc_search(tables, time_limit_s=None, max_iters=3000, seed=5)
    assert a.choice == b.choice and a.cost == b.cost and a.note.split(" (")[0] == b.note.split(" (")[0]
    calls = []

    def objective(ch):
        calls.append(1)
        return tables.cost_of(ch)

    c = mcmc_search(tables, objective=objective, time_limit_s=None, max_iters=3000, seed=5)
    assert len(calls) > 1000  # the hook prices the plans
    assert c.cost == pytest.approx(a.cost, rel=1e-12)
    with pytest.raises(ValueError, match="time_limit_s or max_iters"):
        mcmc_search(tables, time_limit_s=None)


def test_mcmc_improves_on_data_parallel_on_a_zoo_model():
    tables = analytic8("alexnet")
    dp = tables.cost_of(data_parallel(tables))
    best = exact_search(tables).cost
    assert best < 0.9 * dp  # the exact plan beats data parallel here
    got = mcmc_search(tables, time_limit_s=None, max_iters=20_000, seed=0)
    assert best * (1 - 1e-12) <= got.cost < 0.9 * dp
    assert "data_parallel" in got.note
    t0 = time.perf_counter()
    timed = mcmc_search(tables, time_limit_s=0.05)
    assert time.perf_counter() - t0 < 1.0 and "time limit" in timed.note
    assert timed.cost <= dp
