"""Modules computed on each rank's blocks as plain tensors, their outputs and gradients declared as
the DTensors the plan's split makes: where torch 2.13's DTensor has no rule (LSTMs, mixture-of-experts
blocks: :func:`run_locally`) or refuses the split on a mesh of two or more axes (linears and
convolutions: :func:`local_roles`, :func:`compute_locally`). ``execute.apply`` installs them."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

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

    Each rank then computes its block with plain tensors (:func:`compute_locally`). The roles, one
    per mesh axis: ``("lead", k)`` splits axis ``k`` of the input and of the output (batch,
    sequence); ``("out",)`` the output features or channels (weights split the same way);
    ``("red",)`` the summed dim (a partial sum per rank); ``("space", k, held)`` a convolution's
    output rows (``k`` = 2) or columns (3), with the input's rows split the same way (``held``: each
    rank receives its halo from its neighbours) or whole on every rank (not ``held``: a pooled map
    the op reads gathered); None: the axis replicates the op."""
    if op.kind not in ("fc", "conv"):
        return None
    split = om.placements(mesh_shape)
    if all(d is None for d in split):
        return None
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
            for k, held, group, index, ways in spatial:
                xl = _spatial_rows(xl, k, held, group, index, ways, tuple(x.shape)[k], _conv_geometry(sub, k))
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


def _conv_geometry(sub: nn.Conv2d, k: int) -> tuple[int, int, int, int]:
    """(kernel, stride, padding, dilation) of ``sub`` along tensor axis ``k`` (2: rows, 3: columns)."""
    j = k - 2
    return sub.kernel_size[j], sub.stride[j], sub.padding[j], sub.dilation[j]


def _spatial_groups(sub: nn.Conv2d, mesh: DeviceMesh, roles: tuple) -> list[tuple]:
    """Per spatially split tensor axis ``k``: (k, held, process group over the mesh axes splitting
    it, this rank's block index there, the number of blocks). The group is made here, when the plan
    is applied, by every rank in the same order (``exchange.mesh_group``); its ranks are in the
    row-major order of their coordinates, which is the order of DTensor's blocks of a dim split over
    several mesh axes."""
    if isinstance(sub.padding, str) or sub.padding_mode != "zeros":
        raise ValueError(f"a spatial split of a convolution needs numeric zero padding; this one has "
                         f"padding={sub.padding!r}, padding_mode={sub.padding_mode!r}")
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
    """[first, stop) of the input rows block ``index`` of ``ways`` output blocks reads, in the input's
    coordinates (below 0 or from ``size_in`` on: padding): output row ``o`` reads rows ``o s - p`` to
    ``o s - p + d (r - 1)`` (kernel ``r``, stride ``s``, padding ``p``, dilation ``d``)."""
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
        rows = _Rows.apply(xl, k, tuple(send), tuple(recv), group)
    pads = [0, 0] * (xl.ndim - 1 - k) + [lo - first, stop - hi]
    return nn.functional.pad(rows, pads) if any(pads) else rows


class _Rows(torch.autograd.Function):
    """Rows along axis ``k`` gathered from a group's blocks by c10d's ``all_to_all_single``:
    ``send[q]`` is the [start, stop) of this rank's block going to rank ``q``, ``recv[q]`` how many
    rows come from it (in rank order, so the result is contiguous). Backward sends each row's
    gradient back to its owner, which adds up what it gets for every copy it sent."""

    @staticmethod
    def forward(ctx, x, k: int, send: tuple, recv: tuple, group):
        ctx.k, ctx.send, ctx.recv, ctx.group, ctx.shape = k, send, recv, group, x.shape
        rows = x.movedim(k, 0)
        out = torch.cat([rows[a:b] for a, b in send])
        return exchange_rows(out, [b - a for a, b in send], list(recv), group).movedim(0, k).contiguous()

    @staticmethod
    def backward(ctx, grad):
        back = exchange_rows(grad.movedim(ctx.k, 0), list(ctx.recv), [b - a for a, b in ctx.send], ctx.group)
        out = back.new_zeros(ctx.shape).movedim(ctx.k, 0)
        at = 0
        for a, b in ctx.send:
            out[a:b] += back[at:at + b - a]
            at += b - a
        return out.movedim(0, ctx.k), None, None, None, None
