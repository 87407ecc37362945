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

import itertools
from dataclasses import dataclass

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


def assign(op: Op, config: tuple[int, ...], mesh: tuple[int, ...]) -> OpMesh:
    """Mesh axes for each split dim of ``op`` under ``config``; MeshError when it does not fit."""
    order = [i for i, d in enumerate(op.dims) if d.kind is not DimKind.BATCH]
    order += [i for i, d in enumerate(op.dims) if d.kind is DimKind.BATCH]
    wanted = [(op.dims[i].name, int(config[i])) for i in order if config[i] > 1]
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
        splits = ", ".join(f"{n}={f}" for n, f in wanted)
        raise MeshError(f"op {op.name!r}: split {splits} does not map onto mesh {'x'.join(map(str, mesh))}")
    return OpMesh(op.name, tuple((name, axes) for (name, _), axes in zip(wanted, found)))
