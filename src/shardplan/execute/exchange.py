"""Moving a tensor between two layouts of a multi-axis mesh in one all-to-all of what each rank lacks.

DTensor changes a layout one mesh axis at a time, and a tensor dim sharded over several axes is
nested: the first axis cuts it into blocks and the next axis cuts each block. To change the outer
axis it unshards the inner ones first. So a move that needs a few rows gathers whole blocks. Two
cases from a Mixtral-8x7B-shaped plan on a 2x4 mesh (`docs/runtime.md`, *At scale*), each rank's
tile 1/8 of a 268 MB activation:

* batch split 4 ways over axis 1 -> batch split 8 ways over both axes: 7 ranks of 8 lack one
  sample (33.5 MB), and DTensor all-gathers the tensor over axis 1 (201 MB into each rank);
* hidden split 8 ways over both axes -> batch split 8 ways over both: DTensor all-gathers over
  axis 1 and then runs an all-to-all over axis 0 on the gathered half.

Here the move is one exchange: every rank works out, from the two layouts alone, which box of the
tensor each rank of the group holds and needs, and sends each rank the part of its tile that the
rank lacks (c10d's ``all_to_all_single``), so a rank receives ``|needed tile| - |overlap with its
own tile|`` elements, the bytes the cost model's edge rule counts (``cost.pase.redistribution_words``,
when the mesh's order lets the tiles overlap). Where several ranks hold a box (a replicated axis),
the holder sharing the most mesh coordinates with the receiver sends it. The gradient goes back
by the reverse exchange: every rank holding a box of the source layout gets that box's gradient,
as DTensor's replicated gradients are whole on every replica.

It applies to moves between layouts of whole shards and replicas (no ``Partial`` sums: those are
reductions, left to DTensor) where some tensor dim is split over two or more mesh axes; the
one-axis moves, which DTensor does with one collective, stay DTensor's. The group is the mesh axes
whose placement changes, and the axes nested with them (``involved_axes``); boxes come from
DTensor's own ``_compute_local_shape_and_global_offset``, so uneven splits lie as DTensor lays them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

Box = tuple[tuple[int, int], ...]
"""A block of a tensor: (start, stop) per dim."""


def applies(src, dst) -> bool:
    """Whether the move from placements ``src`` to ``dst`` is made by :func:`exchange`: both are
    plain shards and replicas, they differ, and some tensor dim is split over two or more mesh axes
    in one of them (a nested split, which DTensor unshards axis by axis)."""
    src, dst = tuple(src), tuple(dst)
    plain = all(type(p) is Shard or isinstance(p, Replicate) for p in src + dst)
    if not plain or src == dst:
        return False
    return any(_nested(pl) for pl in (src, dst))


def _nested(placements) -> bool:
    dims = [p.dim for p in placements if isinstance(p, Shard)]
    return len(dims) != len(set(dims))


def involved_axes(src, dst) -> tuple[int, ...]:
    """Mesh axes the exchange spans: those whose placement changes, and every axis sharding a tensor
    dim that an involved axis shards (nested with it), in either layout. On the other axes both
    layouts agree and cut dims no involved axis touches, so each group's ranks hold, between them,
    everything their new tiles need."""
    axes = {i for i, (p, q) in enumerate(zip(src, dst)) if p != q}
    while True:
        dims = {p.dim for pl in (src, dst) for i, p in enumerate(pl) if i in axes and isinstance(p, Shard)}
        more = {i for pl in (src, dst) for i, p in enumerate(pl) if isinstance(p, Shard) and p.dim in dims}
        if more <= axes:
            return tuple(sorted(axes))
        axes |= more


def tile(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements) -> Box:
    """The box of a tensor of ``shape`` the rank at ``coordinate`` holds under ``placements``, as
    DTensor lays it (nested splits, uneven ones included)."""
    return _tile(tuple(shape), tuple(mesh_shape), tuple(coordinate), tuple(placements))


@functools.lru_cache(maxsize=65536)
def _tile(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple) -> Box:
    """:func:`tile`, memoized: every route and every dry run's count of what ranks lack asks for
    the same tiles of every rank again."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    with unset_fake_temporarily():  # plain integers, even inside a dry run's fake tensors
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate),
                                                               list(placements))
    return tuple((int(o), int(o) + int(n)) for o, n in zip(offset, local))


def _meet(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _volume(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def _within(box: Box, origin: Box) -> tuple[slice, ...]:
    """``box`` as slices of the local tensor holding ``origin``."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


@dataclass(frozen=True)
class Route:
    """One rank's part of an exchange: per rank of the group (in group order) the box of this rank's
    source tile it sends there and the box of its target tile it receives from there (None: no
    bytes), the boxes it copies from its own tile, and its target tile's shape."""

    send: tuple[Box | None, ...]
    recv: tuple[Box | None, ...]
    keep: tuple[Box, ...]
    source: Box
    target: Box
    quiet: bool
    """No rank of the group lacks anything: no collective at all (every rank of the group knows)."""

    @property
    def received(self) -> int:
        """Elements this rank receives."""
        return sum(_volume(b) for b in self.recv if b is not None)

    def run(self, x: torch.Tensor, group) -> torch.Tensor:
        """Exchange ``x`` (this rank's source tile) into its target tile (no autograd)."""
        out = x.new_empty(tuple(hi - lo for lo, hi in self.target))
        for box in self.keep:
            out[_within(box, self.target)] = x[_within(box, self.source)]
        if self.quiet:
            return out
        send_counts = [0 if b is None else _volume(b) for b in self.send]
        recv_counts = [0 if b is None else _volume(b) for b in self.recv]
        parts = [x[_within(b, self.source)].reshape(-1) for b in self.send if b is not None]
        send = torch.cat(parts) if parts else x.new_empty(0)
        got = x.new_empty(sum(recv_counts))
        dist.all_to_all_single(got, send, recv_counts, send_counts, group=group)
        at = 0
        for box, n in zip(self.recv, recv_counts):
            if box is not None:
                out[_within(box, self.target)] = got[at:at + n].view(tuple(hi - lo for lo, hi in box))
                at += n
        return out


@functools.lru_cache(maxsize=4096)
def route(shape: tuple[int, ...], mesh_shape: tuple[int, ...], me: tuple[int, ...], src: tuple, dst: tuple) -> Route:
    """The exchange from ``src`` to ``dst`` placements as the rank at mesh coordinate ``me`` takes
    part in it, over the group of :func:`involved_axes` (ranks in row-major order of those axes'
    coordinates, the order of :func:`mesh_group`). Every rank of the group computes the same
    plan, so sends and receives agree without a word exchanged."""
    axes = involved_axes(src, dst)
    members = [tuple(c[axes.index(a)] if a in axes else me[a] for a in range(len(mesh_shape)))
               for c in itertools.product(*(range(mesh_shape[a]) for a in axes))]
    have = [tile(shape, mesh_shape, c, src) for c in members]
    need = [tile(shape, mesh_shape, c, dst) for c in members]
    holders: dict[Box, list[int]] = {}
    for i, box in enumerate(have):
        holders.setdefault(box, []).append(i)

    def sender(d: int, box: Box) -> int:  # the holder nearest the receiver on the mesh, then the first
        return min(holders[box], key=lambda h: (sum(x != y for x, y in zip(members[h], members[d])), h))

    i = members.index(me)
    send: list[Box | None] = [None] * len(members)
    recv: list[Box | None] = [None] * len(members)
    keep = []
    for box in holders:
        part = _meet(box, need[i])
        if part is None:
            continue
        if have[i] == box:
            keep.append(part)
        else:
            recv[sender(i, box)] = part
    for d in range(len(members)):
        part = _meet(have[i], need[d])
        if d != i and part is not None and have[d] != have[i] and sender(d, have[i]) == i:
            send[d] = part
    quiet = all(_meet(h, n) == n for h, n in zip(have, need))
    route = Route(tuple(send), tuple(recv), tuple(keep), have[i], need[i], quiet)
    if sum(_volume(b) for b in keep) + route.received != _volume(need[i]):
        raise AssertionError(f"exchange {src} -> {dst} of {shape} on mesh {mesh_shape}: rank {me}'s tile "
                             f"is not covered exactly once")
    return route


def lacking(shape: tuple[int, ...], mesh_shape: tuple[int, ...], src, dst) -> list[int]:
    """Elements each rank of the mesh (row-major) lacks of its ``dst`` tile in its ``src`` tile: what
    :func:`exchange` sends it."""
    out = []
    for c in itertools.product(*map(range, mesh_shape)):
        have, need = tile(shape, mesh_shape, c, src), tile(shape, mesh_shape, c, dst)
        common = _meet(have, need)
        out.append(_volume(need) - (0 if common is None else _volume(common)))
    return out


def exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows of ``x`` (its dim 0) sent ``send[r]`` to rank ``r`` of ``group``, ``recv[r]`` received
    from it, in rank order (c10d's ``all_to_all_single``, no autograd)."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def block_index(mesh: DeviceMesh, axes: tuple[int, ...]) -> tuple[int, int]:
    """(this rank's block, the number of blocks) of a dim split over mesh ``axes``: the row-major
    order of its coordinates there, which is DTensor's nesting of the blocks and the rank order of
    :func:`mesh_group`."""
    index, ways = 0, 1
    for a in axes:
        index, ways = index * mesh.size(a) + mesh.get_local_rank(a), ways * mesh.size(a)
    return index, ways


def mesh_group(mesh: DeviceMesh, axes: tuple[int, ...]):
    """This rank's process group over mesh ``axes`` (ranks in row-major order of their coordinates
    there): the mesh's own for one axis; for several, made once per mesh, by every rank in the same
    order, with ``new_subgroups_by_enumeration`` (groups of every fixed coordinate of the others)."""
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    made = mesh.__dict__.setdefault("_shardplan_groups", {})
    key = (axes, dist.distributed_c10d._get_default_group())  # a mesh object may outlive its world (tests)
    if key not in made:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        shape = tuple(mesh.mesh.shape)
        others = [a for a in range(len(shape)) if a not in axes]
        lists = []
        with unset_fake_temporarily():  # the mesh's rank table read as integers, even in a dry run
            table = mesh.mesh.tolist()
        for fixed in itertools.product(*(range(shape[a]) for a in others)):
            at = dict(zip(others, fixed))
            lists.append([_at(table, tuple(at.get(a, c) for a, c in enumerate(cs))) for cs in _coords(shape, axes)])
        made[key], _ = dist.new_subgroups_by_enumeration(lists)
    return made[key]


def _at(table, coordinate: tuple[int, ...]) -> int:
    for c in coordinate:
        table = table[c]
    return int(table)


def _coords(shape: tuple[int, ...], axes: tuple[int, ...]):
    """Coordinates over ``axes`` (every other axis 0), in row-major order."""
    for cs in itertools.product(*(range(shape[a]) for a in axes)):
        full = [0] * len(shape)
        for a, c in zip(axes, cs):
            full[a] = c
        yield tuple(full)


@dataclass(frozen=True)
class Move:
    """One exchange as every rank of the mesh makes it: ``busiest_bytes`` is the most any rank
    receives, ``group`` the ranks it spans."""

    shape: tuple[int, ...]
    src: tuple
    dst: tuple
    busiest_bytes: int
    group: int


_SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("shardplan_exchanges", default=None)


@contextlib.contextmanager
def watch():
    """Within the block, every exchange made (either way) is listed in the list it yields."""
    seen: list[Move] = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def _note(shape, itemsize: int, mesh_shape, src, dst) -> None:
    seen = _SEEN.get()
    if seen is not None:
        group = math.prod(mesh_shape[a] for a in involved_axes(src, dst))
        seen.append(Move(shape, src, dst, max(lacking(shape, mesh_shape, src, dst)) * itemsize, group))


class _Exchange(torch.autograd.Function):
    """A local tile through an exchange; backward sends the gradient back by the reverse one."""

    @staticmethod
    def forward(ctx, x, there: Route, back: Route, group, note):
        ctx.back, ctx.group, ctx.note = back, group, note
        return there.run(x, group)

    @staticmethod
    def backward(ctx, grad):
        shape, itemsize, mesh_shape, src, dst = ctx.note
        _note(shape, itemsize, mesh_shape, dst, src)
        return ctx.back.run(grad, ctx.group), None, None, None, None


def exchange(x: DTensor, mesh: DeviceMesh, target) -> DTensor:
    """``x`` laid out as ``target`` by one exchange of what each rank lacks (the module doc);
    differentiable. Use it where :func:`applies` says."""
    src, dst = tuple(x.placements), tuple(target)
    shape, mesh_shape = tuple(int(n) for n in x.shape), tuple(int(n) for n in mesh.mesh.shape)
    me = tuple(int(c) for c in mesh.get_coordinate())
    axes = involved_axes(src, dst)
    group = mesh_group(mesh, axes)
    note = (shape, x.element_size(), mesh_shape, src, dst)
    _note(*note)
    local = _Exchange.apply(x.to_local(), route(shape, mesh_shape, me, src, dst),
                            route(shape, mesh_shape, me, dst, src), group, note)
    return DTensor.from_local(local, mesh, dst, run_check=False, shape=x.shape, stride=x.stride())


def move(x: DTensor, mesh: DeviceMesh, target) -> DTensor:
    """``x`` redistributed to ``target``: by :func:`exchange` where it applies, else by DTensor."""
    if applies(x.placements, target):
        return exchange(x, mesh, target)
    return x.redistribute(mesh, target)
