"""A small builder to write networks by hand (PaSE's graph.py style, but with named dims).

Example::

    b = GraphBuilder("tiny")
    x = b.input("x", (64, 1024), labels=("batch", "features"))
    h = b.linear(x, 4096, pw_ops=1)          # fc + relu
    y = b.linear(h, 10)
    b.softmax_xent(y)
    graph = b.build()

Every method returns the name of the tensor it produced. Op dims take readable names
(``batch``, ``out_channels``, ``heads``...) so plans print as "batch=8 heads=2".
FLOPs are forward FLOPs with a multiply-add counted as 2.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Iterable, Sequence

from shardplan.ir.graph import Dim, DimKind, Graph, GraphError, Op, Operand, TensorSpec

# Readable names for einsum letters; anything else keeps its letter.
EINSUM_LETTER_NAMES = {
    "b": "batch", "l": "seq", "m": "seq_kv", "h": "heads", "e": "embed", "k": "head_dim",
    "f": "ffn", "v": "vocab", "s": "stack", "d": "model", "n": "out_features",
}

_LABEL_KINDS = {
    "batch": DimKind.BATCH, "height": DimKind.SPATIAL, "width": DimKind.SPATIAL,
    "seq": DimKind.SEQUENCE, "seq_kv": DimKind.SEQUENCE, "time": DimKind.SEQUENCE,
}


def kind_of_label(label: str) -> DimKind:
    return _LABEL_KINDS.get(label, DimKind.PARALLEL)


def conv_out_size(size: int, kernel: int, stride: int, pad: int) -> int:
    """Output extent of a convolution or pooling window (floor division, as PyTorch and PaSE)."""
    out = (size - kernel + 2 * pad) // stride + 1
    if out < 1:
        raise GraphError(f"window {kernel} with stride {stride} and padding {pad} does not fit extent {size}")
    return out


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    a, b = v
    return (int(a), int(b))


@dataclass
class _T:
    spec: TensorSpec
    labels: tuple[str, ...]


class GraphBuilder:
    """Collects ops and tensors; ``build()`` returns a verified :class:`Graph`."""

    def __init__(self, name: str, dtype_bytes: int = 4) -> None:
        self.name = name
        self.dtype_bytes = dtype_bytes
        self._tensors: dict[str, _T] = {}
        self._ops: list[Op] = []
        self._counts: dict[str, int] = {}
        self.layer: int | None = None  # set while building a repeated block
        self.module: str | None = None

    # -- bookkeeping -------------------------------------------------------------------------
    def _fresh(self, base: str) -> str:
        n = self._counts.get(base, 0)
        self._counts[base] = n + 1
        return base if n == 0 and base not in self._tensors else f"{base}_{n}"

    def _op_name(self, name: str | None, kind: str) -> str:
        if name is None:
            name = self._fresh(kind)
        if any(op.name == name for op in self._ops):
            raise GraphError(f"op name {name!r} is used twice")
        return name

    def _new_tensor(self, name: str, shape: Sequence[int], labels: Sequence[str], is_param: bool = False) -> str:
        if name in self._tensors:
            name = self._fresh(name)
        shape = tuple(int(s) for s in shape)
        if any(s < 1 for s in shape):
            raise GraphError(f"tensor {name!r} has shape {shape}; every extent must be positive")
        labels = tuple(labels)
        if len(labels) != len(shape):
            raise GraphError(f"tensor {name!r}: {len(labels)} labels for rank {len(shape)}")
        self._tensors[name] = _T(TensorSpec(name, shape, self.dtype_bytes, is_param), labels)
        return name

    def shape(self, t: str) -> tuple[int, ...]:
        return self._tensors[t].spec.shape

    def labels(self, t: str) -> tuple[str, ...]:
        return self._tensors[t].labels

    def _add(self, name: str, kind: str, dims: Sequence[Dim], inputs: Sequence[Operand],
             outputs: Sequence[Operand], flops: float = 0.0, **attrs) -> None:
        self._ops.append(Op(
            name=name, kind=kind, dims=tuple(dims), inputs=tuple(inputs), outputs=tuple(outputs),
            flops=float(flops), attrs=tuple(sorted(attrs.items())), module=self.module, layer=self.layer,
        ))

    def _elementwise_dims(self, t: str, fixed: Iterable[int] = ()) -> list[Dim]:
        """One dim per tensor axis, named after the axis labels; ``fixed`` axes get size-1 dims."""
        fixed = set(fixed)
        dims, seen = [], set()
        for i, (size, label) in enumerate(zip(self.shape(t), self.labels(t))):
            name = label
            while name in seen:
                name = name + "_"
            seen.add(name)
            dims.append(Dim(name, 1 if i in fixed else size, kind_of_label(label)))
        return dims

    # -- sources -----------------------------------------------------------------------------
    def input(self, name: str, shape: Sequence[int], labels: Sequence[str] | None = None) -> str:
        """A graph input (data, labels, positional table): no producer, never a vertex."""
        if labels is None:
            labels = ("batch",) + tuple(f"d{i}" for i in range(1, len(shape)))
        return self._new_tensor(name, shape, labels)

    def param(self, name: str, shape: Sequence[int], labels: Sequence[str]) -> str:
        return self._new_tensor(name, shape, labels, is_param=True)

    # -- contractions ------------------------------------------------------------------------
    def conv2d(self, x: str, out_channels: int, kernel: int | Sequence[int], stride: int | Sequence[int] = 1,
               padding: int | Sequence[int] = 0, pw_ops: int = 0, name: str | None = None) -> str:
        """2-D convolution, NCHW; ``pw_ops`` fused pointwise ops (ReLU) on the output."""
        name = self._op_name(name, "conv")
        b, c, h, w = self.shape(x)
        r, s = _pair(kernel)
        sh, sw = _pair(stride)
        ph, pw_ = _pair(padding)
        ho, wo = conv_out_size(h, r, sh, ph), conv_out_size(w, s, sw, pw_)
        dims = [Dim("batch", b, DimKind.BATCH), Dim("in_channels", c, DimKind.REDUCTION),
                Dim("height", ho, DimKind.SPATIAL), Dim("width", wo, DimKind.SPATIAL),
                Dim("kernel_h", r, DimKind.REDUCTION), Dim("kernel_w", s, DimKind.REDUCTION),
                Dim("out_channels", out_channels, DimKind.PARALLEL)]
        wt = self.param(f"{name}.weight", (out_channels, c, r, s), ("out_channels", "in_channels", "kh", "kw"))
        y = self._new_tensor(f"{name}.out", (b, out_channels, ho, wo), ("batch", "channels", "height", "width"))
        self._add(name, "conv", dims,
                  [Operand(x, (("batch",), ("in_channels",), ("height",), ("width",))),
                   Operand(wt, (("out_channels",), ("in_channels",), ("kernel_h",), ("kernel_w",)))],
                  [Operand(y, (("batch",), ("out_channels",), ("height",), ("width",)))],
                  flops=2.0 * b * out_channels * ho * wo * c * r * s + pw_ops * b * out_channels * ho * wo,
                  pw_ops=pw_ops, kernel=(r, s), stride=(sh, sw), padding=(ph, pw_))
        return y

    def linear(self, x: str, out_features: int, pw_ops: int = 0, bias: bool = False, name: str | None = None) -> str:
        """Fully connected layer on the last axis; every leading axis is batch-like (PaSE's FC)."""
        name = self._op_name(name, "fc")
        shape, labels = self.shape(x), self.labels(x)
        lead = self._elementwise_dims(x)[:-1]
        k = shape[-1]
        dims = lead + [Dim("out_features", out_features, DimKind.PARALLEL), Dim("in_features", k, DimKind.REDUCTION)]
        lead_axes = tuple((d.name,) for d in lead)
        wt = self.param(f"{name}.weight", (out_features, k), ("out_features", "in_features"))
        inputs = [Operand(x, lead_axes + (("in_features",),)), Operand(wt, (("out_features",), ("in_features",)))]
        if bias:
            bt = self.param(f"{name}.bias", (out_features,), ("out_features",))
            inputs.append(Operand(bt, (("out_features",),)))
        y = self._new_tensor(f"{name}.out", shape[:-1] + (out_features,), labels[:-1] + ("features",))
        m = 1
        for s in shape[:-1]:
            m *= s
        self._add(name, "fc", dims, inputs, [Operand(y, lead_axes + (("out_features",),))],
                  flops=2.0 * m * out_features * k + pw_ops * m * out_features, pw_ops=pw_ops)
        return y

    def einsum(self, equation: str, a: str, b: str | Sequence[int], pw_ops: int = 0, name: str | None = None,
               letter_names: dict[str, str] | None = None, kind: str = "einsum") -> str:
        """Generic contraction ``'ble,ef->blf'``; ``b`` may be a shape, making it a new parameter."""
        name = self._op_name(name, kind)
        lhs, out = equation.replace(" ", "").split("->")
        in1, in2 = lhs.split(",")
        names = dict(EINSUM_LETTER_NAMES)
        names.update(letter_names or {})
        for letters in (in1, in2, out):
            if len(set(letters)) != len(letters) or not set(letters) <= set(string.ascii_letters):
                raise GraphError(f"op {name!r}: bad einsum term {letters!r} in {equation!r}")
        if not set(out) <= set(in1) | set(in2):
            raise GraphError(f"op {name!r}: output letters of {equation!r} must appear in an input")
        if not isinstance(b, str):
            b = self.param(f"{name}.weight", tuple(b), tuple(names.get(c, c) for c in in2))
        sizes: dict[str, int] = {}
        for letters, t in ((in1, a), (in2, b)):
            shape = self.shape(t)
            if len(shape) != len(letters):
                raise GraphError(f"op {name!r}: {letters!r} has {len(letters)} letters but {t!r} has rank {len(shape)}")
            for c, s in zip(letters, shape):
                if sizes.setdefault(c, s) != s:
                    raise GraphError(f"op {name!r}: letter {c!r} is {sizes[c]} in one input and {s} in the other")
        reduction = [c for c in in1 + in2 if c not in out]
        reduction = list(dict.fromkeys(reduction))
        order = list(out) + reduction

        def kind_of(c: str) -> DimKind:
            if c in reduction:
                return DimKind.REDUCTION
            return kind_of_label(names.get(c, c))

        dims = [Dim(names.get(c, c), sizes[c], kind_of(c)) for c in order]
        if len({d.name for d in dims}) != len(dims):
            raise GraphError(f"op {name!r}: two einsum letters share a dim name; pass letter_names")
        ax = lambda letters: tuple((names.get(c, c),) for c in letters)  # noqa: E731
        y = self._new_tensor(f"{name}.out", tuple(sizes[c] for c in out), tuple(names.get(c, c) for c in out))
        total = 1
        for c in order:
            total *= sizes[c]
        out_elems = 1
        for c in out:
            out_elems *= sizes[c]
        self._add(name, kind, dims, [Operand(a, ax(in1)), Operand(b, ax(in2))], [Operand(y, ax(out))],
                  flops=2.0 * total + pw_ops * out_elems, pw_ops=pw_ops, equation=equation)
        return y

    def embedding(self, ids: str, vocab: int, dim: int, name: str | None = None) -> str:
        """Embedding lookup ``ids (..) -> (.., dim)``; PaSE prices it as a one-hot GEMM over ``vocab``."""
        name = self._op_name(name, "embedding")
        lead = self._elementwise_dims(ids)
        dims = lead + [Dim("embed", dim, DimKind.PARALLEL), Dim("vocab", vocab, DimKind.REDUCTION)]
        lead_axes = tuple((d.name,) for d in lead)
        wt = self.param(f"{name}.weight", (vocab, dim), ("vocab", "embed"))
        y = self._new_tensor(f"{name}.out", self.shape(ids) + (dim,), self.labels(ids) + ("embed",))
        n = 1
        for s in self.shape(ids):
            n *= s
        self._add(name, "embedding", dims, [Operand(ids, lead_axes), Operand(wt, (("vocab",), ("embed",)))],
                  [Operand(y, lead_axes + (("embed",),))], flops=2.0 * n * vocab * dim)
        return y

    def lstm(self, x: str, hidden: int, num_layers: int, name: str | None = None) -> str:
        """A whole multi-layer LSTM ``(batch, seq, hidden) -> (batch, seq, hidden)`` as one op (PaSE)."""
        name = self._op_name(name, "lstm")
        b, s, u = self.shape(x)
        if u != hidden:
            raise GraphError(f"op {name!r}: input width {u} differs from hidden size {hidden}")
        dims = [Dim("layers", num_layers, DimKind.PARALLEL), Dim("seq", s, DimKind.SEQUENCE),
                Dim("batch", b, DimKind.BATCH), Dim("hidden_out", hidden, DimKind.PARALLEL),
                Dim("hidden_in", hidden, DimKind.REDUCTION)]
        wt = self.param(f"{name}.weight", (num_layers, 4 * hidden, 2 * hidden), ("layers", "gates", "inputs"))
        y = self._new_tensor(f"{name}.out", (b, s, hidden), ("batch", "seq", "hidden"))
        self._add(name, "lstm", dims,
                  [Operand(x, (("batch",), ("seq",), ("hidden_in",))),
                   Operand(wt, (("layers",), ("hidden_out",), ("hidden_in",)))],
                  [Operand(y, (("batch",), ("seq",), ("hidden_out",)))],
                  flops=2.0 * num_layers * s * b * (4 * hidden) * (2 * hidden) + 3 * num_layers * s * b * 4 * hidden)
        return y

    # -- tensor-wise ops ---------------------------------------------------------------------
    def _unary(self, kind: str, x: str, name: str | None, flops_per_elem: float, params: Sequence[int] = (),
               **attrs) -> str:
        name = self._op_name(name, kind)
        dims = self._elementwise_dims(x)
        axes = tuple((d.name,) for d in dims)
        inputs = [Operand(x, axes)]
        for axis in params:
            size = self.shape(x)[axis]
            for suffix in ("weight", "bias"):
                pt = self.param(f"{name}.{suffix}", (size,), (self.labels(x)[axis],))
                inputs.append(Operand(pt, (axes[axis],)))
        y = self._new_tensor(f"{name}.out", self.shape(x), self.labels(x))
        n = 1
        for s in self.shape(x):
            n *= s
        self._add(name, kind, dims, inputs, [Operand(y, axes)], flops=flops_per_elem * n, **attrs)
        return y

    def batch_norm(self, x: str, name: str | None = None) -> str:
        """BatchNorm; PaSE normalises along axis 0 (batch)."""
        return self._unary("norm", x, name, 8.0, params=(1,), axis=self._elementwise_dims(x)[0].name)

    def layer_norm(self, x: str, name: str | None = None) -> str:
        return self._unary("norm", x, name, 8.0, params=(len(self.shape(x)) - 1,),
                           axis=self._elementwise_dims(x)[-1].name)

    def softmax(self, x: str, axis: int = -1, name: str | None = None) -> str:
        axis = axis % len(self.shape(x))
        return self._unary("softmax", x, name, 5.0, axis=self._elementwise_dims(x)[axis].name)

    def relu(self, x: str, name: str | None = None) -> str:
        return self._unary("elementwise", x, name, 1.0, pw_ops=0)

    def softmax_xent(self, logits: str, name: str | None = None) -> str:
        """Softmax + cross-entropy over the last axis; the graph's loss."""
        return self._unary("softmax_xent", logits, name, 5.0, axis=self._elementwise_dims(logits)[-1].name)

    def add(self, a: str, b: str, pw_ops: int = 0, name: str | None = None) -> str:
        """Elementwise binary op (residual add); ``pw_ops`` fused pointwise ops."""
        name = self._op_name(name, "add")
        if self.shape(a) != self.shape(b):
            raise GraphError(f"op {name!r}: shapes {self.shape(a)} and {self.shape(b)} differ")
        dims = self._elementwise_dims(a)
        axes = tuple((d.name,) for d in dims)
        y = self._new_tensor(f"{name}.out", self.shape(a), self.labels(a))
        n = 1
        for s in self.shape(a):
            n *= s
        self._add(name, "elementwise", dims, [Operand(a, axes), Operand(b, axes)], [Operand(y, axes)],
                  flops=(1 + pw_ops) * n, pw_ops=pw_ops)
        return y

    def pool2d(self, x: str, kernel: int | Sequence[int], stride: int | Sequence[int] = 1,
               padding: int | Sequence[int] = 0, name: str | None = None) -> str:
        """Max/avg pooling, NCHW."""
        name = self._op_name(name, "pool")
        b, c, h, w = self.shape(x)
        r, s = _pair(kernel)
        sh, sw = _pair(stride)
        ph, pw_ = _pair(padding)
        ho, wo = conv_out_size(h, r, sh, ph), conv_out_size(w, s, sw, pw_)
        dims = [Dim("batch", b, DimKind.BATCH), Dim("channels", c, DimKind.PARALLEL),
                Dim("height", ho, DimKind.SPATIAL), Dim("width", wo, DimKind.SPATIAL)]
        axes = (("batch",), ("channels",), ("height",), ("width",))
        y = self._new_tensor(f"{name}.out", (b, c, ho, wo), ("batch", "channels", "height", "width"))
        self._add(name, "pool", dims, [Operand(x, axes)], [Operand(y, axes)], flops=float(b * c * ho * wo * r * s),
                  kernel=(r, s), stride=(sh, sw), padding=(ph, pw_))
        return y

    def reduce_mean(self, x: str, axes: Sequence[int], name: str | None = None) -> str:
        """Mean over ``axes`` (global average pooling with axes (2, 3))."""
        name = self._op_name(name, "mean")
        dims = self._elementwise_dims(x)
        axes = sorted(a % len(dims) for a in axes)
        keep = [i for i in range(len(dims)) if i not in axes]
        y = self._new_tensor(f"{name}.out", tuple(self.shape(x)[i] for i in keep),
                             tuple(self.labels(x)[i] for i in keep))
        dims = [Dim(d.name, d.size, DimKind.REDUCTION if i in axes else d.kind) for i, d in enumerate(dims)]
        n = 1
        for s in self.shape(x):
            n *= s
        self._add(name, "reduce_mean", dims, [Operand(x, tuple((d.name,) for d in dims))],
                  [Operand(y, tuple((dims[i].name,) for i in keep))], flops=float(n),
                  reduced=tuple(dims[i].name for i in axes))
        return y

    def concat(self, xs: Sequence[str], axis: int, name: str | None = None) -> str:
        """Concatenate along ``axis``; that axis is never split (PaSE)."""
        name = self._op_name(name, "concat")
        first = self.shape(xs[0])
        axis = axis % len(first)
        for t in xs[1:]:
            s = self.shape(t)
            if len(s) != len(first) or any(s[i] != first[i] for i in range(len(s)) if i != axis):
                raise GraphError(f"op {name!r}: cannot concatenate shapes {first} and {s} on axis {axis}")
        dims = self._elementwise_dims(xs[0], fixed=[axis])
        axes = tuple(() if i == axis else (d.name,) for i, d in enumerate(dims))
        out_shape = list(first)
        out_shape[axis] = sum(self.shape(t)[axis] for t in xs)
        y = self._new_tensor(f"{name}.out", out_shape, self.labels(xs[0]))
        self._add(name, "concat", dims, [Operand(t, axes) for t in xs], [Operand(y, axes)], axis=axis)
        return y

    def stack(self, xs: Sequence[str], axis: int = 0, name: str | None = None) -> str:
        """Stack equal tensors along a new axis (never split)."""
        name = self._op_name(name, "stack")
        first = self.shape(xs[0])
        if any(self.shape(t) != first for t in xs):
            raise GraphError(f"op {name!r}: stacked tensors must have equal shapes")
        dims = self._elementwise_dims(xs[0])
        in_axes = tuple((d.name,) for d in dims)
        out_axes = in_axes[:axis] + ((),) + in_axes[axis:]
        labels = self.labels(xs[0])
        y = self._new_tensor(f"{name}.out", first[:axis] + (len(xs),) + first[axis:],
                             labels[:axis] + ("stack",) + labels[axis:])
        self._add(name, "stack", dims, [Operand(t, in_axes) for t in xs], [Operand(y, out_axes)], axis=axis)
        return y

    def unstack(self, x: str, axis: int = 0, name: str | None = None) -> list[str]:
        """Split a tensor into its slices along ``axis`` (never split)."""
        name = self._op_name(name, "unstack")
        shape, labels = self.shape(x), self.labels(x)
        dims = self._elementwise_dims(x, fixed=[axis])
        in_axes = tuple(() if i == axis else (d.name,) for i, d in enumerate(dims))
        out_axes = tuple(a for i, a in enumerate(in_axes) if i != axis)
        outs = [self._new_tensor(f"{name}.out{i}", shape[:axis] + shape[axis + 1:], labels[:axis] + labels[axis + 1:])
                for i in range(shape[axis])]
        self._add(name, "unstack", dims, [Operand(x, in_axes)], [Operand(t, out_axes) for t in outs], axis=axis)
        return outs

    def reshape(self, x: str, shape: Sequence[int], labels: Sequence[str] | None = None,
                name: str | None = None) -> str:
        """Reshape as PaSE does it: flatten to 1-D (``ravel``) then unflatten (``unravel``).

        Only "contiguous" splits are allowed on each side (leading axes fully split, then at most one
        partially split axis), so that a shard of the flat vector is a shard of the shaped tensor.
        """
        base = self._op_name(name, "reshape")
        shape = tuple(int(s) for s in shape)
        n = 1
        for s in self.shape(x):
            n *= s
        m = 1
        for s in shape:
            m *= s
        if n != m:
            raise GraphError(f"op {base!r}: cannot reshape {self.shape(x)} ({n} elements) to {shape} ({m})")
        if labels is None:
            labels = ("batch",) + tuple(f"d{i}" for i in range(1, len(shape)))
        flat = self._new_tensor(f"{base}.flat", (n,), ("flat",))
        dims = self._elementwise_dims(x)
        axes = tuple((d.name,) for d in dims)
        self._add(f"{base}.ravel", "reshape", dims, [Operand(x, axes)], [Operand(flat, (tuple(d.name for d in dims),))])
        y = self._new_tensor(f"{base}.out", shape, labels)
        dims2, seen = [], set()
        for size, label in zip(shape, labels):
            nm = label
            while nm in seen:
                nm += "_"
            seen.add(nm)
            dims2.append(Dim(nm, size, kind_of_label(label)))
        axes2 = tuple((d.name,) for d in dims2)
        self._add(f"{base}.unravel", "reshape", dims2, [Operand(flat, (tuple(d.name for d in dims2),))],
                  [Operand(y, axes2)])
        return y

    # -- result ------------------------------------------------------------------------------
    def build(self, **meta) -> Graph:
        """The finished graph; keyword arguments become graph hints (``pase_cutoff=4``)."""
        used = {o.tensor for op in self._ops for o in op.inputs + op.outputs}
        tensors = tuple(t.spec for name, t in self._tensors.items() if name in used)
        return Graph(self.name, tuple(self._ops), tensors, tuple(sorted(meta.items()))).verify()
