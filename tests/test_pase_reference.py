"""With the pase cost model, optima and data-parallel costs equal PaSE's code (shared/reference/pase.md s7)."""

import pytest

from shardplan.cost.pase import PaseCostModel
from shardplan.cost.tables import build_tables
from shardplan.search.baselines import data_parallel
from shardplan.search.exact import exact_search
from shardplan.zoo import build_model

OPTIMA = [
    ("alexnet", 4, 148215719552, 577556866496), ("alexnet", 8, 97098296512, 601108833248),
    ("alexnet", 16, 70320712672, 612884816624), ("alexnet", 32, 53136349552, 618772808312),
    ("alexnet", 64, 41120456048, None),
    ("rnnlm", 4, 6866837733376, 9435357388800), ("rnnlm", 8, 4024963186688, 7101223014400),
    ("rnnlm", 16, 2476066881536, 5934155827200), ("rnnlm", 32, 1491938058240, 5350622233600),
    ("rnnlm", 64, 935818633216, 5058855436800),
    ("inception_v3", 4, 986757044608, 1000665140416), ("resnet101", 4, 1718742247936, 1732650343744),
    ("transformer", 4, 2189181321216, 2491384193024),
]


@pytest.mark.parametrize("model,devices,optimum,dp", OPTIMA)
def test_optimum_equals_pase(model, devices, optimum, dp):
    tables = build_tables(build_model(model), PaseCostModel(), devices)
    result = exact_search(tables)
    assert result.cost == pytest.approx(optimum, rel=1e-12)
    dp_cost = tables.cost_of(data_parallel(tables))
    if dp is not None:  # alexnet p=64: 64-way batch split is outside PaSE's space (cutoff 4)
        assert dp_cost == pytest.approx(dp, rel=1e-12)
    assert result.cost <= dp_cost * (1 + 1e-12)


def test_node_and_edge_counts_match_pase():
    counts = {"alexnet": (14, 13), "resnet101": (245, 277), "inception_v3": (219, 253),
              "rnnlm": (4, 3), "transformer": (204, 256)}
    for name, (nodes, edges) in counts.items():
        g = build_model(name)
        assert len(g.ops) == nodes
        assert len({(e.src, e.dst) for e in g.edges()}) == edges


def test_free_communication_uses_every_device():
    tables = build_tables(build_model("alexnet"), PaseCostModel(r=0.0), 8)
    result = exact_search(tables)
    for i, c in enumerate(result.choice):
        if tables.graph.ops[i].kind in ("conv", "fc"):
            assert tables.configs[i][c].prod() == 8


def test_allreduce_hand_calculation():
    # 4-device ring all-reduce of 1000 words, r = 5000: 2 * 3/4 * 1000 * 5000 = 7.5e6
    import numpy as np

    assert PaseCostModel().AR(np.array([1000.0]), np.array([4.0]))[0] == pytest.approx(7.5e6)
