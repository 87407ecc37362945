"""Axis maps: how a folded (cheap) op's output axes relate to the IR tensor they come from.

Capture folds elementwise ops, views, transposes, slices and reductions into their neighbours; each
folded value keeps, per axis, the axes of its IR source that compose it. A reshape that splits
``(b, l, h*k)`` into ``(b, l, h, k)`` gives ``h`` and ``k`` both the source's last axis, which is how
attention heads stay tied to a projection's output features.
"""

from __future__ import annotations

import math

# Folded ops that may change the rank or extents of their input.
_VIEWS = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "expand", "permute", "transpose", "t",
          "unsqueeze", "squeeze", "select", "slice", "split", "split_with_sizes", "chunk", "unbind",
          "mean", "sum", "amax", "max", "contiguous", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d",
          "max_pool2d_with_indices", "cat"}


def _view_map(in_shape, out_shape) -> list[tuple[int, ...]]:
    """For a reshape: per output axis, the input axes it is made of (major first); () if unknown."""
    out: list[tuple[int, ...]] = [()] * len(out_shape)
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        if i < len(in_shape) and in_shape[i] == 1:
            i += 1
            continue
        if j < len(out_shape) and out_shape[j] == 1:
            j += 1
            continue
        if i >= len(in_shape) or j >= len(out_shape):
            break
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            else:
                j += 1
                gj.append(j)
                pj *= out_shape[j]
        ins = tuple(a for a in gi if in_shape[a] > 1)
        outs = [b for b in gj if out_shape[b] > 1]
        if len(ins) == 1 or len(outs) == 1:  # a pure split or a pure merge
            for b in outs:
                out[b] = ins
        i += 1
        j += 1
    return out


_RESHAPES = {"view", "reshape", "_unsafe_view", "unflatten"}


def view_limits(base: str, amap, in_shape, out_shape) -> dict[int, int]:
    """For a reshape that splits a source axis into ``(major, minor...)``: source axis -> size of the
    major part. DTensor keeps a shard through such a view only when the shard count divides the
    major part (a projection viewed as ``(heads, head_dim)`` splits along whole heads), so the
    split of that source axis is limited to divisors of it."""
    if base not in _RESHAPES or tuple(in_shape) == tuple(out_shape) or math.prod(in_shape) != math.prod(out_shape):
        return {}
    amap = list(amap) + [()] * (len(in_shape) - len(amap))
    groups = _view_map(in_shape, out_shape)
    limits: dict[int, int] = {}
    for i, src in enumerate(amap):
        outs = [j for j, g in enumerate(groups) if g == (i,)]
        if len(src) == 1 and len(outs) > 1:  # a pure split of a value axis that is one source axis
            limits[src[0]] = int(out_shape[outs[0]])
    return limits


def dim_arg(node, rank: int, pos: int = 1, default: int = 0) -> int:
    """The ``dim`` argument of an aten call, normalised to ``0..rank-1``."""
    d = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", default)
    if isinstance(d, (list, tuple)):
        d = d[0] if d else default
    return int(d) % max(rank, 1) if isinstance(d, int) else default

POOLS = {"max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
         "adaptive_max_pool2d"}
"""Pooling kernels: folded like other cheap ops (their windows decide which axes they keep:
:func:`block_pooled_axes`), priced at the device's measured pooling rate (``cost.analytic``)."""


def _pair(v, default) -> tuple:
    v = default if v is None or (isinstance(v, (list, tuple)) and not v) else v
    return tuple(v) * (2 // len(v)) if isinstance(v, (list, tuple)) else (v, v)


def block_pooled_axes(node, base: str, in_shape, out_shape) -> set[int]:
    """The rows and columns of a 2-D pooling that each block of an even split pools on its own (no
    window crosses a block's edge when the consumer's split of the pooled extent divides it): a
    kernel pool with stride = kernel, no padding or dilation, over an extent the kernel divides, or
    an adaptive pool whose output extent the input's divides. Such an axis keeps its source axis,
    so a convolution reading the pooled map may split its rows as the map's producer does, and the
    runtime pools the blocks locally (``execute.spatial.LocalPooling``)."""
    if base not in POOLS or len(in_shape) not in (3, 4):
        return set()
    spatial = (len(in_shape) - 2, len(in_shape) - 1)
    if base.startswith(("adaptive", "_adaptive")):
        return {d for d in spatial if out_shape[d] and in_shape[d] % out_shape[d] == 0}
    args = list(node.args) + [None] * 6
    k = _pair(args[1], 1)
    stride = _pair(args[2], k)
    padding = _pair(args[3], 0)
    dilation = _pair(args[4], 1) if base.startswith("max") else (1, 1)
    if stride != k or padding != (0, 0) or dilation != (1, 1):
        return set()
    return {d for d, kd in zip(spatial, k) if in_shape[d] % kd == 0 and out_shape[d] == in_shape[d] // kd}


def map_axes(node, base: str, amap, in_shape, out_shape) -> tuple[tuple[int, ...], ...]:
    """The axis map of a folded op's output, given the axis map ``amap`` of its main input.

    ``amap[i]`` lists the axes of the IR source tensor that make up axis ``i`` (major first); an
    axis whose origin is lost (a slice, a broadcast, an irregular reshape) maps to ``()``.
    """
    amap = list(amap) + [()] * (len(in_shape) - len(amap))
    if base in POOLS and len(in_shape) == len(out_shape):  # windows crossing a block's edge lose the axis
        kept = block_pooled_axes(node, base, in_shape, out_shape)
        spatial = range(len(in_shape) - 2, len(in_shape))
        return tuple(() if i in spatial and i not in kept else m for i, m in enumerate(amap))
    if in_shape == out_shape and base not in ("permute", "transpose", "t"):
        return tuple(amap)  # elementwise ops, norms, softmax, casts, full slices
    if base in ("permute",):
        perm = [p % len(in_shape) for p in node.args[1]]
        return tuple(amap[p] for p in perm)
    if base in ("transpose", "t"):
        if base == "t":
            return tuple(reversed(amap))
        d0, d1 = (int(x) % len(in_shape) for x in node.args[1:3])
        amap[d0], amap[d1] = amap[d1], amap[d0]
        return tuple(amap)
    if base == "unsqueeze":
        d = int(node.args[1]) % (len(in_shape) + 1)
        return tuple(amap[:d] + [()] + amap[d:])
    if base == "select":
        d = int(node.args[1]) % len(in_shape)
        return tuple(amap[:d] + amap[d + 1:])
    if base == "expand" or (len(in_shape) == len(out_shape) and base not in _VIEWS):
        off = len(out_shape) - len(in_shape)
        out = [()] * off + [m if in_shape[i] == out_shape[off + i] else () for i, m in enumerate(amap)]
        return tuple(out)
    if len(in_shape) == len(out_shape):  # slices, a concat with a constant: same axes
        return tuple(m if in_shape[i] == out_shape[i] else () for i, m in enumerate(amap))
    if base in ("mean", "sum", "amax", "max") and len(out_shape) < len(in_shape):
        dims = node.args[1] if len(node.args) > 1 else list(range(len(in_shape)))
        dims = {int(x) % len(in_shape) for x in (dims if isinstance(dims, (list, tuple)) else [dims])}
        return tuple(m for i, m in enumerate(amap) if i not in dims)
    if math.prod(in_shape) == math.prod(out_shape):  # a reshape: split and merge axes
        groups = _view_map(in_shape, out_shape)
        out = []
        for g in groups:
            parts: list[int] = []
            for i in g:
                for s in amap[i]:
                    if s not in parts:
                        parts.append(s)
            out.append(tuple(parts))
        return tuple(out)
    return tuple(() for _ in out_shape)
