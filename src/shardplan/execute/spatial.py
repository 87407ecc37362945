"""Rows and columns split over ranks: a convolution's halo exchange and pooling in place.

A convolution whose output rows (or columns) are split computes each rank's block of output rows
from the input rows that block reads: its own block plus a halo around it (``needed_rows``). Where
the input is split the same way, each rank sends every other the rows of its block the other reads
in one all-to-all over the mesh axes splitting that dim (:class:`_Rows`; backward returns each halo
row's gradient to its owner); where it is whole on every rank, the rows are sliced. Pools run on
each rank's block wherever no window crosses a block edge (:class:`LocalPooling`), so a split
survives them. ``execute.local.compute_locally`` calls the convolution's part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from shardplan.execute.exchange import block_index, exchange_rows, mesh_group, move

SPATIAL = {"height": 2, "width": 3}
"""A convolution's spatial dims and the axes of its (batch, channels, height, width) tensors."""


def conv_geometry(sub: nn.Conv2d, k: int, padding: int) -> tuple[int, int, int, int]:
    """(kernel, stride, padding, dilation) of ``sub`` along tensor axis ``k`` (2: rows, 3: columns)."""
    j = k - 2
    return sub.kernel_size[j], sub.stride[j], padding, sub.dilation[j]


def spatial_groups(sub: nn.Conv2d, mesh: DeviceMesh, roles: tuple) -> list[tuple]:
    """Per spatially split tensor axis ``k``: (k, held, process group over the mesh axes splitting
    it, this rank's block index there, the number of blocks). The group is made here, when the plan
    is applied, by every rank in the same order (``exchange.mesh_group``); its ranks are in the
    row-major order of their coordinates, which is the order of DTensor's blocks of a dim split over
    several mesh axes."""
    held = any(r is not None and r[0] == "space" and r[2] for r in roles)
    if isinstance(sub.padding, str) or (held and sub.padding_mode != "zeros"):
        raise ValueError(f"a split of a convolution's rows or columns held in blocks needs numeric zero "
                         f"padding; this one has padding={sub.padding!r}, padding_mode={sub.padding_mode!r}")
    out = []
    for k in sorted({r[1] for r in roles if r is not None and r[0] == "space"}):
        axes = tuple(i for i, r in enumerate(roles) if r is not None and r[0] == "space" and r[1] == k)
        held = roles[axes[0]][2]
        index, ways = block_index(mesh, axes)
        out.append((k, held, mesh_group(mesh, axes) if held else None, index, ways))
    return out


def needed_rows(index: int, ways: int, size_out: int, geometry: tuple) -> tuple[int, int]:
    """[first, stop) of the input rows that block ``index`` of ``ways`` equal output blocks reads, in
    the input's coordinates (rows before 0 or past the input's last are padding): output row ``o``
    reads rows ``o s - p`` to ``o s - p + d (r - 1)`` (kernel ``r``, stride ``s``, padding ``p``,
    dilation ``d``)."""
    r, s, p, d = geometry
    block = size_out // ways
    return index * block * s - p, ((index + 1) * block - 1) * s - p + d * (r - 1) + 1


def spatial_rows(xl, k: int, held: bool, group, index: int, ways: int, size_in: int, geometry: tuple):
    """This rank's input rows for its output block along axis ``k``, the padding included as zeros.
    Held rows are split in ``ways`` equal blocks: each rank sends every other the rows of its block
    that the other reads (its neighbours' halo; in general any overlap) in one all-to-all
    (:class:`_Rows`); whole rows are sliced locally."""
    kernel, stride, pad, dil = geometry
    size_out = (size_in + 2 * pad - dil * (kernel - 1) - 1) // stride + 1
    first, stop = needed_rows(index, ways, size_out, geometry)
    lo, hi = max(first, 0), min(stop, size_in)
    if not held:
        rows = xl.narrow(k, lo, hi - lo)
    else:
        block = size_in // ways
        mine = (index * block, (index + 1) * block)
        send, recv = [], []
        for q in range(ways):
            f, t = needed_rows(q, ways, size_out, geometry)
            a, b = max(f, mine[0]), min(t, mine[1])
            send.append((a - mine[0], max(a, b) - mine[0]))
            recv.append(max(0, min(hi, (q + 1) * block) - max(lo, q * block)))
        rows = _Rows.apply(xl, k, tuple(send), tuple(recv), index, group)
    pads = [0, 0] * (xl.ndim - 1 - k) + [lo - first, stop - hi]
    return nn.functional.pad(rows, pads) if any(pads) else rows


class _Rows(torch.autograd.Function):
    """Rows along axis ``k`` gathered from a group's blocks: ``send[q]`` is the [start, stop) of this
    rank's block that rank ``q`` reads, ``recv[q]`` how many rows it reads of rank ``q``'s block; the
    rows of the other ranks come by c10d's ``all_to_all_single`` (the halo only: a rank's own rows
    are copied, not sent to itself), and in rank order the result is contiguous. Backward sends each
    halo row's gradient back to its owner, which adds up what it gets for every copy it sent."""

    @staticmethod
    def forward(ctx, x, k: int, send: tuple, recv: tuple, me: int, group):
        ctx.k, ctx.send, ctx.recv, ctx.me, ctx.group, ctx.shape = k, send, recv, me, group, x.shape
        rows = x.movedim(k, 0)
        out = torch.cat([rows[a:b] for q, (a, b) in enumerate(send) if q != me])
        halo = exchange_rows(out, _others(send, me), _others(recv, me), group)
        below = sum(recv[:me])
        own = rows[send[me][0]:send[me][1]]
        return torch.cat([halo[:below], own, halo[below:]]).movedim(0, k).contiguous()

    @staticmethod
    def backward(ctx, grad):
        me, send = ctx.me, ctx.send
        grad = grad.movedim(ctx.k, 0)
        below, own = sum(ctx.recv[:me]), send[me][1] - send[me][0]
        halo = torch.cat([grad[:below], grad[below + own:]])
        back = exchange_rows(halo, _others(ctx.recv, me), _others(send, me), ctx.group)
        out = back.new_zeros(ctx.shape).movedim(ctx.k, 0)
        out[send[me][0]:send[me][1]] += grad[below:below + own]
        at = 0
        for q, (a, b) in enumerate(send):
            if q != me:
                out[a:b] += back[at:at + b - a]
                at += b - a
        return out.movedim(0, ctx.k), None, None, None, None, None


def _others(counts: tuple, me: int) -> list[int]:
    """Row counts per rank for the all-to-all, this rank's own (copied locally) zero; ``counts`` holds
    counts or [start, stop) ranges."""
    return [0 if q == me else (c if isinstance(c, int) else c[1] - c[0]) for q, c in enumerate(counts)]


_KERNEL_POOLS = {F.max_pool2d, F.avg_pool2d, torch._C._nn.avg_pool2d}
_ADAPTIVE_POOLS = {F.adaptive_avg_pool2d, F.adaptive_max_pool2d}


def _pair(v) -> tuple[int, int]:
    return tuple(v) if isinstance(v, (list, tuple)) else (v, v)


def _pool_args(func, args, kwargs) -> dict | None:
    """A 2-D pooling call's settings by name (kernel, stride, padding, dilation, ceil_mode,
    return_indices, output_size), or None for a call this module does not handle."""
    if func in _ADAPTIVE_POOLS:
        names = ("input", "output_size", "return_indices")
    elif func is F.max_pool2d:
        names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
    elif func in _KERNEL_POOLS:  # avg_pool2d
        names = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
    else:
        return None
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    return {**dict(zip(names, args)), **kwargs}


def pool_blocks(func, args, kwargs) -> tuple | None:
    """(input DTensor, splits per tensor dim, the output extents each rank computes or None) of a
    2-D pooling call that each rank can compute on its own block, or None. Splits of the batch and
    channels always can; splits of the rows or columns when no pooling window crosses a block's
    edge: a kernel pool with stride = kernel, no padding, no dilation, over blocks whose extent the
    kernel divides; an adaptive pool whose output extent the input's divides (uniform windows) into
    as many blocks as the input."""
    a = _pool_args(func, args, kwargs)
    x = a.get("input") if a else None
    if not isinstance(x, DTensor) or x.ndim not in (3, 4) or a.get("return_indices"):
        return None
    ways = [1] * x.ndim
    for p, n in zip(x.placements, x.device_mesh.shape):
        if p.is_partial() or (isinstance(p, Shard) and type(p) is not Shard):
            return None
        if isinstance(p, Shard):
            ways[p.dim % x.ndim] *= n
    if any(x.shape[d] % ways[d] for d in range(x.ndim)):
        return None
    spatial = (x.ndim - 2, x.ndim - 1)
    split = [ways[d] > 1 for d in spatial]
    if "output_size" in a:
        size = [x.shape[d] if o is None else o for d, o in zip(spatial, _pair(a["output_size"]))]
        for d, o, cut in zip(spatial, size, split):
            if cut and (x.shape[d] % o or o % ways[d]):
                return None
        return x, ways, tuple(o // ways[d] for d, o in zip(spatial, size))
    if any(split):
        k = _pair(a["kernel_size"])
        s = _pair(a.get("stride") or k)
        if s != k or _pair(a.get("padding", 0)) != (0, 0) or _pair(a.get("dilation", 1)) != (1, 1):
            return None
        if any(cut and (x.shape[d] // ways[d]) % kd for d, kd, cut in zip(spatial, k, split)):
            return None
    return x, ways, None


_FLATTENS = {torch.flatten, torch.Tensor.flatten, torch.Tensor.view, torch.Tensor.reshape, torch.reshape}


def _flattens_split_map(func, args, kwargs) -> bool:
    """Whether a call flattens a (batch, channels, rows, columns) DTensor split along its rows or
    columns into (batch, features): DTensor views the split as a strided shard of the features, and
    the backward pass of that view fails on a mesh of two axes (torch 2.13)."""
    x = args[0]
    if not isinstance(x, DTensor) or x.ndim != 4:
        return False
    if not any(isinstance(p, Shard) and p.dim % 4 >= 2 for p in x.placements):
        return False
    if func in (torch.flatten, torch.Tensor.flatten):
        start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
        end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
        return start % 4 < 2 and end % 4 >= 2
    rest = tuple(args[1:]) or (kwargs.get("shape", ()),)
    shape = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
    return len(shape) == 2 and all(isinstance(n, int) for n in shape) and shape[0] == x.shape[0]


class LocalPooling(TorchFunctionMode):
    """While active, a 2-D pooling of a DTensor runs on each rank's block when that is exact
    (:func:`pool_blocks`) and keeps its split: a CNN whose convolutions split their rows pools the
    blocks it holds. DTensor's own pooling rules (torch 2.13) replicate rows and columns, or move a
    row split to the batch first, which gathers the whole map, forward and backward; and its
    average pooling has no backward at all. A map split along its rows or columns that is then
    flattened into features (before a classifier's first linear) is gathered along them first, as
    the linear's input is priced: DTensor's view of it fails in the backward pass on two mesh axes.
    The mode stack is per thread, so threaded ranks each enter their own."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FLATTENS and args and _flattens_split_map(func, args, kwargs):
            x = args[0]
            keep = [p if isinstance(p, Shard) and p.dim % x.ndim < x.ndim - 2 else Replicate() for p in x.placements]
            return func(move(x, x.device_mesh, keep), *args[1:], **kwargs)
        found = pool_blocks(func, args, kwargs) if func in _KERNEL_POOLS or func in _ADAPTIVE_POOLS else None
        if found is None:
            return func(*args, **kwargs)
        x, ways, local_size = found
        rest = list(args[1:])
        if local_size is not None:  # an adaptive pool: each block's share of the output
            if rest:
                rest[0] = local_size
            else:
                kwargs = {**kwargs, "output_size": local_size}
        y = func(x.to_local(), *rest, **kwargs)
        shape = torch.Size(x.shape[:-2] + tuple(y.shape[d] * ways[d] for d in (x.ndim - 2, x.ndim - 1)))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=shape, stride=stride)
