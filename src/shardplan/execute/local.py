"""Modules computed on each rank's blocks as plain tensors, their outputs and gradients declared as
the DTensors the plan's split makes: where torch 2.13's DTensor has no rule (LSTMs, mixture-of-experts
blocks: :func:`run_locally`) or refuses the split on a mesh of two or more axes (linears and
convolutions: :func:`local_roles`, :func:`compute_locally`). ``execute.apply`` installs them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from shardplan.cluster.mesh import OpMesh
from shardplan.execute.exchange import exchange_rows, mesh_group, move
from shardplan.ir.graph import Op

SPATIAL = {"height": 2, "width": 3}
"""A convolution's spatial dims and the axes of its (batch, channels, height, width) tensors."""


def run_locally(sub: nn.Module, mesh: DeviceMesh, in_pl, batch_in: int = 0, ep_axes: tuple = ()) -> None:
    """Run ``sub`` (an LSTM, or a mixture-of-experts block: no DTensor sharding rule in torch 2.13) on
    each rank's batch shard with the local copy of its replicated weights. The input is brought to the
    planned layout (the batch, axis ``batch_in``, split over some mesh axes), the weights enter as
    local tensors whose gradients are declared partial over those axes (each rank's gradient covers
    its share of the batch), so DTensor reduces them as a data-parallel gradient; outputs go back as
    DTensors sharded on the batch (an LSTM's state on its axis 1).

    Expert parallelism (``ep_axes``: the mesh axes splitting the experts with gathered tokens): the
    input is whole over those axes (the planned layout gathers it), each rank runs its own experts
    on every token, and its output is a partial sum, all-reduced over ``ep_axes``; the gradients of
    the input and of the replicated router are partial there too, the experts' own stay sharded.
    Axes whose experts receive tokens by all-to-all (``execute.experts``) split the batch here."""
    from torch.distributed.tensor import Partial
    from torch.func import functional_call

    forward = sub.forward
    is_lstm = isinstance(sub, nn.LSTM)

    def local_forward(x, *rest):
        if not isinstance(x, DTensor):
            return forward(x, *rest)
        target = [Shard(batch_in) if isinstance(p, Shard) else Replicate() for p in in_pl]
        x = move(x, mesh, target) if tuple(x.placements) != tuple(target) else x

        def grad_pl(w):
            # a weight sharded along a mesh axis (experts) keeps its gradient sharded there; one
            # replicated along it has a partial gradient where the input is split (batch, or the
            # tokens an all-to-all dispatch holds per rank) or the experts are (gathered tokens)
            return [q if isinstance(q, Shard) else Partial() if isinstance(p, Shard) or i in ep_axes
                    else Replicate() for i, (p, q) in enumerate(zip(target, w.placements))]

        weights = {n: (w.to_local(grad_placements=grad_pl(w)) if isinstance(w, DTensor) else w)
                   for n, w in sub.named_parameters()}
        rest = tuple(tuple(h.to_local() if isinstance(h, DTensor) else h for h in r) if isinstance(r, tuple)
                     else (r.to_local() if isinstance(r, DTensor) else r) for r in rest)
        x_grad = [Partial() if i in ep_axes else p for i, p in enumerate(target)]
        out = functional_call(sub, weights, (x.to_local(grad_placements=x_grad), *rest))
        if is_lstm:
            y, (h, c) = out
            state_pl = [Shard(1) if isinstance(p, Shard) else Replicate() for p in target]
            return (DTensor.from_local(y, mesh, target, run_check=False),
                    (DTensor.from_local(h, mesh, state_pl, run_check=False),
                     DTensor.from_local(c, mesh, state_pl, run_check=False)))
        made = [Partial() if i in ep_axes else p for i, p in enumerate(target)]

        def wrap(t):
            if not isinstance(t, torch.Tensor):
                return t
            t = DTensor.from_local(t, mesh, made, run_check=False)
            return t.redistribute(mesh, target) if ep_axes else t  # sum the experts' shares
        return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)

    sub.forward = local_forward


def local_roles(op: Op, om: OpMesh, mesh_shape: tuple[int, ...]) -> tuple | None:
    """What each mesh axis splits of a linear or convolution that must bypass DTensor's own rules,
    or None for one DTensor runs as it is.

    torch 2.13's DTensor fails on these layouts:

    * a **linear** whose input is split along a leading dim other than the first (the sequence, say)
      and along a second leading dim or the same one on another axis, on a mesh of two or more
      axes: ``F.linear`` flattens the leading dims, the split becomes a strided shard on each axis,
      and unflattening it back raises;
    * a **convolution** split along anything but its batch on one mesh axis: its convolution rule
      has no strategy for one tensor axis split over two mesh axes (the batch four ways on a 2x2
      mesh), mislabels the output of a weight split by output channels (its shape comes out wrong)
      and fails on a split of the input channels (on CPU); a spatial split needs halo rows
      from the neighbouring ranks, which DTensor does not exchange.

    * an **embedding** table split by rows (the vocabulary): DTensor's lookup makes a masked partial
      sum that it cannot combine with the other partial sums of a plan.

    Each rank then computes its block with plain tensors (:func:`compute_locally`, and for a table
    :func:`look_up_locally`). The roles, one
    per mesh axis: ``("lead", k)`` splits axis ``k`` of the input and of the output (batch,
    sequence); ``("out",)`` the output features or channels (weights split the same way);
    ``("red",)`` the summed dim (a partial sum per rank); ``("space", k, held)`` a convolution's
    output rows (``k`` = 2) or columns (3), with the input's rows split the same way (``held``: each
    rank receives its halo from its neighbours) or whole on every rank (not ``held``: a pooled map
    the op reads gathered); None: the axis replicates the op."""
    if op.kind not in ("fc", "conv", "embedding"):
        return None
    split = om.placements(mesh_shape)
    if all(d is None for d in split):
        return None
    if op.kind == "embedding":
        if "vocab" not in split:
            return None  # columns and the ids' dims: DTensor's own rule
        lead = [n for n in op.dim_names if n not in ("embed", "vocab")]
        return tuple(None if d is None else ("red",) if d == "vocab" else ("out",) if d == "embed"
                     else ("lead", lead.index(d)) for d in split)
    if op.kind == "fc":
        if "in_features" not in op.dim_names or len(mesh_shape) < 2:
            return None
        lead = [n for n in op.dim_names if n not in ("out_features", "in_features")]
        if len(lead) < 2 or not any(d in lead[1:] for d in split):
            return None
        out, red = "out_features", "in_features"
    else:
        lead = ["batch"]
        dims = [d for d in split if d is not None]
        if dims.count("batch") == len(dims) == 1:
            return None  # a batch split on one mesh axis: DTensor's own rule
        out, red = "out_channels", "in_channels"
    x_axes = op.inputs[0].axes
    roles = []
    for d in split:
        if d in SPATIAL and op.kind == "conv":
            k = SPATIAL[d]
            roles.append(("space", k, d in x_axes[k]))
        else:
            roles.append(None if d is None else ("lead", lead.index(d)) if d in lead else
                         ("out",) if d == out else ("red",) if d == red else "?")
    return None if "?" in roles else tuple(roles)


def compute_locally(sub: nn.Module, mesh: DeviceMesh, roles: tuple) -> None:
    """Run ``sub`` (a ``Linear``, GPT-2's ``Conv1D`` or a ``Conv2d``) on each rank's blocks as plain
    tensors, its output declared as the DTensor the split makes (``roles``: see :func:`local_roles`).

    Per mesh axis: a leading or spatial split keeps the output split there and leaves the weights'
    gradients partial (each rank's covers its rows); an output split keeps the output split on its
    last (a linear's) or channel (a convolution's) axis and leaves the input's gradient partial; a
    split of the summed dim leaves the output partial, with the bias added on the axis's first rank
    only (its gradient partial too). A spatial split gathers each rank's input rows with their halo
    (:func:`_spatial_rows`). The pre-hook has brought the input to the planned layout already."""
    from torch.distributed.tensor import Partial

    if isinstance(sub, nn.Embedding):
        look_up_locally(sub, mesh, roles)
        return
    forward = sub.forward
    conv = isinstance(sub, nn.Conv2d)
    spatial = _spatial_groups(sub, mesh, roles) if conv else []

    def local_forward(x, *rest):
        if not isinstance(x, DTensor):
            return forward(x, *rest)
        feat = 1 if conv else x.ndim - 1
        out_pl, x_grad, want = [], [], []
        for role in roles:
            if role is None:
                out_pl.append(Replicate())
                x_grad.append(Replicate())
                want.append(Replicate())
            elif role[0] == "lead":
                out_pl.append(Shard(role[1]))
                x_grad.append(Shard(role[1]))
                want.append(Shard(role[1]))
            elif role[0] == "space":  # held rows get their halo's gradient back; whole ones a partial one
                out_pl.append(Shard(role[1]))
                x_grad.append(Shard(role[1]) if role[2] else Partial())
                want.append(Shard(role[1]) if role[2] else Replicate())
            elif role[0] == "out":
                out_pl.append(Shard(feat))
                x_grad.append(Partial())
                want.append(Replicate())
            else:
                out_pl.append(Partial())
                x_grad.append(Shard(feat))
                want.append(Shard(feat))
        if tuple(x.placements) != tuple(want):
            x = move(x, mesh, want)
        weights = {}
        for name, w in sub.named_parameters(recurse=False):
            if not isinstance(w, DTensor):
                weights[name] = w
                continue
            grad_pl = [Partial() if r is not None and (r[0] in ("lead", "space") or (r[0] == "red" and name == "bias"))
                       else p for r, p in zip(roles, w.placements)]
            local = w.to_local(grad_placements=grad_pl)
            if name == "bias":
                red = [i for i, r in enumerate(roles) if r == ("red",)]
                if any(mesh.get_local_rank(i) != 0 for i in red):
                    local = local * 0  # the partial sums carry the bias once
            weights[name] = local
        xl, w, b = x.to_local(grad_placements=x_grad), weights["weight"], weights.get("bias")
        if conv and spatial:
            padding = list(sub.padding)
            if sub.padding_mode != "zeros":  # the input is whole on every rank: padded as the module pads it
                xl = nn.functional.pad(xl, sub._reversed_padding_repeated_twice, mode=sub.padding_mode)
                padding = [0, 0]
            for k, held, group, index, ways in spatial:
                size = tuple(x.shape)[k] if held else xl.shape[k]
                xl = _spatial_rows(xl, k, held, group, index, ways, size, _conv_geometry(sub, k, padding[k - 2]))
                padding[k - 2] = 0  # the rows gathered carry the padding
            y = nn.functional.conv2d(xl, w, b, sub.stride, tuple(padding), sub.dilation, sub.groups)
        elif conv:
            y = sub._conv_forward(xl, w, b)
        elif isinstance(sub, nn.Linear):
            y = nn.functional.linear(xl, w, b)
        else:  # GPT-2's Conv1D: weight (in, out)
            y = xl @ w if b is None else torch.addmm(b, xl.reshape(-1, xl.shape[-1]), w).view(*xl.shape[:-1], -1)
        return DTensor.from_local(y, mesh, out_pl, run_check=False)

    sub.forward = local_forward


def look_up_locally(sub: nn.Embedding, mesh: DeviceMesh, roles: tuple) -> None:
    """Run an embedding lookup on each rank's rows of the table (Megatron's vocabulary-parallel
    embedding): the ids whole along the mesh axes splitting the vocabulary (``("red",)``), each rank
    looks up the ids that fall in its rows and writes zeros for the others, and the output is a
    partial sum over those axes, reduced where the plan reduces it. The table's gradient stays
    split by rows there (each rank sees every id of its batch shard); along axes that split the
    ids (``("lead", k)``) it is partial; along an axis splitting the columns (``("out",)``) each
    rank looks up its columns."""
    from torch.distributed.tensor import Partial

    forward = sub.forward
    red = tuple(i for i, r in enumerate(roles) if r == ("red",))

    def local_forward(ids, *rest):
        if not isinstance(ids, DTensor):
            ids = DTensor.from_local(ids, mesh, [Replicate()] * mesh.ndim, run_check=False)
        want = [Shard(r[1]) if r is not None and r[0] == "lead" else Replicate() for r in roles]
        if tuple(ids.placements) != tuple(want):
            ids = move(ids, mesh, want)
        table = [Shard(0) if r == ("red",) else Shard(1) if r == ("out",) else Replicate() for r in roles]
        w = sub.weight
        if not isinstance(w, DTensor):
            return forward(ids.full_tensor(), *rest)
        if tuple(w.placements) != tuple(table):
            w = move(w, mesh, table)
        grad = [Partial() if r is not None and r[0] == "lead" else p for r, p in zip(roles, table)]
        wl = w.to_local(grad_placements=grad)
        block, index = sub.num_embeddings, 0
        for a in red:
            block //= mesh.size(a)
            index = index * mesh.size(a) + mesh.get_local_rank(a)
        local = ids.to_local() - index * block
        outside = (local < 0) | (local >= block)
        pad = sub.padding_idx
        pad = pad - index * block if pad is not None and 0 <= pad - index * block < block else None
        out = nn.functional.embedding(local.masked_fill(outside, 0), wl, pad, sub.max_norm, sub.norm_type,
                                      sub.scale_grad_by_freq, sub.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        out_pl = [Shard(r[1]) if r is not None and r[0] == "lead" else Partial() if r == ("red",)
                  else Shard(out.ndim - 1) if r == ("out",) else Replicate() for r in roles]
        return DTensor.from_local(out, mesh, out_pl, run_check=False)

    sub.forward = local_forward


def _conv_geometry(sub: nn.Conv2d, k: int, padding: int) -> tuple[int, int, int, int]:
    """(kernel, stride, padding, dilation) of ``sub`` along tensor axis ``k`` (2: rows, 3: columns)."""
    j = k - 2
    return sub.kernel_size[j], sub.stride[j], padding, sub.dilation[j]


def _spatial_groups(sub: nn.Conv2d, mesh: DeviceMesh, roles: tuple) -> list[tuple]:
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
        index, ways = 0, 1
        for a in axes:
            index, ways = index * mesh.size(a) + mesh.get_local_rank(a), ways * mesh.size(a)
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


def _spatial_rows(xl, k: int, held: bool, group, index: int, ways: int, size_in: int, geometry: tuple):
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
