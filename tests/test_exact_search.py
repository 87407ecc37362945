"""The exact search equals brute force on random small graphs and random cost tables."""

import numpy as np
import pytest

from shardplan.cost.pase import PaseCostModel
from shardplan.cost.tables import CostTables, EdgeTable, NodeCosts, build_tables
from shardplan.ir.builder import GraphBuilder
from shardplan.search.brute_force import brute_force
from shardplan.search.exact import exact_search


def random_graph(rng: np.random.Generator):
    """Chains, diamonds and skip connections of linear / add / norm / softmax ops."""
    b = GraphBuilder(f"random{rng.integers(1 << 30)}")
    width = int(rng.choice([4, 8]))
    x = b.input("x", (int(rng.choice([4, 8])), width), ("batch", "features"))
    live = [x]
    for i in range(int(rng.integers(2, 6))):
        kind = rng.choice(["linear", "add", "norm", "softmax"])
        src = live[int(rng.integers(len(live)))]
        if kind == "linear":
            y = b.linear(src, width, pw_ops=int(rng.integers(0, 2)))
        elif kind == "add" and len(live) > 1:
            other = live[int(rng.integers(len(live)))]
            y = b.add(src, other)
        elif kind == "norm":
            y = b.layer_norm(src)
        else:
            y = b.softmax(src)
        live.append(y)
    # make sure every produced tensor is consumed, so the graph is connected through the loss
    while len(live) > 2:
        a, c = live.pop(), live.pop()
        live.append(b.add(a, c))
    b.softmax_xent(live[-1])
    return b.build(pase_cutoff=1)


def random_tables(rng: np.random.Generator) -> CostTables:
    g = random_graph(rng)
    n = len(g.ops)
    configs, nodes = [], []
    for _ in range(n):
        k = int(rng.integers(1, 6))
        configs.append(np.arange(k).reshape(k, 1))
        tot = rng.random(k) * 10
        nodes.append(NodeCosts(tot, tot, np.zeros(k), np.zeros(k)))
    edges = []
    for _ in range(int(rng.integers(n - 1, 2 * n))):
        s, d = rng.choice(n, 2, replace=False)
        ls, ld = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        edges.append(EdgeTable(int(s), int(d), rng.integers(0, ls, len(configs[s])),
                               rng.integers(0, ld, len(configs[d])), rng.random((ls, ld)) * 10))
    return CostTables(g, 1, "random", "unit", tuple(configs), tuple(nodes), tuple(edges))


@pytest.mark.parametrize("seed", range(200))
def test_exact_equals_brute_force_on_random_graphs_pase(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        g = random_graph(rng)
        tables = build_tables(g, PaseCostModel(r=float(rng.choice([1.0, 50.0, 5000.0]))), int(rng.choice([2, 4])))
        total = np.prod([float(k) for k in tables.num_configs])
        if total <= 200_000:
            break
    else:
        pytest.skip("no small graph drawn")
    _, best = brute_force(tables)
    result = exact_search(tables)
    assert result.cost == pytest.approx(best, rel=1e-12)
    assert tables.cost_of(result.choice) == pytest.approx(result.cost, rel=1e-12)


@pytest.mark.parametrize("seed", range(100))
def test_exact_equals_brute_force_on_random_tables(seed):
    """Arbitrary structure (dense, repeated pairs, shared layout classes) on pure arrays."""
    tables = random_tables(np.random.default_rng(1000 + seed))
    _, best = brute_force(tables)
    result = exact_search(tables)
    assert result.cost == pytest.approx(best, rel=1e-12)


def test_time_limit_interrupts():
    from shardplan.search.exact import SearchInterrupted
    from shardplan.zoo import build_model

    tables = build_tables(build_model("transformer"), PaseCostModel(), 16)
    with pytest.raises(SearchInterrupted):
        exact_search(tables, time_limit_s=0.0)
