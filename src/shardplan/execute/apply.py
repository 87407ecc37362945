"""Apply a plan to an ``nn.Module`` with DTensor.

For a mesh of the plan's shape (``Plan.mesh_view``: every op's split dims get mesh axes):

* every **parameter** becomes a DTensor placed as its op's configuration says: ``Shard(i)`` on the
  mesh axes that split the dim mapped onto tensor axis ``i``, ``Replicate()`` on the others (a
  batch split replicates the weights: data parallelism);
* every **heavy module** (``Linear``, GPT-2's ``Conv1D``, ``Conv2d``, ``Embedding``) gets hooks that
  redistribute its input to the layout its op reads and its output to the layout its op writes, so
  partial sums are reduced where the plan reduces them and activations move only where consecutive
  ops disagree;
* the **model inputs** are sharded as the first op that reads them wants; the ops that join two
  activations (residual adds, SwiGLU's product) run in the layout the plan gives them
  (``execute.joins``); the rest between heavy modules (norms, softmax, activations, views) follows
  DTensor's own sharding propagation, and plain tensors made inside the model (masks, positions)
  count as replicated; attention's batched matmuls
  run in the layout the plan gives them (``execute.joins``; their projections move right after
  they run, ``_moves_at_producer``) as one product of each rank's blocks (``execute.matmul``), since
  DTensor's own rule views the split batch and heads as one strided dim, which on three mesh axes
  takes it minutes to plan;
* a linear or convolution whose split DTensor's own rules refuse on a mesh of two or more axes (a
  sequence split over both axes of a 2x2 mesh, a convolution's batch split four ways) runs as a
  plain product on each rank's blocks, its output and gradients declared as the DTensors that split
  makes (``execute.local``), so any plan the search can return runs;
* **gradients** come out of DTensor's autograd as the parameters' placements: replicated weights get
  their all-reduce, sharded ones stay sharded; the gradient of a heavy module's input is brought back
  to the input's placements at the module (a partial gradient is all-reduced there, where the plan
  prices it, not carried down the residual stream).

The result computes what the single-device module computes (``tests/test_apply.py`` checks loss and
every gradient). Plans the runtime cannot honour are refused before anything runs, with the reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from shardplan.cluster.mesh import MeshError, OpMesh
from shardplan.cost.analytic import GRAD_BUCKET_BYTES
from shardplan.cost.routing import A2A
from shardplan.execute.exchange import move
from shardplan.execute.gradients import reduce_gradients
from shardplan.execute.joins import PlannedJoins, graph_joins, tag
from shardplan.execute.local import compute_locally, local_roles, run_locally
from shardplan.execute.spatial import LocalPooling
from shardplan.execute.matmul import LocalBatchedMatmul
from shardplan.cost.configs import split_limits
from shardplan.ir.graph import Graph, Op, Operand
from shardplan.plan import Plan, PlanError


class ApplyError(ValueError):
    """A plan, mesh or module that cannot be run together; the message says which and why."""


_HOOKED = ("Linear", "Conv1D", "Conv2d", "Embedding")
_RUNNABLE = {"fc", "einsum", "conv", "embedding", "elementwise"}


def check(graph: Graph, plan: Plan, mesh_shape: tuple[int, ...]) -> list[OpMesh]:
    """Refuse, with the reason, a plan that does not belong to ``graph`` or cannot run on the mesh."""
    check_model(graph, plan)
    return _check_mesh(graph, plan, mesh_shape)


def check_model(graph: Graph, plan: Plan) -> None:
    """Refuse a plan made for another model, or one asking for splits the runtime cannot do."""
    if plan.model != graph.name or len(plan.ops) != len(graph.ops):
        raise ApplyError(f"plan is for model {plan.model!r} ({len(plan.ops)} ops); this model is "
                         f"{graph.name!r} ({len(graph.ops)} ops)")
    for i, (p, op) in enumerate(zip(plan.ops, graph.ops)):
        dims = tuple(d for d, _ in p.split)
        if p.name != op.name or dims != op.dim_names:
            raise ApplyError(f"plan op {i} is {p.name!r} with dims {dims}; the model has {op.name!r} with "
                             f"dims {op.dim_names}")
        for (d, f), dim in zip(p.split, op.dims):
            if f > 1 and not dim.splittable:
                raise ApplyError(f"op {op.name!r} cannot be split along {d!r} (asked for {f} ways): "
                                 f"the runtime keeps that dim whole")
            if f > 1 and dim.size % f:
                raise ApplyError(f"op {op.name!r}: dim {d!r} of size {dim.size} does not split {f} ways evenly")
        factors = dict(p.split)
        for lim in split_limits(graph, op):
            ways = math.prod(factors[d] for d in lim.dims)
            if lim.limit % ways:
                raise ApplyError(f"op {op.name!r} splits axis {lim.axis} of {lim.tensor!r} {ways} ways, but the "
                                 f"model views that axis as {lim.limit} blocks (attention heads, samples, "
                                 f"experts, or a convolution's input rows held in equal blocks); splits must "
                                 f"divide {lim.limit}")
        allowed = ("batch", "experts", A2A) if op.kind == "moe" else ("batch",)
        if op.kind not in _RUNNABLE and p.devices > 1 and any(
                f > 1 and d not in allowed for d, f in p.split):
            raise ApplyError(f"op {op.name!r} of kind {op.kind!r} can only be split by "
                             f"{' and '.join(allowed)} at run time")


def _check_mesh(graph: Graph, plan: Plan, mesh_shape: tuple[int, ...]) -> list[OpMesh]:
    size = 1
    for a in mesh_shape:
        size *= a
    if size != plan.devices:
        raise ApplyError(f"mesh {'x'.join(map(str, mesh_shape))} has {size} devices; the plan is for "
                         f"{plan.devices}")
    try:
        opmeshes = plan.mesh_view(graph, mesh_shape)[1]
    except (MeshError, PlanError) as exc:
        raise ApplyError(str(exc)) from None
    return opmeshes


def choose_mesh(graph: Graph, plan: Plan) -> tuple[int, ...]:
    """The mesh a plan made for one (``Plan.mesh``, ``--mesh``) names; else the coarsest mesh the plan
    lays on with every rank holding the blocks the cost model priced (``cluster.mesh.runtime_mesh``),
    with a warning where that needs more than ``MAX_MESH_AXES`` axes and a coarser mesh is used: its
    moves can then bring more bytes than priced (a dry run counts them)."""
    import warnings

    from shardplan.cluster.mesh import runtime_mesh

    check_model(graph, plan)
    if plan.mesh:  # made for a given mesh (--mesh): its moves were priced on that mesh's blocks
        try:
            plan.mesh_view(graph, plan.mesh)
        except (MeshError, PlanError) as exc:
            raise ApplyError(f"plan for {plan.model!r} was made for mesh {'x'.join(map(str, plan.mesh))}, "
                             f"but {exc}") from None
        return tuple(plan.mesh)
    found = runtime_mesh(graph, plan)
    if found is None:
        raise ApplyError(f"plan for {plan.model!r} does not lay on any mesh of {plan.devices} devices")
    shape, priced = found
    if priced is not None:
        warnings.warn(f"plan for {plan.model!r}: only the {len(priced)}-axis mesh {'x'.join(map(str, priced))} "
                      f"gives every rank the blocks the cost model priced, and DTensor plans its ops "
                      f"slowly on so many axes; running on {'x'.join(map(str, shape))}, where some "
                      f"moves bring more bytes than priced", stacklevel=2)
    return shape


def placements(operand: Operand, opmesh: OpMesh, mesh_shape: tuple[int, ...]) -> list:
    """DTensor placements of one operand of an op laid on the mesh."""
    out = []
    for dim in opmesh.placements(mesh_shape):
        axis = next((i for i, ax in enumerate(operand.axes) if dim is not None and dim in ax), None)
        out.append(Replicate() if axis is None else Shard(axis))
    return out


_MOVED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("shardplan_moved", default=None)
"""Within one forward of a :class:`ParallelModule`: (id of a DTensor, target placements) -> (the
DTensor, its redistributed copy). A tensor read by several modules that want it in the same layout
(q, k and v projections of one normed hidden state; gate and up of an MLP) moves once instead of
once per reader. The cost model still prices one redistribution per reader's edge, an over-estimate
for such fan-outs (its edges are pairwise, which keeps the exact search's structure)."""


def _to_layout(x, mesh: DeviceMesh, target):
    if not isinstance(x, torch.Tensor) or target is None:
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if len(target) and x.ndim <= max((p.dim for p in target if isinstance(p, Shard)), default=-1):
        return x
    if tuple(x.placements) != tuple(target):
        moved = _MOVED.get()
        key = (id(x), tuple(target))
        if moved is not None and key in moved:
            return moved[key][1]
        y = move(x, mesh, target)
        if moved is not None:
            moved[key] = (x, y)  # holding x keeps its id from being reused during the forward
        x = y
    return x


_IMPLICIT = {"lock": threading.Lock(), "open": 0, "found": False}


@contextlib.contextmanager
def implicit_replication():
    """DTensor's ``implicit_replication`` made re-entrant and thread-safe. torch 2.13's sets a
    process-wide flag and resets it to False on exit, so a forward (which enters it) run inside a
    caller's block would switch it off for the backward that follows in the same block; and with the
    ranks as threads of one process (``execute.threaded``), restoring the value found let one rank
    leaving its forward switch it off under another rank still inside its own. Here the flag is on
    while any block is open, counted under a lock, and back to the value found when the last one
    closes."""
    dispatcher = DTensor._op_dispatcher
    with _IMPLICIT["lock"]:
        if _IMPLICIT["open"] == 0:
            _IMPLICIT["found"] = dispatcher._allow_implicit_replication
        _IMPLICIT["open"] += 1
        dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        with _IMPLICIT["lock"]:
            _IMPLICIT["open"] -= 1
            if _IMPLICIT["open"] == 0:
                dispatcher._allow_implicit_replication = _IMPLICIT["found"]


class ParallelModule(nn.Module):
    """The module with distributed parameters; call it like the original, on full (global) inputs.

    Run the backward pass inside ``with pm.context():`` too: plain tensors made by the model (masks,
    positions) then count as replicated there as well.
    """

    def context(self):
        return implicit_replication()

    def __init__(self, module: nn.Module, mesh: DeviceMesh, input_placements: dict, joins: dict | None = None,
                 pools: bool = False):
        super().__init__()
        self.module = module
        self.pools = pools
        """Whether the forward enters ``LocalPooling`` (models with convolutions: only their maps are
        split by rows or columns), which otherwise would only add a call to every torch function."""
        self.mesh = mesh
        self.input_placements = input_placements
        self.joins = joins or {}
        self.last_joins_placed = 0
        """How many joins the last forward ran in their planned layout (``execute.joins``)."""
        self.last_matmuls_placed = 0
        """How many batched matmuls the last forward ran in their planned layout."""

    def forward(self, *args, **kwargs):
        token = _MOVED.set({})
        joins = PlannedJoins(self.mesh, self.joins)
        try:
            pools = LocalPooling() if self.pools else contextlib.nullcontext()
            with implicit_replication(), LocalBatchedMatmul(), pools, joins:  # joins first: they place matmuls
                kwargs = {k: self._input(k, v) for k, v in kwargs.items()}
                args = tuple(self._input(f"arg{i}", v) for i, v in enumerate(args))
                return self.module(*args, **kwargs)
        finally:
            _MOVED.reset(token)
            self.last_joins_placed = joins.placed
            self.last_matmuls_placed = joins.matmuls_placed

    def reduce_gradients(self, bucket_bytes: float = GRAD_BUCKET_BYTES) -> int:
        """All-reduce every parameter gradient DTensor left partial, in buckets: see
        :func:`reduce_gradients`. Call it after the backward pass, before the optimizer step."""
        return reduce_gradients(self.module.parameters(), self.mesh, bucket_bytes)

    def _input(self, name, value):
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            return value
        target = self.input_placements.get(name, [Replicate()] * self.mesh.ndim)
        out = distribute_tensor(value, self.mesh, target)
        tag(out, name)  # the graph input of that name (execute.joins)
        return out


def apply(module: nn.Module, graph: Graph, plan: Plan, mesh: DeviceMesh,
          input_names: dict[str, str] | None = None) -> ParallelModule:
    """A :class:`ParallelModule` running ``module`` as ``plan`` (found for ``graph``) says, on ``mesh``.

    ``input_names`` maps the forward's argument names to graph inputs where they differ (captured
    graphs name their inputs after the forward's arguments already).
    """
    shape = tuple(mesh.shape)
    opmeshes = check(graph, plan, shape)
    placed: dict[str, list] = {}
    wants: dict[str, list] = {}  # graph input -> placements of its first reader
    hooks: dict[str, tuple] = {}
    for op, om in zip(graph.ops, opmeshes):
        for operand in op.inputs:
            spec = graph.tensor(operand.tensor)
            pl = placements(operand, om, shape)
            if spec.is_param:
                placed.setdefault(operand.tensor, pl)
            elif graph.producer(operand.tensor) is None:
                wants.setdefault(operand.tensor, pl)
        if op.module and op.module == op.name:
            acts = [o for o in op.inputs if not graph.tensor(o.tensor).is_param]
            src = graph.tensor(acts[0].tensor) if acts else None
            in_pl = placements(acts[0], om, shape) if acts else None
            out_pl = placements(op.outputs[0], om, shape)
            hooks[op.module] = (src.shape if src else None, in_pl, out_pl, graph.tensor(op.outputs[0].tensor).shape,
                                _linear_input(op, om, shape), local_roles(op, om, shape), op.outputs[0].tensor)
    onward = _moves_at_producer(graph, opmeshes, shape)
    params = dict(module.named_parameters())
    missing = [n for n in placed if n not in params]
    if missing:
        raise ApplyError(f"the module has no parameter {missing[0]!r} that the plan places; was the plan made "
                         f"for another model?")
    for name, param in params.items():
        pl = placed.get(name, [Replicate()] * mesh.ndim)
        owner, _, attr = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        setattr(sub, attr, nn.Parameter(distribute_tensor(param.detach(), mesh, pl),
                                        requires_grad=param.requires_grad))
    local = dict(graph.meta).get("local_blocks", ())
    for fqn, (in_shape, in_pl, out_pl, out_shape, linear_in, roles, out_name) in hooks.items():
        if any(fqn == b or fqn.startswith(b + ".") for b in local):
            continue  # runs inside a local block, on plain tensors
        sub = module.get_submodule(fqn)
        if isinstance(sub, nn.LSTM):
            run_locally(sub, mesh, in_pl, 0 if sub.batch_first else 1)
            continue
        if type(sub).__name__ not in _HOOKED:
            continue
        sub.register_forward_pre_hook(_pre_hook(mesh, in_shape, in_pl, linear_in))
        if roles is not None:
            compute_locally(sub, mesh, roles)
        sub.register_forward_hook(_post_hook(mesh, out_shape, out_pl, out_name, onward.get(out_name)))
    for block in dict(graph.meta).get("local_blocks", ()):
        # a mixture-of-experts block (one fused op) runs on each rank's batch shard, its experts
        # divided over the mesh axes that split ``experts``
        op, om = next((op, om) for op, om in zip(graph.ops, opmeshes) if op.name == block)
        acts = [o for o in op.inputs if not graph.tensor(o.tensor).is_param]
        pl = placements(acts[0], om, shape)
        split = om.placements(shape)
        ep_axes = tuple(i for i, d in enumerate(split) if d == "experts")
        a2a_axes = tuple(i for i, d in enumerate(split) if d == A2A)
        if ep_axes or a2a_axes:
            from shardplan.execute.experts import split_experts

            owner, _, attr = next(o.tensor for o in op.inputs if o.axes and "experts" in o.axes[0]).rpartition(".")
            experts = module.get_submodule(owner)
            split_experts(experts, owner, getattr(experts, attr), mesh, a2a_axes)
        run_locally(module.get_submodule(block), mesh, pl, 0, ep_axes)
    names = dict(input_names or {})
    inputs = {names.get(k, k): v for k, v in wants.items()}
    return ParallelModule(module, mesh, inputs, graph_joins(graph, opmeshes, shape, placements),
                          pools=any(op.kind == "conv" for op in graph.ops))


def apply_plan(module: nn.Module, plan: Plan, device_mesh: DeviceMesh, example_inputs=(),
               example_kwargs: dict | None = None, *, graph: Graph | None = None) -> ParallelModule:
    """``shardplan.apply``: ``module`` run as ``plan`` says on ``device_mesh``, the plan's graph
    captured from ``module`` called on ``example_inputs`` / ``example_kwargs`` (the inputs it was
    planned for; any values, only their shapes and dtypes matter) unless ``graph`` is given. A plan
    made for another model, a mesh whose size is not the plan's or a split the runtime cannot do is
    refused with the reason (:class:`ApplyError`), before any parameter is moved. The capture runs
    on ``module`` as given, so call this before anything else changes it."""
    if graph is None:
        if isinstance(example_inputs, tuple) and not example_inputs and not example_kwargs:
            raise ApplyError("shardplan.apply needs the module's example inputs (or its captured graph) to "
                             "match the plan's ops to the module's layers")
        from shardplan.capture import capture

        graph = capture(module, example_inputs, example_kwargs, name=plan.model)
    return apply(module, graph, plan, device_mesh)


class _GradAt(torch.autograd.Function):
    """Identity forward; backward redistributes the gradient to the placements the input had, so a
    partial input gradient is reduced at the op that made it, as the plan prices it, instead of being
    carried along (DTensor keeps a Partial gradient lazily, and every weight gradient computed from it
    downstream then needs an all-reduce of its own)."""

    @staticmethod
    def forward(ctx, x):
        ctx.placements = tuple(x.placements)
        ctx.mesh = x.device_mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.placements:
            grad = move(grad, ctx.mesh, ctx.placements)
        return grad


def _view_placements(planned: tuple, actual: tuple, target: list, mesh_shape: tuple) -> list:
    """``target`` (placements planned for a tensor of shape ``planned``) carried over to a view of it
    of shape ``actual`` that merges or splits neighbouring dims (a flatten before a linear layer, say).

    A split of planned dim ``d`` over ``n`` devices is the same split of the view's dim ``j`` when as
    many elements lie before both, ``d`` leads the dims merged into ``j`` (or ``j`` leads the dims
    ``d`` is split into), and ``n`` divides the smaller of the two, so each device's contiguous block
    holds the same elements. Any other split replicates on its mesh axis (the batch, dim 0, always
    carries over). Without this a flattened channel split became a replicated input, and the layer's
    weight gradient was computed whole on every device and then cut down."""
    if not planned:
        return [p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in target]
    ways: dict[int, int] = {}
    for p, n in zip(target, mesh_shape):
        if isinstance(p, Shard):
            ways[p.dim] = ways.get(p.dim, 1) * n
    out = []
    for p in target:
        if not isinstance(p, Shard):
            out.append(p)
            continue
        before, b = math.prod(planned[:p.dim]), planned[p.dim]
        same = [j for j, a in enumerate(actual) if math.prod(actual[:j]) == before
                and (a % b == 0 or b % a == 0) and min(a, b) % ways[p.dim] == 0]
        out.append(Shard(same[0]) if same else Replicate())
    return out


def _linear_input(op: Op, om: OpMesh, mesh_shape: tuple[int, ...]) -> tuple[tuple[int, ...], list] | None:
    """(shape, placements) of a linear layer's own input, ``(lead dims..., in_features)``, laid out as
    the op's split says; None for other ops.

    The graph knows a linear's input as the tensor a heavy op produced, which may reach the layer
    through a transpose and a reshape (attention's ``(batch, heads, seq, head_dim)`` output becomes
    ``o_proj``'s ``(batch, seq, heads x head_dim)``): placements read off that tensor's shape would
    shard the wrong dim of the layer's input (there, ``seq`` for ``heads``), and the runtime would move
    the activation to a layout the plan never asked for and back. Named by the op's dims, the layer's
    input axes are unambiguous."""
    if op.kind != "fc" or "in_features" not in op.dim_names:
        return None
    names = [n for n in op.dim_names if n not in ("out_features", "in_features")] + ["in_features"]
    sizes = tuple(op.dims[op.dim_index(n)].size for n in names)
    return sizes, placements(Operand("input", tuple((n,) for n in names)), om, mesh_shape)


def _same_rows(shape: tuple, other: tuple) -> bool:
    """``shape`` and ``other`` differ only in how their leading dims are merged: ``(b, l, f)`` and
    ``(b x l, f)``."""
    return (len(shape) > 0 and len(other) > 0 and shape[-1] == other[-1]
            and math.prod(shape[:-1]) == math.prod(other[:-1]))


def _pre_hook(mesh, in_shape, target, linear_in=None):
    def hook(mod, args):
        if not args or not isinstance(args[0], torch.Tensor) or target is None:
            return None
        x = args[0]
        pl = target
        if linear_in is not None and tuple(x.shape) == linear_in[0]:
            pl = linear_in[1]  # the layer's own input, named by the op's dims
        elif linear_in is not None and _same_rows(tuple(x.shape), linear_in[0]):
            # the same, its leading dims merged or split (GPT-2's Conv1D is captured on the (b*l, in)
            # view of a (b, l, in) input): carried over by the flattened order, not read off the
            # producer's tensor, whose dims the reshape may have reached through a transpose
            pl = _view_placements(linear_in[0], tuple(x.shape), list(linear_in[1]), tuple(mesh.shape))
        elif tuple(x.shape) != tuple(in_shape or ()) and (in_shape is None or x.ndim != len(in_shape)):
            # a reshaped view of the planned tensor (a flatten, say)
            pl = _view_placements(tuple(in_shape or ()), tuple(x.shape), list(target), tuple(mesh.shape))
        x = _to_layout(x, mesh, pl)
        if isinstance(x, DTensor) and x.requires_grad:
            x = _GradAt.apply(x)
        return (x,) + tuple(args[1:])
    return hook


def _moves_at_producer(graph: Graph, opmeshes: list[OpMesh], mesh_shape: tuple[int, ...]) -> dict[str, list]:
    """Activations moved to their reader's layout where they are made: graph tensor -> placements.

    A projection read only by a batched matmul (attention's ``q``, ``k`` and ``v``) reaches it
    through views, rotary embeddings and, with grouped-query attention, ``repeat_kv``, which
    expands ``k`` and ``v`` from the kv heads to all heads. Moved at the matmul (``execute.joins``),
    the expanded tensor would travel: heads / kv_heads times the bytes the plan's edge prices, which
    counts the projection's output. Moved here, right after the projection, it is the tensor priced.
    Only where the reader's split of every tensor axis is a plain block split (the leading dim of
    the axis: heads of ``heads x head_dim``, not ``head_dim``, which is a strided split there)."""
    from shardplan.execute.joins import planned_roles

    readers: dict[str, list] = {}
    for e in graph.edges():
        readers.setdefault(e.tensor, []).append(e)
    out: dict[str, list] = {}
    for tensor, edges in readers.items():
        if len(edges) != 1:
            continue
        e = edges[0]
        op, om = graph.ops[e.dst], opmeshes[e.dst]
        if planned_roles(op, om, mesh_shape) is None:
            continue
        operand = op.inputs[e.dst_in]
        split = [d for d in om.placements(mesh_shape) if d is not None]
        if all(any(ax and ax[0] == d for ax in operand.axes) or all(d not in ax for ax in operand.axes)
               for d in split):
            out[tensor] = placements(operand, om, mesh_shape)
    return out


def _post_hook(mesh, out_shape, target, name=None, onward=None):
    def hook(mod, args, out):
        out = _placed_output(mesh, out_shape, target, out)
        if onward is not None and isinstance(out, DTensor) and tuple(out.shape) == tuple(out_shape) \
                and tuple(out.placements) != tuple(onward):
            out = move(out, mesh, onward)  # the plan's edge to its only reader (_moves_at_producer)
        if name is not None:
            tag(out, name)  # the op's output, for the joins that read it (execute.joins)
        return out
    return hook


def _placed_output(mesh, out_shape, target, out):
    """A heavy module's output brought to the layout its op writes (partial sums reduced there)."""
    if isinstance(out, DTensor):
        shape, want = tuple(out_shape), tuple(target)
        if tuple(out.shape) != shape and _same_rows(tuple(out.shape), shape):
            # the planned output viewed with its leading dims split or merged (GPT-2's Conv1D)
            want = tuple(_view_placements(shape, tuple(out.shape), list(want), tuple(mesh.shape)))
            shape = tuple(out.shape)
        if tuple(out.shape) == shape:
            out = move(out, mesh, want) if tuple(out.placements) != want else out
        elif any(p.is_partial() for p in out.placements):  # reduce partial sums at the op, as planned
            out = out.redistribute(mesh, [Replicate() if p.is_partial() else p for p in out.placements])
        if mesh.ndim > 1 and out.requires_grad:
            # the output's gradient comes back in the output's layout: on two or more mesh axes
            # DTensor's backward may otherwise hand a linear a gradient split along the sequence
            # over both axes, which its flatten turns into a strided shard it cannot unflatten
            out = _GradAt.apply(out)
    return out
