"""The one-collective exchange between nested layouts (``execute.exchange``), against DTensor's own
redistribution (the same local tiles forward, the same gradients back) and against a brute-force
count of the elements each rank lacks. The ranks are threads (torch's threaded process group)."""

import itertools
import random

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402

from shardplan.execute import exchange as ex  # noqa: E402
from shardplan.execute.threaded import run_threaded  # noqa: E402


def _layouts(ndim: int, axes: int):
    """Every placement list of plain shards and replicas of an ``ndim``-dim tensor on ``axes`` axes."""
    choices = [Replicate()] + [Shard(d) for d in range(ndim)]
    return list(itertools.product(choices, repeat=axes))


def test_applies_to_nested_moves_of_shards_and_replicas_only():
    assert ex.applies((Replicate(), Shard(0)), (Shard(0), Shard(0)))
    assert ex.applies((Shard(2), Shard(2)), (Shard(0), Shard(0)))
    assert not ex.applies((Shard(0), Replicate()), (Shard(1), Replicate()))  # one axis each: DTensor's
    assert not ex.applies((Shard(0), Shard(0)), (Shard(0), Shard(0)))  # no move
    assert not ex.applies((Partial(), Shard(0)), (Shard(0), Shard(0)))  # a reduction
    assert ex.involved_axes((Replicate(), Shard(0), Shard(1)), (Shard(0), Shard(0), Shard(1))) == (0, 1)
    assert ex.involved_axes((Shard(0), Replicate(), Shard(0)), (Shard(0), Shard(1), Shard(0))) == (1,)
    assert ex.involved_axes((Shard(0), Replicate(), Shard(0)), (Shard(0), Shard(0), Shard(0))) == (0, 1, 2)


def _brute_lacking(shape, mesh_shape, src, dst):
    """Per rank: elements of its dst tile missing from its src tile, by listing indices."""
    out = []
    for c in itertools.product(*map(range, mesh_shape)):
        def cells(pl):
            box = ex.tile(shape, mesh_shape, c, pl)
            return set(itertools.product(*(range(lo, hi) for lo, hi in box)))
        out.append(len(cells(dst) - cells(src)))
    return out


@pytest.mark.parametrize("shape", [(4, 6, 8), (5, 6, 3)])
def test_each_rank_receives_exactly_what_it_lacks(shape):
    mesh_shape = (2, 2)
    for src, dst in itertools.product(_layouts(3, 2), repeat=2):
        if not ex.applies(src, dst):
            continue
        lack = _brute_lacking(shape, mesh_shape, src, dst)
        assert ex.lacking(shape, mesh_shape, src, dst) == lack
        for i, c in enumerate(itertools.product(*map(range, mesh_shape))):
            r = ex.route(shape, mesh_shape, c, src, dst)
            assert r.received == lack[i], (src, dst, c)


def test_the_nested_batch_move_of_a_2x4_mesh_moves_one_sample_where_dtensor_gathers_four():
    """Batch split 4 ways on axis 1 -> 8 ways on both (the Mixtral plan's q_proj -> attention edge):
    rank (i, j) holds samples 2j, 2j+1 and needs sample 4i + j, so all but (0, 0) and (1, 3) lack one."""
    shape, mesh_shape = (8, 16, 32), (2, 4)
    lack = ex.lacking(shape, mesh_shape, (Replicate(), Shard(0)), (Shard(0), Shard(0)))
    assert lack == [0] + [16 * 32] * 6 + [0]


def _compare(world, mesh_shape, shape, pairs):
    """Every (src, dst) in ``pairs``: the exchange's local tiles and input gradients equal DTensor's."""
    def rank_fn(rank):
        mesh = init_device_mesh("cpu", mesh_shape)
        bad = []
        for src, dst in pairs:
            torch.manual_seed(0)
            full = torch.randn(shape, dtype=torch.float64)
            weight = torch.randn(shape, dtype=torch.float64)
            got, want = [], []
            for how in ("exchange", "dtensor"):
                x = distribute_tensor(full, mesh, src).detach().requires_grad_()
                y = ex.exchange(x, mesh, dst) if how == "exchange" else x.redistribute(mesh, dst)
                w = distribute_tensor(weight, mesh, dst)
                (y * w).sum().backward()
                (got if how == "exchange" else want).append((y.to_local(), x.grad.to_local(), tuple(y.placements),
                                                             tuple(x.grad.placements)))
            (yl, gl, yp, gp), (yl2, gl2, yp2, gp2) = got[0], want[0]
            if not (torch.equal(yl, yl2) and yp == yp2 and gp == gp2
                    and torch.allclose(gl, gl2, rtol=0, atol=1e-12)):
                bad.append((src, dst))
        return bad
    return run_threaded(world, rank_fn)


def test_exchange_equals_dtensor_on_every_nested_move_of_a_2x2_mesh():
    pairs = [(s, d) for s, d in itertools.product(_layouts(3, 2), repeat=2) if ex.applies(s, d)]
    assert len(pairs) > 50
    for shape in ((4, 6, 8), (5, 6, 3)):  # even, and uneven as DTensor pads nothing and cuts the last short
        assert _compare(4, (2, 2), shape, pairs) == [[]] * 4


def test_exchange_equals_dtensor_on_moves_of_a_2x4_and_a_2x2x2_mesh():
    rng = random.Random(0)
    for mesh_shape, count in (((2, 4), 10), ((2, 2, 2), 10)):
        layouts = _layouts(3, len(mesh_shape))
        pairs = [(s, d) for s, d in itertools.product(layouts, repeat=2) if ex.applies(s, d)]
        pairs = rng.sample(pairs, count) + [((Replicate(), Shard(0)), (Shard(0), Shard(0)))] * (mesh_shape == (2, 4))
        assert _compare(8, mesh_shape, (8, 4, 6), pairs) == [[]] * 8


def test_move_leaves_reductions_and_one_axis_moves_to_dtensor(monkeypatch):
    calls = []
    monkeypatch.setattr(ex, "exchange", lambda x, mesh, target: calls.append(tuple(target)) or x)

    def rank_fn(rank):
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Replicate()])
        ex.move(x, mesh, [Shard(1), Replicate()])  # one axis: DTensor
        ex.move(x, mesh, [Shard(0), Shard(0)])  # nested: the exchange
        p = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0), Partial()], run_check=False)
        ex.move(p, mesh, [Shard(0), Shard(0)])  # a reduction: DTensor
    run_threaded(4, rank_fn)
    assert calls == [(Shard(0), Shard(0))] * 4
