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
from shardplan.execute.exchange import move
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

    Two layouts fail there in torch 2.13 on a mesh of two or more axes:

    * a **linear** whose input is split along a leading dim other than the first (the sequence, say)
      and along a second leading dim or the same one on another axis: ``F.linear`` flattens the
      leading dims, the split becomes a strided shard on each axis, and unflattening it back raises;
    * a **convolution** with one tensor axis split over two mesh axes (the batch four ways on a 2x2
      mesh): DTensor's convolution rule has no such strategy.

    Both are products whose every mesh axis splits one kind of dim, so each rank can compute its
    block with plain tensors (:func:`compute_locally`). The roles, one per mesh axis: ``("lead",
    k)`` splits axis ``k`` of the input and of the output (batch, sequence); ``("out",)`` the output
    features or channels (weights split the same way); ``("red",)`` the summed dim (a partial sum
    per rank); None: the axis replicates the op."""
    if op.kind not in ("fc", "conv") or len(mesh_shape) < 2:
        return None
    split = om.placements(mesh_shape)
    if all(d is None for d in split):
        return None
    if op.kind == "fc":
        if "in_features" not in op.dim_names:
            return None
        lead = [n for n in op.dim_names if n not in ("out_features", "in_features")]
        if len(lead) < 2 or not any(d in lead[1:] for d in split):
            return None
        out, red = "out_features", "in_features"
    else:
        lead = ["batch"]
        dims = [d for d in split if d is not None]
        if len(dims) == len(set(dims)) or any(d not in ("batch", "out_channels", "in_channels") for d in dims):
            return None
        out, red = "out_channels", "in_channels"
    roles = []
    for d in split:
        roles.append(None if d is None else ("lead", lead.index(d)) if d in lead else
                     ("out",) if d == out else ("red",) if d == red else "?")
    return None if "?" in roles else tuple(roles)


def compute_locally(sub: nn.Module, mesh: DeviceMesh, roles: tuple) -> None:
    """Run ``sub`` (a ``Linear``, GPT-2's ``Conv1D`` or a ``Conv2d``) on each rank's blocks as plain
    tensors, its output declared as the DTensor the split makes (``roles``: see :func:`local_roles`).

    Per mesh axis: a leading split keeps the output split there and leaves the weights' gradients
    partial (each rank's covers its rows); an output split keeps the output split on its last (a
    linear's) or channel (a convolution's) axis and leaves the input's gradient partial; a split of
    the summed dim leaves the output partial, with the bias added on the axis's first rank only (its
    gradient partial too). The pre-hook has brought the input to the planned layout already."""
    from torch.distributed.tensor import Partial

    forward = sub.forward
    conv = isinstance(sub, nn.Conv2d)

    def local_forward(x, *rest):
        if not isinstance(x, DTensor):
            return forward(x, *rest)
        feat = 1 if conv else x.ndim - 1
        out_pl, x_grad = [], []
        for i, role in enumerate(roles):
            if role is None:
                out_pl.append(Replicate())
                x_grad.append(Replicate())
            elif role[0] == "lead":
                out_pl.append(Shard(role[1]))
                x_grad.append(Shard(role[1]))
            elif role[0] == "out":
                out_pl.append(Shard(feat))
                x_grad.append(Partial())
            else:
                out_pl.append(Partial())
                x_grad.append(Shard(feat))
        want = [p if not isinstance(p, Partial) else Replicate() for p in x_grad]
        want = [Replicate() if r is not None and r[0] == "out" else w for r, w in zip(roles, want)]
        if tuple(x.placements) != tuple(want):
            x = move(x, mesh, want)
        weights = {}
        for name, w in sub.named_parameters(recurse=False):
            if not isinstance(w, DTensor):
                weights[name] = w
                continue
            grad_pl = [Partial() if r is not None and (r[0] == "lead" or (r[0] == "red" and name == "bias")) else p
                       for r, p in zip(roles, w.placements)]
            local = w.to_local(grad_placements=grad_pl)
            if name == "bias":
                red = [i for i, r in enumerate(roles) if r == ("red",)]
                if any(mesh.get_local_rank(i) != 0 for i in red):
                    local = local * 0  # the partial sums carry the bias once
            weights[name] = local
        xl, w, b = x.to_local(grad_placements=x_grad), weights["weight"], weights.get("bias")
        if conv:
            y = sub._conv_forward(xl, w, b)
        elif isinstance(sub, nn.Linear):
            y = nn.functional.linear(xl, w, b)
        else:  # GPT-2's Conv1D: weight (in, out)
            y = xl @ w if b is None else torch.addmm(b, xl.reshape(-1, xl.shape[-1]), w).view(*xl.shape[:-1], -1)
        return DTensor.from_local(y, mesh, out_pl, run_check=False)

    sub.forward = local_forward
