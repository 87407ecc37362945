"""The ops that join two activations (residual adds, SwiGLU's ``silu(g) * u``) run in the layout the plan gives them.

Capture keeps such an op as an ``elementwise`` op of the graph, with a layout of its own that the search
chooses and the cost model prices (the edges into and out of it). But it is not a module, so no hook
of ``execute.apply`` can place it: left to DTensor's sharding propagation it ran in whatever layout
its inputs arrived in (a CNN's skip connection planned split by width ran split by batch), and the
plan's edges around it were not the ones paid.

At run time the join is found the way capture found it. Every activation carries the name of the graph
tensor it comes from (a heavy module's output is tagged with its op's output by ``apply``'s hook, a
model input with its own name); a torch function called on tensors of a single source passes that
source on to its result (a norm, an activation, a view, a transpose); one called on tensors of two or
more sources is a join. The graph op that reads exactly those tensors (the first not yet run in this
forward, if several do) names it: its inputs are redistributed to its planned layout before it runs,
and its result is tagged with the op's output. Batched matmuls (attention's ``einsum`` ops, whose
operands may come from one tensor: GPT-2's fused q/k/v) are matched likewise: their operands are
brought to the placements the plan's split gives each mesh axis (a batch dim, the rows, the
columns or the summed dim: ``execute.matmul``'s roles) and ``execute.matmul`` multiplies the blocks.
Left to the operands' own placements, attention ran in whatever layout ``q`` arrived in, not the
planned one, and moved ``k`` and ``v`` to match. A call that matches no graph op runs as before
(DTensor's propagation) and its result carries no source.

An input's placements come from the op's planned output placements, aligned from the right as
broadcasting aligns them: a split output dim is split on an input that has that dim at full size,
replicated on one that broadcasts along it (capture names a join's input dims the same way).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from shardplan.execute.exchange import move
from shardplan.execute.matmul import MATMULS, operand_placements

SOURCE = "_shardplan_source"
"""Attribute of a tensor, set during a forward: the graph tensor its value comes from."""


def tag(value, name: str) -> None:
    """Mark ``value`` (a tensor, or a tuple or list of them) as coming from graph tensor ``name``."""
    if isinstance(value, torch.Tensor):
        try:
            setattr(value, SOURCE, name)
        except (AttributeError, RuntimeError):  # a tensor that takes no attributes: it stays untagged
            pass
    elif isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                tag(v, name)


def _sources(args, kwargs) -> set:
    """The graph tensors the tensor arguments come from (one level into lists: ``torch.cat``)."""
    found = set()
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (tuple, list)) else (a,)):
            source = getattr(t, SOURCE, None) if isinstance(t, torch.Tensor) else None
            if source is not None:
                found.add(source)
    return found


def input_placements(shape: tuple, out_shape: tuple, out_placements) -> list:
    """Placements of a join's input of ``shape`` when its output of ``out_shape`` is placed
    ``out_placements``: dims aligned from the right; a split output dim stays split on an input that
    has it at full size and is replicated on one that broadcasts along it (or lacks it)."""
    off = len(out_shape) - len(shape)
    out = []
    for p in out_placements:
        if isinstance(p, Shard):
            d = p.dim - off
            out.append(Shard(d) if 0 <= d < len(shape) and shape[d] == out_shape[p.dim] else Replicate())
        else:
            out.append(Replicate())
    return out


class PlannedJoins(TorchFunctionMode):
    """While active (one forward of a :class:`~shardplan.execute.apply.ParallelModule`), joins run as
    the plan places them; see the module doc.

    ``joins``: the frozen set of a graph op's input tensors -> [(its output tensor, its output's
    shape, its output's placements or None, a batched matmul's roles per mesh axis or None)], in
    graph order (``graph_joins``)."""

    def __init__(self, mesh, joins: dict):
        super().__init__()
        self.mesh = mesh
        self.joins = joins
        self.seen: dict = {}
        self.placed = 0
        """Joins this forward whose inputs were brought to the planned layout (for tests)."""
        self.matmuls_placed = 0
        """Batched matmuls this forward whose operands were brought to the planned roles."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sources = _sources(args, kwargs)
        if len(sources) == 1 and func in MATMULS and frozenset(sources) in self.joins:
            pass  # a batched matmul of two views of one tensor (GPT-2's q @ k^T): a join
        elif len(sources) < 2:
            out = func(*args, **kwargs)
            if sources:
                tag(out, next(iter(sources)))
            return out
        key = frozenset(sources)
        entries = self.joins.get(key, ())
        k = self.seen.get(key, 0)
        if k >= len(entries):
            return func(*args, **kwargs)  # not a graph op: DTensor's propagation, no source
        self.seen[key] = k + 1
        name, out_shape, out_placements, roles = entries[k]
        if out_placements is not None:
            args = tuple(self._place(a, out_shape, out_placements) for a in args)
            self.placed += 1
        elif roles is not None and func in MATMULS and len(args) == 2 and not kwargs and all(
                isinstance(a, DTensor) and a.ndim >= 3 for a in args):
            nout = max(a.ndim for a in args)
            args = tuple(a if tuple(a.placements) == tuple(want) else move(a, self.mesh, want)
                         for a, want in ((a, operand_placements(roles, a, nout, left)[0])
                                         for a, left in zip(args, (True, False))))
            self.matmuls_placed += 1
        out = func(*args, **kwargs)
        tag(out, name)
        return out

    def _place(self, a, out_shape, out_placements):
        if not isinstance(a, DTensor) or getattr(a, SOURCE, None) is None:
            return a
        want = tuple(input_placements(tuple(a.shape), tuple(out_shape), out_placements))
        return a if tuple(a.placements) == want else move(a, self.mesh, want)


def planned_roles(op, opmesh, mesh_shape) -> tuple | None:
    """The roles (``execute.matmul.matmul_roles``) a captured batched matmul's split gives each mesh
    axis: its dims are ``(leading dims..., rows, cols, inner)`` (``capture.heavy``), so a mesh axis
    splitting leading dim ``i`` is ``("batch", i)``, the rows ``("m",)``, the columns ``("n",)`` and
    the summed dim ``("k",)``; None for an op of another form."""
    if op.kind != "einsum" or op.attr("equation") != "matmul":
        return None
    names = op.dim_names
    nb = len(names) - 3
    roles = []
    for d in opmesh.placements(mesh_shape):
        i = names.index(d) if d is not None else None
        roles.append(() if i is None else ("batch", i) if i < nb else (("m",), ("n",), ("k",))[i - nb])
    return tuple(roles)


def graph_joins(graph, opmeshes, mesh_shape, placements) -> dict:
    """``PlannedJoins``' table for ``graph`` laid on a mesh: every ``elementwise`` op that reads two
    or more distinct activations (with its planned output placements) and every ``einsum`` op (with
    a batched matmul's planned roles; an op of another form is only tagged).
    ``placements(operand, opmesh, mesh_shape)`` is ``execute.apply.placements``."""
    joins: dict = {}
    for op, om in zip(graph.ops, opmeshes):
        if op.kind not in ("elementwise", "einsum") or not op.outputs:
            continue
        acts = frozenset(o.tensor for o in op.inputs if not graph.tensor(o.tensor).is_param)
        if len(acts) < (1 if op.kind == "einsum" else 2):
            continue
        out = op.outputs[0]
        pl = placements(out, om, mesh_shape) if op.kind == "elementwise" else None
        roles = planned_roles(op, om, mesh_shape)
        if len(acts) < 2 and roles is None:
            continue
        joins.setdefault(acts, []).append((out.tensor, graph.tensor(out.tensor).shape, pl, roles))
    return joins
