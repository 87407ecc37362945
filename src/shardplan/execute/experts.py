"""Expert parallelism at run time: a routed-experts module (transformers' ``...Experts``: a
``num_experts`` count and 3-D weights with a leading experts axis, called as ``experts(hidden,
top_k_index, top_k_weights)``) made to compute only this rank's experts.

A fused mixture-of-experts op (``capture.moe``) splits its experts two ways, which a plan may mix:

* ``experts`` over mesh axes A: the block's tokens are whole over A (the planned layout gathered
  them), each rank runs its own experts on the (token, choice) rows routed to them and its output
  is a partial sum that ``execute.local.run_locally`` all-reduces over A. Only those rows enter
  the experts' module: handed every row with other ranks' choices marked (an id past the local
  experts), transformers' grouped implementation skips their products but still runs the
  activation, masking and copies over all of them, 2x the pointwise work on 2 ranks.
* ``experts_a2a`` over mesh axes B: each rank of B holds its own tokens. Every (token, choice) row is
  sent to the rank of B holding that expert (an all-to-all of rows, with the expert's local id
  alongside), the expert runs there with weight 1, the rows come back by the reverse all-to-all and
  are weighted by the router and summed into their tokens here (GShard's dispatch and combine,
  Lepikhin et al. 2021). c10d's ``all_to_all_single`` carries the row counts, the ids and the
  rows (:class:`_AllToAll`: the backward pass sends the rows' gradients back the same way); on gloo
  it costs 80-120 us for a small message where the functional collective costs 240-300 us. No capacity limit: no row is dropped, so
  the result is the single-device block's, up to the order of floating-point additions.

A rank's experts are a block of ``count`` consecutive ids, ``first = block x count``, where the
block is the rank's coordinate over the mesh axes sharding the weights' leading axis (A and B, in
mesh order, as DTensor shards one tensor axis over several mesh axes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardplan.execute.apply import ApplyError
from shardplan.execute.exchange import exchange_rows, mesh_group


def split_experts(experts: nn.Module, fqn: str, weight, mesh: DeviceMesh, a2a_axes: tuple[int, ...] = ()) -> None:
    """Make ``experts`` (module ``fqn``, its leading-axis weight ``weight`` already distributed as the
    plan says) compute only this rank's experts; with ``a2a_axes`` its tokens travel to their experts
    by all-to-all over those mesh axes (the module doc). After each call, ``experts.last_rows`` is the
    number of (token, choice) rows this rank's experts ran (the load ``cost.routing`` prices)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not hasattr(experts, "num_experts"):
        raise ApplyError(f"module {fqn!r} ({type(experts).__name__}) holds the experts but has no "
                         f"num_experts; shardplan splits transformers' experts modules only")
    with unset_fake_temporarily():  # plain integers even in a dry run's fake tensors (execute.dryrun)
        local_shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh,
                                                                    weight.placements)
        first, count = int(offset[0]), int(local_shape[0])
        total = int(weight.shape[0])
        sharding = tuple(i for i, p in enumerate(weight.placements) if isinstance(p, Shard) and p.dim == 0)
        route = _routes(mesh, sharding, a2a_axes, total, count, first) if a2a_axes else None
    forward = experts.forward
    experts.num_experts = count
    experts._is_expert_parallel = True
    if route is None:
        def ep_forward(hidden_states, top_k_index, top_k_weights):
            return _local(experts, forward, first, count, total, hidden_states, top_k_index, top_k_weights)
        experts.forward = ep_forward
        return
    group, dest, size = route

    def a2a_forward(hidden_states, top_k_index, top_k_weights):
        return _dispatch(experts, forward, group, size, dest, count, hidden_states, top_k_index, top_k_weights)
    experts.forward = a2a_forward


def _rows(experts, forward, rows: torch.Tensor, ids: torch.Tensor, dtype) -> torch.Tensor:
    """Each row through its own (local) expert, unweighted: ``forward`` with one choice per row."""
    done = forward(rows, ids[:, None], torch.ones(len(ids), 1, dtype=dtype, device=rows.device))
    return _touched(experts, done)


def _combine(hidden, token: torch.Tensor, done: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The rows' outputs weighted by the router and summed into their tokens (``token``: each row's)."""
    return torch.zeros_like(hidden).index_add(0, token, (done * weights[:, None]).to(hidden.dtype))


def _local(experts, forward, first: int, count: int, total: int, hidden, top_k_index, top_k_weights):
    """One routed-experts call on the rows of this rank's experts only (gathered tokens: the other
    rows are other ranks' partial sums). In a dry run's fake tensors uniform routing is assumed."""
    from torch._subclasses.fake_tensor import is_fake

    tokens, k = top_k_index.shape
    choice = top_k_index.reshape(-1)
    token = torch.arange(tokens, device=hidden.device).repeat_interleave(k)
    if is_fake(hidden):
        order = torch.arange(tokens * k * count // total, device=hidden.device)
    else:
        order = ((choice >= first) & (choice < first + count)).nonzero().squeeze(1)
    experts.last_rows = len(order)
    done = _rows(experts, forward, hidden[token[order]], choice[order] - first, top_k_weights.dtype)
    return _combine(hidden, token[order], done, top_k_weights.reshape(-1)[order])


def _touched(experts: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """``out`` plus zero times one element of each of the experts' weights: a rank whose experts got
    no row this step still gives each weight a gradient (zeros), so every rank reduces the same
    gradients afterwards (``execute.gradients``)."""
    for p in experts.parameters(recurse=False):
        out = out + 0.0 * p.reshape(-1)[0].to(out.dtype)
    return out


def _routes(mesh: DeviceMesh, sharding: tuple[int, ...], a2a_axes: tuple[int, ...], total: int, count: int,
            first: int):
    """(process group over ``a2a_axes``, owner's rank in it per expert id or -1 for an expert held
    outside the group, the group's size). Every rank calls this, in the same order (a group over
    several mesh axes is made with ``new_subgroups_by_enumeration``)."""
    if any(a not in sharding for a in a2a_axes):
        raise ApplyError(f"the experts' weights are not sharded over mesh axes {a2a_axes} that send their "
                         f"tokens by all-to-all (sharded over {sharding})")
    shape = tuple(mesh.mesh.shape)
    me = tuple(int(c) for c in mesh.get_coordinate())
    sizes = [shape[a] for a in sharding]
    block = 0
    for a in sharding:
        block = block * shape[a] + me[a]
    if block * count != first:
        raise ApplyError(f"expert range of this rank: DTensor says from {first}, the mesh coordinate "
                         f"{me} gives {block * count}")

    def coordinate(b: int) -> dict[int, int]:  # the block's coordinate over the sharding axes
        out = {}
        for a, s in zip(reversed(sharding), reversed(sizes)):
            out[a] = b % s
            b //= s
        return out

    group = mesh_group(mesh, a2a_axes)
    dest = []
    for x in range(total):
        owner = coordinate(x // count)
        if any(owner[a] != me[a] for a in sharding if a not in a2a_axes):
            dest.append(-1)  # a gathered split's other group holds it: its partial sum comes from there
            continue
        rank = int(mesh.mesh[tuple(owner.get(a, me[a]) for a in range(len(shape)))])
        dest.append(dist.get_group_rank(group, rank))
    return group, tuple(dest), dist.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    """c10d's ``all_to_all_single`` of rows with autograd: ``send[r]`` rows of ``x`` go to rank ``r``
    of ``group``, ``recv[r]`` come from it; backward sends the gradient rows back the same way."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.splits, ctx.group = (send, recv), group
        return exchange_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return exchange_rows(grad, recv, send, ctx.group), None, None, None


def _dispatch(experts, forward, group, size: int, dest: tuple[int, ...], count: int, hidden, top_k_index,
              top_k_weights):
    """One routed-experts call with its rows sent to their experts' ranks and back (the module doc).
    In a dry run's fake tensors the row counts are unknown, so uniform routing is assumed, which is
    what the cost model prices."""
    from torch._subclasses.fake_tensor import is_fake

    tokens, k = top_k_index.shape
    choice = top_k_index.reshape(-1)
    token = torch.arange(tokens, device=hidden.device).repeat_interleave(k)
    if is_fake(hidden):  # no values: uniform routing, the choices this group's experts take split evenly
        mine = tokens * k * sum(d >= 0 for d in dest) // len(dest)
        order = torch.arange(mine, device=hidden.device)
        send = [mine // size + (1 if r < mine % size else 0) for r in range(size)]
        recv = list(send)
        exchange_rows(torch.tensor(send, device=hidden.device), [1] * size, [1] * size, group)  # as a real step
    else:
        to = torch.tensor(dest, dtype=torch.int64, device=choice.device)[choice]
        kept = (to >= 0).nonzero().squeeze(1)
        order = kept[torch.argsort(to[kept], stable=True)]
        counts = torch.bincount(to[order], minlength=size)
        got = exchange_rows(counts, [1] * size, [1] * size, group)  # how many rows each peer sends
        send, recv = counts.tolist(), got.tolist()
    ids = exchange_rows(choice[order] % count, send, recv, group)  # the experts' local ids
    rows = _AllToAll.apply(hidden[token[order]], send, recv, group)
    experts.last_rows = len(rows)
    done = _rows(experts, forward, rows, ids, top_k_weights.dtype)
    back = _AllToAll.apply(done, recv, send, group)
    return _combine(hidden, token[order], back, top_k_weights.reshape(-1)[order])
