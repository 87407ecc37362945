"""Configurations: every way to split an op's iteration space over the devices.

A configuration of an op with dims ``(d_1..d_n)`` is a tuple of split factors ``(c_1..c_n)``; the op
then runs on ``prod(c)`` devices, each holding a ``d_i / c_i`` slice of every dim.

Two spaces, one function:

* ``pase`` (PaSE's ``GetConfigs``): each ``c_i`` is a divisor of ``d_i`` with ``d_i / c_i >= cutoff``
  and ``prod(c) <= p``. Any divisor, so 3-, 5- or 7-way splits appear.
* ``mesh`` (the default for the analytic model): each ``c_i`` divides ``d_i`` and ``prod(c)`` divides
  ``p``, so every configuration maps onto a sub-mesh of the devices and can be run with DTensor.
  With a given device mesh (``ConfigSpace.mesh``, e.g. 8 x 8 for 8 nodes of 8 GPUs) only the
  configurations whose every split factor is a product of whole mesh axes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import numpy as np

from shardplan.ir.graph import Graph, Op


def divisors(n: int) -> list[int]:
    """Sorted divisors of a positive integer."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
        i += 1
    return small + large[::-1]


@dataclass(frozen=True)
class ConfigSpace:
    """Which split factors an op may take."""

    devices: int
    cutoff: int = 1
    """Smallest slice a split dim may leave on a device (PaSE: 4 for CNNs, 1 otherwise)."""
    product: Literal["at_most", "divides"] = "divides"
    """``at_most``: prod(c) <= devices (PaSE). ``divides``: prod(c) divides devices (mesh-realisable)."""
    mesh: tuple[int, ...] | None = None
    """A device mesh every configuration must lay on (each split factor the product of whole mesh
    axes, ``cluster.mesh``); None: any factors whose product divides the devices (they all lay on
    the mesh of the devices' prime factors)."""

    def __post_init__(self) -> None:
        if not isinstance(self.devices, int) or self.devices < 1:
            raise ValueError(f"devices must be a positive integer, got {self.devices!r}")
        if self.cutoff < 1:
            raise ValueError(f"cutoff must be at least 1, got {self.cutoff!r}")
        if self.mesh is not None and (not self.mesh or any(not isinstance(a, int) or a < 1 for a in self.mesh)
                                      or _prod(self.mesh) != self.devices):
            raise ValueError(f"mesh {'x'.join(map(str, self.mesh))} does not hold {self.devices} devices "
                             f"(its axes must be positive and multiply to the device count)")


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _contiguous(sizes: tuple[int, ...], cfg: tuple[int, ...]) -> bool:
    """PaSE's reshape rule: leading dims fully split, then one partial split, then nothing."""
    it = iter(zip(sizes, cfg))
    for d, c in it:
        if d != c:
            break
    return all(c == 1 for _, c in it)


@dataclass(frozen=True)
class SplitLimit:
    """Axis ``axis`` of ``tensor``, read or written by an op through ``dims``: the product of those
    dims' split factors must divide ``limit`` (``TensorSpec.split_limits``)."""

    tensor: str
    axis: int
    dims: tuple[str, ...]
    limit: int


def split_limits(graph: Graph, op: Op) -> list[SplitLimit]:
    """Every operand axis of ``op`` whose tensor limits its split."""
    out = []
    for operand in op.inputs + op.outputs:
        spec = graph.tensor(operand.tensor)
        for axis, dims in enumerate(operand.axes):
            if dims and spec.limit(axis):
                out.append(SplitLimit(operand.tensor, axis, tuple(dims), spec.limit(axis)))
    return out


def enumerate_configs(op: Op, space: ConfigSpace, frozen: frozenset[str] = frozenset(),
                      limits: list[SplitLimit] = ()) -> np.ndarray:
    """All configurations of ``op`` as an int64 array of shape (K, len(op.dims)).

    ``frozen`` names dims that must stay unsplit (on top of dims marked ``splittable=False``);
    ``limits`` (from :func:`split_limits`) keeps splits of viewed axes on whole blocks.
    Rows are in lexicographic order of the factors; the all-ones row (replicated) is always present.
    """
    p = space.devices
    choices = []
    for d in op.dims:
        if not d.splittable or d.name in frozen:
            choices.append([1])
            continue
        ok = [e for e in divisors(d.size) if d.size / e >= space.cutoff and e <= p]
        if space.product == "divides":
            ok = [e for e in ok if p % e == 0]
        choices.append(ok or [1])
    rows = []
    for cfg in itertools.product(*choices):
        prod = 1
        for c in cfg:
            prod *= c
        if prod > p or (space.product == "divides" and p % prod != 0):
            continue
        rows.append(cfg)
    index = {name: i for i, name in enumerate(op.dim_names)}
    for lim in limits:
        cols = [index[d] for d in lim.dims]
        rows = [r for r in rows if lim.limit % _prod(r[c] for c in cols) == 0]
    if op.kind == "reshape":
        sizes = tuple(d.size for d in op.dims)
        rows = [r for r in rows if _contiguous(sizes, r)]
    if space.mesh is not None:
        from shardplan.cluster.mesh import mesh_axes
        from shardplan.ir.graph import DimKind

        batch = tuple(d.kind is DimKind.BATCH for d in op.dims)
        rows = [r for r in rows if mesh_axes(batch, tuple(int(f) for f in r), tuple(space.mesh)) is not None]
    return np.array(rows, dtype=np.int64).reshape(len(rows), len(op.dims))


def operand_layouts(op: Op, configs: np.ndarray, axes: tuple[tuple[str, ...], ...]) -> np.ndarray:
    """Split factor of every tensor axis under every configuration: shape (K, rank)."""
    index = {name: i for i, name in enumerate(op.dim_names)}
    cols = []
    for dims in axes:
        col = np.ones(len(configs), dtype=np.int64)
        for d in dims:
            col = col * configs[:, index[d]]
        cols.append(col)
    if not cols:
        return np.ones((len(configs), 0), dtype=np.int64)
    return np.stack(cols, axis=1)
