"""Batched matmuls of DTensors computed on each rank's blocks (``execute.matmul``) against plain torch.

Each case multiplies two DTensors placed as given on a threaded 2x2 or 2x2x2 mesh, under
``LocalBatchedMatmul``, and checks the output, its placements (the module's role table) and both
operands' gradients against the single-device product.
"""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from shardplan.execute.matmul import LocalBatchedMatmul, matmul_roles  # noqa: E402
from shardplan.execute.threaded import run_threaded  # noqa: E402

R = Replicate()


def S(d):
    return Shard(d)


A4, B4 = (4, 4, 8, 6), (4, 4, 6, 8)
# (mesh, a shape, a placements, b shape, b placements, expected output placements)
CASES = {
    "batch and heads on two axes": ((2, 2), A4, (S(0), S(1)), B4, (S(0), S(1)), (S(0), S(1))),
    "rows and columns": ((2, 2), A4, (S(2), R), B4, (R, S(3)), (S(2), S(3))),
    "summed dim: partial output": ((2, 2), A4, (S(3), R), B4, (S(2), S(1)), (Partial(), S(1))),
    "right operand chunked locally": ((2, 2), A4, (S(0), S(2)), B4, (R, R), (S(0), S(2))),
    "conflicting splits: the left wins": ((2, 2), A4, (S(2), S(3)), B4, (S(3), R), (S(2), Partial())),
    "right operand broadcast over the batch": ((2, 2), A4, (S(0), S(1)), (1, 4, 6, 8), (R, S(1)), (S(0), S(1))),
    "3-d right operand": ((2, 2), A4, (S(1), S(2)), (4, 6, 8), (R, R), (S(1), S(2))),
    "split from the right operand only": ((2, 2), A4, (R, R), B4, (S(1), S(3)), (S(1), S(3))),
    # the case that made DTensor's view a strided split on three axes (random Llama plans at 8 ranks)
    "batch and heads on a 2x2x2 mesh": ((2, 2, 2), A4, (R, S(0), S(1)), B4, (R, S(0), S(1)), (R, S(0), S(1))),
    "one dim over two axes": ((2, 2, 2), A4, (S(1), S(0), S(0)), B4, (R, S(0), R), (S(1), S(0), S(0))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_local_batched_matmul_equals_torch(case):
    mesh_shape, a_shape, a_pl, b_shape, b_pl, out_pl = CASES[case]
    torch.manual_seed(0)
    a, b = torch.randn(a_shape, dtype=torch.float64), torch.randn(b_shape, dtype=torch.float64)
    ref = a @ b
    w = torch.randn(ref.shape, dtype=torch.float64)
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    (ar @ br * w).sum().backward()

    def rank_fn(rank):
        mesh = init_device_mesh("cpu", mesh_shape)
        da = distribute_tensor(a, mesh, a_pl).requires_grad_()
        db = distribute_tensor(b, mesh, b_pl).requires_grad_()
        with LocalBatchedMatmul():
            out = da @ db
        placements = tuple(out.placements)
        full = out.full_tensor()
        (out * distribute_tensor(w, mesh, [R] * len(mesh_shape))).sum().backward()
        return placements, full, da.grad.full_tensor(), db.grad.full_tensor()

    for placements, full, ga, gb in run_threaded(math.prod(mesh_shape), rank_fn):
        assert placements == out_pl
        assert not any(isinstance(p, _StridedShard) for p in placements)
        torch.testing.assert_close(full, ref)
        torch.testing.assert_close(ga, ar.grad)
        torch.testing.assert_close(gb, br.grad)


def test_roles_by_hand():
    """The role table read off shapes and placements alone (``matmul_roles`` reads nothing else)."""

    class Fake:
        def __init__(self, shape, placements):
            self.shape, self.ndim, self.placements = torch.Size(shape), len(shape), placements

    a, b = Fake(A4, (S(0), S(2), S(3))), Fake(B4, (S(0), S(3), S(2)))
    assert matmul_roles(a, b) == [("batch", 0), ("m",), ("k",)]
    a, b = Fake(A4, (R, R, _StridedShard(0, split_factor=2))), Fake((4, 6, 8), (S(0), R, R))
    assert matmul_roles(a, b) == [("batch", 1), (), ()]  # a strided split gives no role; b's 3-d batch is out dim 1


def test_plain_tensors_are_left_to_torch():
    x, y = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    with LocalBatchedMatmul():
        z = x @ y
    assert type(z) is torch.Tensor and torch.equal(z, torch.matmul(x, y))
