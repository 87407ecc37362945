"""The mesh view of a plan: a logical device mesh and, per op, which mesh axes split which dim.

DTensor runs a tensor on a ``DeviceMesh`` with one placement per mesh axis (``Shard(d)``,
``Replicate()``, ``Partial()``). A configuration maps onto a mesh when every split factor is the
product of a set of mesh axes, no axis used twice. The mesh of p's prime factors (64 -> 2x2x2x2x2x2)
takes every configuration whose product divides p, so ``default_mesh`` always works; a coarser mesh
(64 -> 8x8, the last axis inside a node) is nicer to read and is checked op by op.

Axes are assigned innermost (last mesh axis, contiguous ranks) first to the op's non-batch dims,
matching the rank order the analytic cost model prices.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from shardplan.ir.graph import DimKind, Op


class MeshError(ValueError):
    """A configuration that cannot be laid on the given mesh; the message names the op."""


def prime_factors(n: int) -> list[int]:
    out, f = [], 2
    while f * f <= n:
        while n % f == 0:
            out.append(f)
            n //= f
        f += 1
    if n > 1:
        out.append(n)
    return out


def default_mesh(devices: int) -> tuple[int, ...]:
    return tuple(sorted(prime_factors(devices), reverse=True)) or (1,)


MAX_MESH_AXES = 4
"""The most mesh axes the runtime lays a plan on while a coarser mesh fits it
(``execute.apply.choose_mesh``), and the most ``candidate_meshes`` proposes: DTensor's sharding
propagation enumerates its strategies on every mesh axis, so its time grows as strategies ** axes
(a linear of a 64-rank Llama plan took 50 s to plan on the 6-axis mesh of 64's primes, torch 2.13)."""


def factorizations(p: int, axes: int) -> list[tuple[int, ...]]:
    """Every ordered ``axes``-tuple of factors of at least 2 whose product is ``p``."""
    if axes == 1:
        return [(p,)] if p >= 2 else []
    return [(a,) + rest for a in range(2, p) if p % a == 0 for rest in factorizations(p // a, axes - 1)]


def candidate_meshes(devices: int, max_axes: int = MAX_MESH_AXES) -> list[tuple[int, ...]]:
    """Every mesh of ``devices`` with at most ``max_axes`` axes of two or more devices each, in every
    order (the order decides which dims take the inner axes): what ``--mesh auto`` tries."""
    if devices == 1:
        return [(1,)]
    return [m for axes in range(1, max_axes + 1) for m in factorizations(devices, axes)]


@dataclass(frozen=True)
class OpMesh:
    """Mesh axes (indices into the mesh shape) splitting each dim of one op."""

    op: str
    axes: tuple[tuple[str, tuple[int, ...]], ...]

    def placements(self, mesh: tuple[int, ...]) -> list[str | None]:
        """Per mesh axis: the dim it splits, or None (replicated along that axis)."""
        out: list[str | None] = [None] * len(mesh)
        for dim, idx in self.axes:
            for a in idx:
                out[a] = dim
        return out


@functools.lru_cache(maxsize=65536)
def mesh_axes(batch: tuple[bool, ...], config: tuple[int, ...], mesh: tuple[int, ...]) -> tuple | None:
    """Mesh axes of each dim (empty when unsplit), for dims whose batch flags are ``batch``; None when
    the configuration does not fit. Non-batch dims first, each taking the innermost free axes whose
    sizes multiply to its factor; the batch dims after them."""
    order = [i for i, b in enumerate(batch) if not b] + [i for i, b in enumerate(batch) if b]
    wanted = [(i, int(config[i])) for i in order if config[i] > 1]
    free = list(range(len(mesh)))[::-1]  # innermost axis first

    def search(k: int, free: list[int]) -> list[tuple[int, ...]] | None:
        if k == len(wanted):
            return []
        _, factor = wanted[k]
        for r in range(1, len(free) + 1):
            for combo in itertools.combinations(free, r):
                prod = 1
                for a in combo:
                    prod *= mesh[a]
                if prod == factor:
                    rest = search(k + 1, [a for a in free if a not in combo])
                    if rest is not None:
                        return [tuple(sorted(combo))] + rest
        return None

    found = search(0, free)
    if found is None:
        return None
    out: list[tuple[int, ...]] = [()] * len(batch)
    for (i, _), axes in zip(wanted, found):
        out[i] = axes
    return tuple(out)


def assign(op: Op, config: tuple[int, ...], mesh: tuple[int, ...]) -> OpMesh:
    """Mesh axes for each split dim of ``op`` under ``config``; MeshError when it does not fit."""
    batch = tuple(d.kind is DimKind.BATCH for d in op.dims)
    found = mesh_axes(batch, tuple(int(f) for f in config), tuple(mesh))
    split = [i for b in (False, True) for i, d in enumerate(batch) if d is b and config[i] > 1]  # axes order
    if found is None:
        splits = ", ".join(f"{op.dims[i].name}={config[i]}" for i in split)
        raise MeshError(f"op {op.name!r}: split {splits} does not map onto mesh {'x'.join(map(str, mesh))}")
    return OpMesh(op.name, tuple((op.dims[i].name, found[i]) for i in split))


def placed_layouts(op: Op, configs: np.ndarray, axes: tuple[tuple[str, ...], ...],
                   mesh: tuple[int, ...]) -> np.ndarray:
    """Where every configuration puts one operand on ``mesh``: shape ``(K, n + m)`` for a tensor of
    ``n`` axes on ``m`` mesh axes; the first ``n`` columns are the split factors
    (``cost.configs.operand_layouts``), the last ``m`` the tensor axis each mesh axis splits (-1:
    replicated along it). Two configurations with equal rows leave every rank the same block."""
    batch = tuple(d.kind is DimKind.BATCH for d in op.dims)
    tensor_axis = [next((t for t, names in enumerate(axes) if d.name in names), -1) for d in op.dims]
    n, m = len(axes), len(mesh)
    out = np.empty((len(configs), n + m), dtype=np.int64)
    for k, config in enumerate(configs):
        found = mesh_axes(batch, tuple(int(f) for f in config), tuple(mesh))
        if found is None:
            raise MeshError(f"op {op.name!r}: configuration {tuple(int(f) for f in config)} does not map onto "
                            f"mesh {'x'.join(map(str, mesh))}")
        row = [1] * n + [-1] * m
        for dim, dim_axes in enumerate(found):
            for a in dim_axes:
                t = tensor_axis[dim]
                row[n + a] = t
                if t >= 0:
                    row[t] *= mesh[a]
        out[k] = row
    return out


def rank_blocks(placements: np.ndarray, mesh: tuple[int, ...], ndim: int) -> np.ndarray:
    """Block index of every rank along every tensor axis, ``(L, p, ndim)``, for placements ``(L, m)``
    (the tensor axis each mesh axis splits, -1 none): DTensor's order, the blocks of an axis split
    over several mesh axes numbered with the first mesh axis outermost; ranks row-major over the mesh."""
    coords = np.array(list(itertools.product(*[range(s) for s in mesh])), dtype=np.int64).reshape(-1, len(mesh))
    out = np.zeros((len(placements), len(coords), ndim), dtype=np.int64)
    for a, size in enumerate(mesh):
        on = placements[:, a][:, None, None] == np.arange(ndim)[None, None, :]  # (L, 1, ndim)
        out = np.where(on, out * size + coords[None, :, a:a + 1], out)
    return out


def same_blocks(graph, plan_ops, mesh: tuple[int, ...], reference: tuple[int, ...]) -> bool:
    """Whether every operand of every op leaves each rank the same block on ``mesh`` as on
    ``reference`` (``plan_ops``: one configuration tuple per op), so a move between two ops brings
    the same bytes on both."""
    for op, config in zip(graph.ops, plan_ops):
        cfg = np.array([config], dtype=np.int64)
        for operand in op.inputs + op.outputs:
            n = len(operand.axes)
            try:
                here = placed_layouts(op, cfg, operand.axes, mesh)[:, n:]
            except MeshError:
                return False
            there = placed_layouts(op, cfg, operand.axes, reference)[:, n:]
            if not np.array_equal(rank_blocks(here, mesh, n), rank_blocks(there, reference, n)):
                return False
    return True


def runtime_mesh(graph, plan) -> tuple[tuple[int, ...], tuple[int, ...] | None] | None:
    """Where the runtime lays a plan made without a mesh (``execute.apply.choose_mesh``):
    ``(mesh, None)`` for the coarsest mesh on which every rank holds the blocks it holds on the mesh
    of p's prime factors, the blocks the tables priced (``AnalyticCostModel.edge_mesh``): (p,), then
    two axes, three, four, then the primes' mesh itself. Fewer axes means fewer dims split over
    several mesh axes, which DTensor's rules handle less often, and a faster step. Where only a
    mesh of more than ``MAX_MESH_AXES`` axes gives them: ``(the coarsest mesh the plan lays on,
    that mesh)``, and some moves bring more bytes than priced. None if the plan lays on no mesh."""
    from shardplan.plan import PlanError

    p = plan.devices
    primes = default_mesh(p)
    configs = [tuple(f for _, f in op.split) for op in plan.ops]
    candidates = candidate_meshes(p) + [primes]
    fits = []
    for shape in candidates:
        try:
            plan.mesh_view(graph, shape)
        except (MeshError, PlanError):
            continue
        fits.append(shape)
        if shape == primes or same_blocks(graph, configs, shape, primes):
            if len(shape) <= MAX_MESH_AXES or fits[0] == shape:
                return shape, None
            return fits[0], shape
    return None
