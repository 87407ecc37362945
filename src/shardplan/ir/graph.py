"""The graph IR: ops with named iteration spaces, tensors mapped onto them (numpy-free, torch-free).

Vocabulary (see docs/architecture.md):

* An **op** owns an *iteration space*: a tuple of named :class:`Dim` (``batch``, ``out_channels``,
  ``heads``...). A *configuration* of the op says how many ways each dim is split.
* A **tensor** is a value with a shape. An op reads and writes tensors through :class:`Operand`,
  which maps every tensor axis onto the iteration dims whose split factors multiply to that axis's
  split (einsum style). An axis mapped to ``()`` is never split by this op (a concat axis, say).
* Tensors without a producer are graph inputs or parameters (``is_param``).

Everything here is a frozen dataclass. ``Graph.verify()`` checks the invariants and names the op and
dim at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Iterator


class GraphError(ValueError):
    """A graph that breaks an invariant; the message names the op, tensor or dim at fault."""


class DimKind(str, Enum):
    """What an iteration dim means; decides which collectives a split of it costs."""

    BATCH = "batch"  # independent samples: splitting it is data parallelism
    PARALLEL = "parallel"  # an output feature dim: channels, heads, hidden, vocabulary
    REDUCTION = "reduction"  # summed over: splitting it leaves partial sums
    SPATIAL = "spatial"  # image height/width: splitting it needs halo exchange for kernels
    SEQUENCE = "sequence"  # tokens / time steps


@dataclass(frozen=True)
class Dim:
    """One dim of an op's iteration space."""

    name: str
    size: int
    kind: DimKind = DimKind.PARALLEL
    splittable: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise GraphError(f"dim {self.name!r} has size {self.size!r}; sizes are positive integers")


@dataclass(frozen=True)
class TensorSpec:
    """A value of the graph: activation, graph input or parameter."""

    name: str
    shape: tuple[int, ...]
    dtype_bytes: int = 4
    is_param: bool = False
    split_limits: tuple[int, ...] = ()
    """Per axis, 0 or a number the axis's split count must divide: a fused projection's output viewed
    as ``(heads, head_dim)`` can only be split along whole heads (``heads``). Empty: no limits."""

    def __post_init__(self) -> None:
        if self.split_limits and len(self.split_limits) != len(self.shape):
            raise GraphError(f"tensor {self.name!r}: {len(self.split_limits)} split limits for rank "
                             f"{len(self.shape)}")

    def limit(self, axis: int) -> int:
        """The number the split count of ``axis`` must divide (0: any divisor of the axis)."""
        return self.split_limits[axis] if self.split_limits else 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype_bytes


@dataclass(frozen=True)
class Operand:
    """How one tensor is read or written by an op.

    ``axes[i]`` lists the op dims whose split factors multiply to the split of tensor axis ``i``
    (usually one dim; a flattened axis lists several; ``()`` means this axis is never split).
    """

    tensor: str
    axes: tuple[tuple[str, ...], ...]
    shape: tuple[int, ...] | None = None
    """The extents of what the op reads, where a cheap op folded between the tensor and the op
    changes them but keeps the axes (a pooled map: ``(b, c, h / 2, w / 2)`` of a ``(b, c, h, w)``
    tensor); None: the tensor's own. Moves of the tensor into this op, its gradient's reductions and
    the tile it keeps are of this size (``Graph.read_spec``)."""

    def dims(self) -> tuple[str, ...]:
        """All op dims that appear in this operand, in axis order."""
        return tuple(d for axis in self.axes for d in axis)


@dataclass(frozen=True)
class Op:
    """One node of the graph.

    ``flops`` is the forward cost of the whole (unsplit) op, counting a multiply-add as 2 FLOPs.
    ``attrs`` holds kind-specific settings as sorted (key, value) pairs, e.g. ``("pw_ops", 1)``.
    """

    name: str
    kind: str
    dims: tuple[Dim, ...]
    inputs: tuple[Operand, ...]
    outputs: tuple[Operand, ...]
    flops: float = 0.0
    attrs: tuple[tuple[str, Any], ...] = ()
    module: str | None = None
    layer: int | None = None

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    def dim(self, name: str) -> Dim:
        for d in self.dims:
            if d.name == name:
                return d
        raise GraphError(f"op {self.name!r} has no dim {name!r} (dims: {', '.join(self.dim_names)})")

    def dim_index(self, name: str) -> int:
        for i, d in enumerate(self.dims):
            if d.name == name:
                return i
        raise GraphError(f"op {self.name!r} has no dim {name!r} (dims: {', '.join(self.dim_names)})")


@dataclass(frozen=True)
class Edge:
    """One tensor transfer: output ``src_out`` of op ``src`` read as input ``dst_in`` of op ``dst``."""

    src: int
    src_out: int
    dst: int
    dst_in: int
    tensor: str


@dataclass(frozen=True)
class Graph:
    """A network: ops in topological order plus the tensors they exchange."""

    name: str
    ops: tuple[Op, ...]
    tensors: tuple[TensorSpec, ...]
    meta: tuple[tuple[str, Any], ...] = ()  # hints such as ("pase_cutoff", 4)
    _tensor_index: dict[str, TensorSpec] = field(init=False, repr=False, compare=False)
    _producer: dict[str, tuple[int, int]] = field(init=False, repr=False, compare=False)
    _op_index: dict[str, int] = field(init=False, repr=False, compare=False)
    _first_reader: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tindex: dict[str, TensorSpec] = {}
        for t in self.tensors:
            if t.name in tindex:
                raise GraphError(f"tensor {t.name!r} is declared twice")
            tindex[t.name] = t
        producer: dict[str, tuple[int, int]] = {}
        oindex: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            if op.name in oindex:
                raise GraphError(f"op name {op.name!r} is used twice")
            oindex[op.name] = i
            for j, out in enumerate(op.outputs):
                if out.tensor in producer:
                    other = self.ops[producer[out.tensor][0]].name
                    raise GraphError(f"tensor {out.tensor!r} is written by both {other!r} and {op.name!r}")
                producer[out.tensor] = (i, j)
        object.__setattr__(self, "_tensor_index", tindex)
        object.__setattr__(self, "_producer", producer)
        object.__setattr__(self, "_op_index", oindex)
        first: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            for o in op.inputs:
                first.setdefault(o.tensor, i)
        object.__setattr__(self, "_first_reader", first)

    # -- lookups -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def hint(self, key: str, default: Any = None) -> Any:
        for k, v in self.meta:
            if k == key:
                return v
        return default

    def tensor(self, name: str) -> TensorSpec:
        try:
            return self._tensor_index[name]
        except KeyError:
            raise GraphError(f"graph {self.name!r} has no tensor {name!r}") from None

    def read_spec(self, operand: Operand) -> TensorSpec:
        """The tensor an operand reads, with the extents it reads them at (``Operand.shape``)."""
        spec = self.tensor(operand.tensor)
        if operand.shape is None or tuple(operand.shape) == spec.shape:
            return spec
        return replace(spec, shape=tuple(operand.shape))

    def op(self, name: str) -> Op:
        try:
            return self.ops[self._op_index[name]]
        except KeyError:
            raise GraphError(f"graph {self.name!r} has no op {name!r}") from None

    def op_index(self, name: str) -> int:
        return self._op_index[name]

    def producer(self, tensor: str) -> tuple[int, int] | None:
        """(op index, output index) that writes ``tensor``, or None for inputs and parameters."""
        return self._producer.get(tensor)

    def first_reader(self, tensor: str) -> int | None:
        """Index of the first op that reads ``tensor`` (a tied weight is read by several), or None."""
        return self._first_reader.get(tensor)

    def edges(self) -> list[Edge]:
        """Every tensor transfer between two ops (a consumer reading a tensor twice gives two)."""
        result = []
        for i, op in enumerate(self.ops):
            for k, inp in enumerate(op.inputs):
                src = self._producer.get(inp.tensor)
                if src is not None:
                    result.append(Edge(src[0], src[1], i, k, inp.tensor))
        return result

    def neighbours(self) -> list[set[int]]:
        """Undirected adjacency (op indices) induced by the edges."""
        adj: list[set[int]] = [set() for _ in self.ops]
        for e in self.edges():
            if e.src != e.dst:
                adj[e.src].add(e.dst)
                adj[e.dst].add(e.src)
        return adj

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors if t.is_param)

    @property
    def forward_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    # -- checks --------------------------------------------------------------------------------
    def verify(self) -> "Graph":
        """Check the invariants; raise :class:`GraphError` naming the culprit. Returns self."""
        if not self.ops:
            raise GraphError(f"graph {self.name!r} has no ops")
        for i, op in enumerate(self.ops):
            names = op.dim_names
            if len(set(names)) != len(names):
                raise GraphError(f"op {op.name!r} declares a dim twice: {names}")
            sizes = {d.name: d.size for d in op.dims}
            for role, operands in (("input", op.inputs), ("output", op.outputs)):
                for operand in operands:
                    spec = self._tensor_index.get(operand.tensor)
                    if spec is None:
                        raise GraphError(f"op {op.name!r} {role} {operand.tensor!r} is not a tensor of the graph")
                    if len(operand.axes) != len(spec.shape):
                        raise GraphError(
                            f"op {op.name!r} maps {len(operand.axes)} axes of {role} {operand.tensor!r}, "
                            f"which has rank {len(spec.shape)}"
                        )
                    if operand.shape is not None and len(operand.shape) != len(spec.shape):
                        raise GraphError(f"op {op.name!r} reads {operand.tensor!r} with shape {operand.shape}, "
                                         f"which has rank {len(spec.shape)}")
                    for axis, dims in enumerate(operand.axes):
                        for d in dims:
                            if d not in sizes:
                                raise GraphError(
                                    f"op {op.name!r} maps axis {axis} of {operand.tensor!r} to unknown dim {d!r}"
                                )
            for inp in op.inputs:
                src = self._producer.get(inp.tensor)
                if src is not None and src[0] >= i:
                    raise GraphError(
                        f"op {op.name!r} reads {inp.tensor!r} before its producer "
                        f"{self.ops[src[0]].name!r}: ops must be in topological order"
                    )
            for out in op.outputs:
                if self._tensor_index[out.tensor].is_param:
                    raise GraphError(f"op {op.name!r} writes parameter {out.tensor!r}")
        return self
