"""Edges priced by the blocks each rank holds (``cost.moves.placed_words``), against every rank's
blocks counted one by one, and the runtime's mesh giving the blocks the tables priced."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from shardplan.cluster import get_cluster
from shardplan.cluster.mesh import default_mesh, placed_layouts, same_blocks
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.moves import placed_words
from shardplan.cost.pase import redistribution_words
from shardplan.cost.tables import build_tables, edge_layouts
from shardplan.ir.builder import GraphBuilder
from shardplan.plan import Plan


def boxes(shape, placements, mesh):
    """Every rank's block, [(begin, end) per tensor axis], ranks row-major over the mesh: the blocks
    of an axis split over several mesh axes numbered with the first mesh axis outermost (DTensor)."""
    out = []
    for coord in itertools.product(*[range(s) for s in mesh]):
        box = []
        for axis, length in enumerate(shape):
            index, ways = 0, 1
            for a, size in enumerate(mesh):
                if placements[a] == axis:
                    index, ways = index * size + coord[a], ways * size
            box.append((index * length // ways, (index + 1) * length // ways))
        out.append(box)
    return out


def busiest_lacks(shape, src, dst, mesh) -> int:
    """Most elements any rank lacks of its new block, counted rank by rank."""
    worst = 0
    for have, need in zip(boxes(shape, src, mesh), boxes(shape, dst, mesh)):
        size = math.prod(e - b for b, e in need)
        overlap = math.prod(max(0, min(e1, e2) - max(b1, b2)) for (b1, e1), (b2, e2) in zip(have, need))
        worst = max(worst, size - overlap)
    return worst


def placed_row(shape, placements, mesh):
    factors = [math.prod(s for s, p in zip(mesh, placements) if p == axis) for axis in range(len(shape))]
    return factors + list(placements)


@pytest.mark.parametrize("mesh", [(2, 2), (2, 2, 2), (3, 2), (2, 3, 2), (2, 2, 2, 2)])
def test_placed_words_is_the_busiest_ranks_lack(mesh):
    rng = np.random.default_rng(len(mesh) * 7 + mesh[0])
    shape = (48, 96, 144)  # divisible by every split of these meshes
    layouts = [row for row in itertools.product(range(-1, len(shape)), repeat=len(mesh))]
    rows = np.array([placed_row(shape, pl, mesh) for pl in layouts], dtype=np.int64)
    pick = rng.choice(len(rows), size=min(len(rows), 24), replace=False)
    src, dst = rows[pick], rows[rng.permutation(pick)]
    got = placed_words(shape, mesh, src, dst)
    n = len(shape)
    for i, j in itertools.product(range(len(src)), range(len(dst))):
        want = busiest_lacks(shape, src[i, n:], dst[j, n:], mesh)
        assert got[i, j] == want, (src[i], dst[j])


def test_the_rule_counted_less_than_the_blocks_move():
    """Batch 4 over the inner two axes of a 2x2x2 mesh -> batch 2 on the innermost: PaSE's rule says
    each rank keeps half of what it needs, but rank 1 held sample block 1 and needs block 1 of 2 (the
    second half): it lacks all of it."""
    shape, mesh = (8, 16), (2, 2, 2)
    src = np.array([placed_row(shape, (-1, 0, 0), mesh)])
    dst = np.array([placed_row(shape, (-1, -1, 0), mesh)])
    assert redistribution_words(shape, src[:, :2], dst[:, :2])[0, 0] == 32
    assert placed_words(shape, mesh, src, dst)[0, 0] == 64 == busiest_lacks(shape, (-1, 0, 0), (-1, -1, 0), mesh)
    # the same split factors on other mesh axes is a move the rule does not see at all
    moved = np.array([placed_row(shape, (0, -1, -1), mesh)])
    inner = np.array([placed_row(shape, (-1, -1, 0), mesh)])
    assert redistribution_words(shape, moved[:, :2], inner[:, :2])[0, 0] == 0
    assert placed_words(shape, mesh, moved, inner)[0, 0] == 64


def _chain():
    """x -> fc1 (batch, out) -> fc2 (batch, out): small enough to check every pair of configurations."""
    b = GraphBuilder("chain")
    x = b.input("x", (8, 16))
    h = b.linear(x, 16, name="fc1")
    b.linear(h, 16, name="fc2")
    return b.build()


def test_tables_price_the_blocks_of_every_pair_of_configurations():
    """Every pair of (fc1, fc2) configurations on 8 devices: the edge's forward bytes are what the
    busiest rank lacks on the primes' mesh, by the mesh axes the runtime gives each dim."""
    graph = _chain()
    cluster = get_cluster("dgx-a100")
    model = AnalyticCostModel(cluster)
    tables = build_tables(graph, model, 8)
    mesh = default_mesh(8)
    (edge,) = [e for e in graph.edges() if e.src != e.dst]
    src_op, dst_op = graph.ops[edge.src], graph.ops[edge.dst]
    tensor = graph.tensor(edge.tensor)
    for ks, kd in itertools.product(range(len(tables.configs[edge.src])), range(len(tables.configs[edge.dst]))):
        s = edge_layouts(src_op, tables.configs[edge.src][ks:ks + 1], src_op.outputs[edge.src_out].axes, mesh)
        d = edge_layouts(dst_op, tables.configs[edge.dst][kd:kd + 1], dst_op.inputs[edge.dst_in].axes, mesh)
        fwd, _ = model.edge_bytes(tensor, s, d, mesh)
        n = len(tensor.shape)
        want = 0 if (s[0, :n] == 1).all() else busiest_lacks(tensor.shape, s[0, n:], d[0, n:], mesh)
        assert fwd[0, 0] == want * tensor.dtype_bytes


def test_plans_run_on_a_mesh_with_the_priced_blocks():
    """choose_mesh takes a coarser mesh only where every rank holds the blocks it holds on the
    primes' mesh: data parallel lays on (8,); batch 4 then batch 2 lays on neither 2x4 nor 4x2."""
    pytest.importorskip("torch")
    from shardplan.execute.apply import choose_mesh

    graph = _chain()
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100")), 8)
    dp = Plan.from_choice(tables, [tables.index_of(i, (8, 1, 1)) for i in range(2)])
    assert choose_mesh(graph, dp) == (8,)
    batches = Plan.from_choice(tables, [tables.index_of(0, (4, 1, 1)), tables.index_of(1, (2, 1, 1))])
    configs = [tuple(f for _, f in op.split) for op in batches.ops]
    assert not same_blocks(graph, configs, (2, 4), (2, 2, 2))  # batch 2 on the outer axis there
    assert not same_blocks(graph, configs, (4, 2), (2, 2, 2))  # batch 4 on the outer axis there
    assert choose_mesh(graph, batches) == (2, 2, 2)
    # batch 4 above a 2-way feature split, then batch 2: 4x2 gives the same blocks
    mixed = Plan.from_choice(tables, [tables.index_of(0, (4, 2, 1)), tables.index_of(1, (2, 1, 1))])
    assert choose_mesh(graph, mixed) == (4, 2)
    assert same_blocks(graph, [tuple(f for _, f in op.split) for op in mixed.ops], (4, 2), default_mesh(8))


def test_placed_layouts_follow_the_mesh_view():
    """The placed layout of an operand names, for each mesh axis, the tensor axis that Plan.mesh_view
    splits there."""
    graph = _chain()
    op = graph.ops[1]
    config = np.array([[4, 2, 1]])
    row = placed_layouts(op, config, op.outputs[0].axes, (2, 2, 2))[0]
    assert list(row) == [4, 2, 0, 0, 1]  # out_features on the innermost axis, batch on the two above
