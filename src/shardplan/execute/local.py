"""Modules computed on each rank's blocks as plain tensors, their outputs and gradients declared as
the DTensors the plan's split makes: where torch 2.13's DTensor has no rule (LSTMs, mixture-of-experts
blocks: :func:`run_locally`) or gets the split wrong (linears on a mesh of two or more axes,
convolutions split by anything but the batch, embedding tables split by rows: :func:`local_roles`,
:func:`compute_locally`, :func:`look_up_locally`; a convolution's halo is ``execute.spatial``'s).
``execute.apply`` installs them."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardplan.cluster.mesh import OpMesh
from shardplan.execute.exchange import block_index, move
from shardplan.execute.spatial import SPATIAL, conv_geometry, spatial_groups, spatial_rows
from shardplan.ir.graph import Op


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
    (``execute.spatial``). The pre-hook has brought the input to the planned layout already."""
    from torch.distributed.tensor import Partial

    if isinstance(sub, nn.Embedding):
        look_up_locally(sub, mesh, roles)
        return
    forward = sub.forward
    conv = isinstance(sub, nn.Conv2d)
    spatial = spatial_groups(sub, mesh, roles) if conv else []

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
                xl = spatial_rows(xl, k, held, group, index, ways, size, conv_geometry(sub, k, padding[k - 2]))
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
        index, ways = block_index(mesh, red)
        block = sub.num_embeddings // ways
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
