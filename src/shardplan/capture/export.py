"""Capture an ``nn.Module`` into shardplan's graph IR through ``torch.export``.

The exported aten graph (fake tensors: no weight is touched, a meta-device model works) is walked
once, in order:

* **Heavy ops** become IR ops with named iteration dims: ``linear``/``addmm``/``mm`` (kind ``fc``),
  ``matmul``/``bmm`` and scaled-dot-product attention (kind ``einsum``), ``conv2d`` (``conv``),
  ``embedding`` and ``lstm``. Their FLOPs are the forward multiply-adds x 2, the count
  ``torch.utils.flop_counter`` uses. The handlers live in ``capture.heavy`` (a mixin of the walker
  here).
* **Cheap ops** (elementwise, norms, softmax, pools, dropout, casts, views, transposes, slices) are folded
  (the axis bookkeeping is in ``capture.axes``):
  each value remembers which IR tensor it comes from and, per axis, which axes of that tensor make it
  up (an *axis map*). A view that splits ``(b, l, h*k)`` into ``(b, l, h, k)`` keeps the link between
  the heads and the producer's output features, so the search sees Megatron's head split.
* A cheap op that **joins two IR tensors** (a residual add, SwiGLU's ``silu(g) * u``, a concat)
  becomes an ``elementwise`` IR op, so the graph keeps its real shape (skip connections included).
* Parameters of folded ops (norm scales, biases) are attached, replicated, to the op that consumes
  the folded value, so every parameter of the module is in the graph.

Each IR op keeps the qualified name of the module that ran it (``op.module``), and each parameter
tensor is named by its FQN, which is what ``shardplan.execute`` uses to apply a plan.
"""

from __future__ import annotations

import math
import operator
import threading
from dataclasses import replace

import torch
from torch import fx

from shardplan.capture.axes import POOLS, dim_arg, map_axes, view_limits
from shardplan.capture.blocks import annotate
from shardplan.capture.heavy import HeavyOps
from shardplan.capture.values import CaptureError, _labels_for_input, _unique, _Val
from shardplan.ir.graph import Dim, DimKind, Graph, GraphError, Op, Operand, TensorSpec


_HEAVY = {"linear", "addmm", "mm", "matmul", "bmm", "conv2d", "convolution", "embedding",
          "scaled_dot_product_attention", "lstm", "conv1d", "conv3d", "einsum", "baddbmm",
          "grouped_mm_fallback", "_grouped_mm"}


# Folded ops that launch no kernel of their own (views and aliases); every other folded op is counted.
_NO_KERNEL = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "expand", "permute", "transpose", "t",
              "unsqueeze", "squeeze", "select", "slice", "split", "split_with_sizes", "chunk", "unbind",
              "alias", "detach", "dropout", "lift_fresh_copy", "_assert_tensor_metadata", "getitem"}


def _base(target) -> str:
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


class _Capture(HeavyOps):
    def __init__(self, ep, name: str, dtype_bytes: int | None):
        self.ep = ep
        self.name = name
        self.dtype_bytes = dtype_bytes
        self.tensors: dict[str, TensorSpec] = {}
        self.labels: dict[str, tuple[str, ...]] = {}
        self.ops: list[Op] = []
        self.vals: dict[str, _Val] = {}
        self.loss_output: str | None = None
        self.attached: set[str] = set()
        self.op_names: dict[str, int] = {}
        self.cheap_bytes: dict[str, int] = {}  # folded compute node -> bytes of its output
        self.pool_input_bytes: dict[str, int] = {}  # folded pooling node -> bytes of its input
        self.pending: dict[str, None] = {}  # folded nodes attached to the op being emitted
        self.priced: set[str] = set()  # folded nodes already charged to some op
        self.limits: dict[str, dict[int, int]] = {}  # IR tensor -> axis -> split limit (view_limits)
        self.nodes_seen = 0  # exported call_function nodes visited so far
        self.nodes_charged = 0  # ... of which attributed (as ``dispatches``) to an emitted op
        sig = ep.graph_signature
        self.param_of_input = dict(sig.inputs_to_parameters)
        self.buffer_inputs = set(sig.inputs_to_buffers) | set(getattr(sig, "inputs_to_lifted_tensor_constants", {}))

    # -- helpers -------------------------------------------------------------------------------------
    def _bytes(self, val) -> int:
        return self.dtype_bytes or val.element_size()

    def _tensor(self, name: str, shape, labels, nbytes: int, is_param: bool = False) -> str:
        shape = tuple(int(s) for s in shape)
        self.tensors[name] = TensorSpec(name, shape, nbytes, is_param)
        self.labels[name] = tuple(labels)
        return name

    def _op_name(self, node: fx.Node, what: str) -> tuple[str, str | None]:
        stack = node.meta.get("nn_module_stack") or {}
        module = None
        if stack:
            module = list(stack.values())[-1][0] or None
        base = module or node.name
        if module is not None:
            n = self.op_names.get(base, 0)
            self.op_names[base] = n + 1
            # a module that runs one heavy op gives its name to the op; the rest get a suffix
            name = base if n == 0 else f"{base}#{what}{n}"
        else:
            name = node.name
        return name, module

    @staticmethod
    def _meta(node) -> torch.Tensor | None:
        v = node.meta.get("val") if isinstance(node, fx.Node) else None
        return v if isinstance(v, torch.Tensor) else None

    def val(self, arg) -> _Val:
        if isinstance(arg, fx.Node):
            return self.vals.get(arg.name, _Val(None))
        return _Val(None)

    def operand(self, arg, dims: list[str | None]) -> Operand | None:
        """Operand on the IR source of ``arg`` whose value axes are ``dims`` in the consumer."""
        v = self.val(arg)
        if v.source is None:
            return None
        spec = self.tensors[v.source]
        per_axis: list[list[str]] = [[] for _ in spec.shape]
        used: set[str] = set()
        for i, src_axes in enumerate(v.amap):
            if i >= len(dims) or dims[i] is None or not src_axes:
                continue
            a = src_axes[0]  # the major source axis carries the split of a merged axis
            if dims[i] not in used:
                per_axis[a].append(dims[i])
                used.add(dims[i])
        return Operand(v.source, tuple(tuple(ax) for ax in per_axis), self._pooled_shape(arg, v, spec))

    def _pooled_shape(self, arg, v, spec) -> tuple[int, ...] | None:
        """The extents a reader of ``arg`` reads when a folded pooling shrank the source's axes in
        place (``Operand.shape``); None otherwise: a moved pooled map moves at its own size."""
        meta = self._meta(arg)
        if meta is None or not any(c in self.pool_input_bytes for c in v.cheap):
            return None
        shape = tuple(int(x) for x in meta.shape)
        if len(shape) != len(spec.shape) or shape == spec.shape \
                or any(m not in ((i,), ()) for i, m in enumerate(v.amap)):
            return None
        return shape

    def attach(self, args, consumer_inputs: list[Operand]) -> None:
        """Parameters of the cheap ops folded into ``args``, replicated, on the consuming op."""
        for a in args:
            v = self.val(a)
            self.attach_params(v.params, consumer_inputs)
            for c in v.cheap:
                if c not in self.priced:
                    self.priced.add(c)
                    self.pending[c] = None

    def attach_params(self, params, consumer_inputs: list[Operand]) -> None:
        """Each parameter joins (replicated) the first op that consumes it, so it is counted once."""
        for p in params:
            if p is not None and p not in self.attached:
                self.attached.add(p)
                consumer_inputs.append(Operand(p, tuple(() for _ in self.tensors[p].shape)))

    def source_labels(self, arg) -> list[str]:
        v = self.val(arg)
        meta = self._meta(arg)
        n = len(meta.shape) if meta is not None else 0
        if v.source is None:
            return [f"d{i}" for i in range(n)]
        lab = self.labels[v.source]
        return [lab[m[0]] if m else f"d{i}" for i, m in enumerate(v.amap)]

    def emit(self, node, kind: str, dims: list[Dim], inputs: list[Operand | None], out_axes: list[str],
             flops: float, out_labels: list[str] | None = None, **attrs) -> None:
        name, module = self._op_name(node, kind)
        unique = _unique(dims)
        rename = {d.name: u.name for d, u in zip(dims, unique)}
        assert len(rename) == len(dims), f"{name}: dims passed twice"
        meta = self._meta(node)
        out = self._tensor(f"{name}:out", meta.shape, out_labels or out_axes, self._bytes(meta))
        ins = [Operand(o.tensor, tuple(tuple(rename.get(d, d) for d in ax) for ax in o.axes), o.shape)
               for o in inputs if o is not None]
        outs = [Operand(out, tuple((rename[d],) for d in out_axes))]
        attrs.update(self.take_folded())
        self.ops.append(Op(name, kind, tuple(unique), tuple(ins), tuple(outs), float(flops),
                           tuple(sorted(attrs.items())), module, None))
        self.vals[node.name] = _Val(out, tuple((i,) for i in range(len(meta.shape))))

    def take_folded(self) -> dict:
        """``folded_ops`` / ``folded_bytes`` of the cheap compute ops attached since the last op, and
        ``dispatches``: the exported aten calls visited since the last op (this op's own, its folded
        ops and views), each one host-side dispatch per pass at run time."""
        out = {"dispatches": self.nodes_seen - self.nodes_charged}
        self.nodes_charged = self.nodes_seen
        if self.pending:
            out.update(folded_ops=len(self.pending), folded_bytes=sum(self.cheap_bytes[c] for c in self.pending))
            pools = [c for c in self.pending if c in self.pool_input_bytes]
            if pools:  # pooling kernels are priced by their own measured rate (cost.analytic)
                out.update(folded_pool_bytes=sum(self.cheap_bytes[c] for c in pools),
                           folded_pool_input_bytes=sum(self.pool_input_bytes[c] for c in pools))
            self.pending = {}
        return out

    # -- walk ----------------------------------------------------------------------------------------
    def run(self) -> Graph:
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                meta = self._meta(node)
                if node.name in self.param_of_input:
                    fqn = self.param_of_input[node.name]
                    self._tensor(fqn, meta.shape, [f"p{i}" for i in range(meta.dim())], self._bytes(meta), True)
                    self.vals[node.name] = _Val(None, params=(fqn,))
                elif node.name in self.buffer_inputs or meta is None:
                    self.vals[node.name] = _Val(None)
                else:
                    is_float = meta.is_floating_point()
                    t = self._tensor(node.name, meta.shape, _labels_for_input(meta.shape, is_float),
                                     self._bytes(meta) if is_float else meta.element_size())
                    self.vals[node.name] = _Val(t, tuple((i,) for i in range(meta.dim())))
            elif node.op == "call_function":
                self.nodes_seen += 1
                self.visit(node)
            elif node.op == "output":
                self.loss_output = self._first_output(node)
        if self.ops and self.nodes_seen > self.nodes_charged:  # calls after the last op: charge it
            last = self.ops[-1]
            attrs = dict(last.attrs)
            attrs["dispatches"] = attrs.get("dispatches", 0) + self.nodes_seen - self.nodes_charged
            self.ops[-1] = replace(last, attrs=tuple(sorted(attrs.items())))
        params = tuple(n for n, t in self.tensors.items() if t.is_param)
        for name, lims in self.limits.items():
            t = self.tensors[name]
            self.tensors[name] = replace(t, split_limits=tuple(lims.get(a, 0) for a in range(len(t.shape))))
        loss = (("loss_output", self.loss_output),) if self.loss_output else ()
        graph = Graph(self.name, tuple(self.ops), tuple(self.tensors.values()),
                      meta=(("captured", True), ("params", params)) + loss)
        try:
            return graph.verify()
        except GraphError as exc:  # a capture bug, not a user error: say where
            raise CaptureError(f"captured graph of {self.name!r} is inconsistent: {exc}") from None

    def _first_output(self, node: fx.Node) -> str | None:
        """The IR tensor the model's first output (a transformers model's ``logits``) comes from, when
        an op produces it: ``shardplan run`` gathers it whole on every rank for the loss."""
        leaves = [a for a in torch.utils._pytree.tree_leaves(node.args[0]) if isinstance(a, fx.Node)]
        v = self.vals.get(leaves[0].name) if leaves else None
        src = v.source if v is not None else None
        return src if src is not None and any(src in {o.tensor for o in op.outputs} for op in self.ops) else None

    def visit(self, node: fx.Node) -> None:
        base = _base(node.target)
        if base in _HEAVY:
            handler = getattr(self, f"h_{base}", None)
            if handler is None:
                _, module = self._op_name(node, base)
                raise CaptureError(f"op aten.{base} in module {module or '<top>'!r} ({node.name}) is not "
                                   f"supported by shardplan's capture yet")
            handler(node)
            return
        self.fold(node, base)

    # -- folding -------------------------------------------------------------------------------------
    def fold(self, node: fx.Node, base: str) -> None:
        meta = node.meta.get("val")
        args = [a for a in node.args if isinstance(a, fx.Node)]
        for a in node.args:
            if isinstance(a, (list, tuple)):
                args += [x for x in a if isinstance(x, fx.Node)]
        vals = [self.val(a) for a in args]
        params = tuple(p for v in vals for p in v.params)
        cheap = tuple(dict.fromkeys(c for v in vals for c in v.cheap))
        if base == "getitem":
            parent = self.val(node.args[0])
            idx = node.args[1]
            if parent.parts and isinstance(idx, int) and idx < len(parent.parts):
                self.vals[node.name] = parent.parts[idx]
            else:
                self.vals[node.name] = _Val(parent.source, parent.amap if not parent.parts else (), params,
                                            cheap=cheap)
            return
        if not isinstance(meta, torch.Tensor):
            if isinstance(meta, (list, tuple)) and args:  # split / chunk / unbind
                v = vals[0]
                # split(x, sizes, dim) and chunk(x, n, dim) carry the dim third; unbind(x, dim) second
                dim = dim_arg(node, len(self._meta(args[0]).shape), pos=1 if base == "unbind" else 2)
                parts = []
                for m in meta:
                    if not isinstance(m, torch.Tensor):
                        parts.append(_Val(None))
                        continue
                    amap = list(v.amap)
                    if base == "unbind":
                        amap = amap[:dim] + amap[dim + 1:]
                    elif dim < len(amap):
                        amap[dim] = ()
                    parts.append(_Val(v.source, tuple(amap), v.params, cheap=cheap))
                self.vals[node.name] = _Val(v.source, (), v.params, parts, cheap)
            else:
                self.vals[node.name] = _Val(None, params=params)
            return
        if base not in _NO_KERNEL:  # a kernel that reads and writes memory: priced on its consumer
            cheap = cheap + (node.name,)
            self.cheap_bytes[node.name] = int(meta.numel()) * self._bytes(meta)
            if base in POOLS and args and self._meta(args[0]) is not None:
                x = self._meta(args[0])
                self.pool_input_bytes[node.name] = int(x.numel()) * self._bytes(x)
        live = [(a, v) for a, v in zip(args, vals) if v.source is not None]
        sources = {v.source for _, v in live}
        if not live:
            self.vals[node.name] = _Val(None, params=params)
            return
        if len(sources) > 1:
            self.join(node, base, live, params)
            return
        # one source: follow the largest argument (a norm's statistics are smaller than its input)
        a, v = max(live, key=lambda av: self._meta(av[0]).numel() if self._meta(av[0]) is not None else 0)
        in_shape = tuple(self._meta(a).shape)
        out_shape = tuple(meta.shape)
        amap = map_axes(node, base, v.amap, in_shape, out_shape)
        for axis, limit in view_limits(base, v.amap, in_shape, out_shape).items():
            lims = self.limits.setdefault(v.source, {})
            lims[axis] = math.gcd(lims.get(axis, 0), limit)
        self.vals[node.name] = _Val(v.source, amap, params, cheap=cheap)

    def join(self, node, base, live, params) -> None:
        """A cheap op that combines two IR tensors: an ``elementwise`` op in the graph."""
        meta = self._meta(node)
        out_shape = tuple(meta.shape)
        labels = None
        for a, v in live:
            if tuple(self._meta(a).shape) == out_shape:
                labels = self.source_labels(a)
                break
        labels = labels or [f"d{i}" for i in range(len(out_shape))]
        # unique names first, so that operands and output agree
        dims = _unique([Dim(lab, int(s), DimKind.BATCH if lab == "batch" else DimKind.PARALLEL)
                        for lab, s in zip(labels, out_shape)])
        names = [d.name for d in dims]
        inputs = []
        for a, v in live:
            shape = tuple(self._meta(a).shape)
            off = len(out_shape) - len(shape)
            ad = [names[off + i] if off + i >= 0 and shape[i] == out_shape[off + i] else None
                  for i in range(len(shape))]
            inputs.append(self.operand(a, ad))
        self.attach([a for a, _ in live], inputs)
        self.attach_params(params, inputs)
        self.emit(node, "elementwise", dims, inputs, names, float(meta.numel()), out_labels=labels, pw_ops=0,
                  aten=base)


_EXPORT_LOCK = threading.Lock()
"""One ``torch.export`` at a time per process: it patches module-wide state while it traces, and two
threads exporting at once (the ranks of a threaded process group calling ``shardplan.apply``) fail
inside it."""


def capture(module: torch.nn.Module, example_inputs=(), example_kwargs: dict | None = None, *,
            name: str | None = None, dtype_bytes: int | None = None) -> Graph:
    """The graph IR of ``module`` called on ``example_inputs`` (tensors on any device, meta included).

    ``dtype_bytes`` overrides the element size used for costing (2 to plan bf16 training of an fp32
    model). Raises :class:`CaptureError` naming the op and module it cannot handle.
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    name = name or type(module).__name__
    try:
        with _EXPORT_LOCK:
            ep = torch.export.export(module, example_inputs, example_kwargs or {}, strict=False)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds; report them in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(f"torch.export failed on {name!r}: {type(exc).__name__}: {first}") from None
    return annotate(_Capture(ep, name, dtype_bytes).run(), module)
