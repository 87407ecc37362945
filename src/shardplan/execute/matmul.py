"""Batched matmuls of DTensors (attention's ``q @ k^T`` and ``p @ v``) computed on each rank's blocks.

DTensor runs ``torch.matmul`` of two 4-D tensors as a view to 3-D, a ``bmm`` and a view back. When
the batch and the heads are split over different mesh axes, the first view merges two split dims:
the merged dim is split with a stride (``_StridedShard``), and on a mesh of three axes torch 2.13's
sharding propagation then prices every ``bmm`` strategy's redistribution with its graph search, on
every rank: a random Llama plan on a 2x2x2 mesh had not finished its first forward in 24 minutes.

Here a batched matmul is one product of plain tensors instead. Each mesh axis gets a role from the
operands' placements (the left operand's first, then the right one's):

=========  =====================  =====================  ==============  =================================
role       left (..., m, k)       right (..., k, n)      output          gradients of left / right
=========  =====================  =====================  ==============  =================================
batch d    Shard(d)               Shard(d)               Shard(d)        Shard / Shard (Partial where the
                                                                         operand broadcasts along d)
m          Shard(m)               Replicate              Shard(m)        Shard / Partial
n          Replicate              Shard(n)               Shard(n)        Partial / Shard
k          Shard(k)               Shard(k)               Partial         Shard / Shard
none       Replicate              Replicate              Replicate       Replicate / Replicate
=========  =====================  =====================  ==============  =================================

An operand not already placed so (a partial sum, a strided split, the other operand's conflicting
split) is redistributed to the role's placement first; then each rank multiplies its blocks, and
the output is declared as the DTensor the roles make. Several mesh axes splitting one tensor dim
split it in mesh order on both operands and on the output, so the blocks line up.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.overrides import TorchFunctionMode

from shardplan.execute.exchange import move

MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}


def _plain_shard(p) -> int | None:
    """The tensor dim of a plain ``Shard`` placement (not a strided one), else None."""
    return p.dim if type(p) is Shard else None


def matmul_roles(a: DTensor, b: DTensor) -> list[tuple]:
    """Per mesh axis, the role of ``a @ b``: ``("batch", out_dim)``, ``("m",)``, ``("n",)``, ``("k",)``
    or ``()`` (see the module's table)."""
    na, nb = a.ndim, b.ndim
    nout = max(na, nb)
    out_batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])

    def role(d, nd, shape, left):
        if d is None:
            return None
        if d == nd - 1:
            return ("k",) if left else ("n",)
        if d == nd - 2:
            return ("m",) if left else ("k",)
        o = d + nout - nd
        return ("batch", o) if shape[d] == out_batch[o] and shape[d] > 1 else None

    roles = []
    for pa, pb in zip(a.placements, b.placements):
        r = role(_plain_shard(pa), na, a.shape, True) or role(_plain_shard(pb), nb, b.shape, False)
        roles.append(r or ())
    return roles


def operand_placements(roles, t: DTensor, nout: int, left: bool) -> tuple[list, list]:
    """(placements ``t`` must have, placements of its gradient) for the roles."""
    nd = t.ndim
    want, grad = [], []
    for r in roles:
        if not r:
            want.append(Replicate())
            grad.append(Replicate())
        elif r[0] == "batch":
            d = r[1] - (nout - nd)
            if d >= 0 and t.shape[d] > 1:
                want.append(Shard(d))
                grad.append(Shard(d))
            else:  # broadcast along the split dim: each rank's gradient covers its rows only
                want.append(Replicate())
                grad.append(Partial())
        elif r[0] == "k":
            want.append(Shard(nd - 1 if left else nd - 2))
            grad.append(Shard(nd - 1 if left else nd - 2))
        elif (r[0] == "m") == left:
            want.append(Shard(nd - 2 if left else nd - 1))
            grad.append(Shard(nd - 2 if left else nd - 1))
        else:  # the other operand's rows/columns are split: this one is read whole, its gradient partial
            want.append(Replicate())
            grad.append(Partial())
    return want, grad


def local_matmul(a: DTensor, b: DTensor) -> DTensor:
    """``a @ b`` for two DTensors on one mesh, computed on each rank's blocks (see the module)."""
    mesh = a.device_mesh
    nout = max(a.ndim, b.ndim)
    roles = matmul_roles(a, b)
    parts = []
    for t, left in ((a, True), (b, False)):
        want, grad = operand_placements(roles, t, nout, left)
        if tuple(t.placements) != tuple(want):
            t = move(t, mesh, want)
        parts.append(t.to_local(grad_placements=grad))
    out_local = torch.matmul(*parts)
    out_pl = []
    for r in roles:
        if not r:
            out_pl.append(Replicate())
        elif r[0] == "batch":
            out_pl.append(Shard(r[1]))
        elif r[0] == "k":
            out_pl.append(Partial())
        else:
            out_pl.append(Shard(nout - 2 if r[0] == "m" else nout - 1))
    shape = torch.Size(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(out_local, mesh, out_pl, run_check=False, shape=shape, stride=stride)


class LocalBatchedMatmul(TorchFunctionMode):
    """While active, ``torch.matmul`` of two DTensors of three or more dims on one mesh runs as
    :func:`local_matmul`; everything else runs as usual. The mode stack is per thread, so threaded
    ranks each enter their own."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS and len(args) == 2 and not kwargs:
            a, b = args
            if (isinstance(a, DTensor) and isinstance(b, DTensor) and a.ndim >= 3 and b.ndim >= 3
                    and a.device_mesh == b.device_mesh):
                return local_matmul(a, b)
        return func(*args, **kwargs)
