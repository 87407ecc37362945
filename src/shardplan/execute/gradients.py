"""Data-parallel weight gradients reduced in buckets, as DDP reduces them.

``execute.apply.ParallelModule.reduce_gradients`` calls this after the backward pass; the cost model
prices the same packing (``cost.analytic.GRAD_BUCKET_BYTES``, docs/cost_model.md, *Weight gradients
are bucketed*).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from shardplan.cost.analytic import GRAD_BUCKET_BYTES


def reduce_gradients(parameters, mesh: DeviceMesh, bucket_bytes: float = GRAD_BUCKET_BYTES) -> int:
    """Reduce the partial weight gradients of ``parameters`` in buckets, as DDP does; returns the
    number of all-reduces issued.

    DTensor's autograd leaves a data-parallel weight gradient ``Partial`` (each rank holds its batch
    shard's sum) and reduces it only when the optimizer reads it, one collective per parameter (on
    gloo each costs a latency of about 0.2 ms plus DTensor's bookkeeping). Here the local gradients
    that are partial over the same mesh axes are concatenated, in parameter order, into flat buffers of
    at most ``bucket_bytes`` (a larger gradient gets a buffer of its own), each buffer is all-reduced
    once per partial axis over that axis's process group, and every gradient becomes the DTensor it
    would have been: ``Partial`` replaced by ``Replicate``. Sums are the same sums, so results equal the
    per-parameter reduction up to the order of floating-point additions. Gradients partial with a
    reduce op other than sum or average are left to DTensor."""
    from torch.distributed import all_reduce
    from torch.distributed.tensor import Partial

    groups: dict[tuple, list] = {}
    for p in parameters:
        g = p.grad
        if not isinstance(g, DTensor):
            continue
        axes = tuple(i for i, q in enumerate(g.placements) if isinstance(q, Partial))
        if not axes or any(g.placements[i].reduce_op not in ("sum", "avg") for i in axes):
            continue
        groups.setdefault((axes, tuple(g.placements[i].reduce_op for i in axes), g.dtype), []).append(p)
    issued = 0
    for (axes, ops, dtype), params in groups.items():
        buckets, current, size = [], [], 0
        for p in params:
            n = p.grad.to_local().numel() * p.grad.element_size()
            if current and size + n > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += n
        buckets.append(current)
        for bucket in buckets:
            locals_ = [p.grad.to_local() for p in bucket]
            flat = torch.cat([t.reshape(-1) for t in locals_])
            for axis, op in zip(axes, ops):
                all_reduce(flat, group=mesh.get_group(axis))
                issued += 1
                if op == "avg":
                    flat /= mesh.size(axis)
            offset = 0
            for p, t in zip(bucket, locals_):
                g = p.grad
                placed = [Replicate() if i in axes else q for i, q in enumerate(g.placements)]
                local = flat[offset:offset + t.numel()].view(t.shape)
                offset += t.numel()
                p.grad = DTensor.from_local(local, g.device_mesh, placed, run_check=False,
                                            shape=g.shape, stride=g.stride())
    return issued
