"""The heavy ops of a captured graph: the ``h_<aten op>`` handlers that turn contractions
(linear/addmm/mm, matmul/bmm, grouped expert GEMMs, attention), convolutions, embeddings and LSTMs
into IR ops with named iteration dims and forward FLOPs (multiply-adds x 2, as
``torch.utils.flop_counter`` counts them).

:class:`HeavyOps` is a mixin of ``capture.export``'s walker, which owns the traversal, the value
bookkeeping (``val``, ``operand``, ``emit``) and the folding of cheap ops; this module only knows
what each heavy op's dims, operands and FLOPs are.
"""

from __future__ import annotations

import math

from shardplan.capture.values import CaptureError, _labels_for_input, _unique, _Val
from shardplan.ir.graph import Dim, DimKind, Op, Operand

class HeavyOps:
    """Handlers of the heavy aten ops, mixed into the capture walker (``capture.export._Capture``)."""

    def _lead_dims(self, arg, n_lead: int) -> list[Dim]:
        shape = self._meta(arg).shape
        labels = self.source_labels(arg)
        out = []
        for i in range(n_lead):
            lab = labels[i] if not labels[i].startswith(("d", "p")) or labels[i] in ("d",) else f"rows{i}"
            if i == 0 and lab.startswith("rows"):
                lab = "batch"
            kind = {"batch": DimKind.BATCH, "seq": DimKind.SEQUENCE, "height": DimKind.SPATIAL,
                    "width": DimKind.SPATIAL}.get(lab, DimKind.PARALLEL)
            out.append(Dim(lab, int(shape[i]), kind))
        return out

    def _weight(self, arg) -> str | None:
        v = self.val(arg)
        return v.params[0] if v.source is None and v.params else None

    def _fc(self, node, x, w, bias, w_out_axis: int) -> None:
        xs = self._meta(x).shape
        ws = self._meta(w).shape
        k, n = int(xs[-1]), int(ws[w_out_axis])
        lead = _unique(self._lead_dims(x, len(xs) - 1) + [Dim("out_features", n), Dim("in_features", k,
                                                                                           DimKind.REDUCTION)])
        names = [d.name for d in lead]
        lead_names = names[:-2]
        inputs = [self.operand(x, lead_names + ["in_features"])]
        wname = self._weight(w)
        if wname is not None:
            axes = [("out_features",), ("in_features",)]
            if w_out_axis == 1:
                axes.reverse()
            inputs.append(Operand(wname, tuple(axes)))
            self.attached.add(wname)
        else:  # a matrix that is an activation: an einsum-like fc
            inputs.append(self.operand(w, ["out_features", "in_features"] if w_out_axis == 0 else
                                       ["in_features", "out_features"]))
        if bias is not None:
            bname = self._weight(bias)
            if bname is not None:
                inputs.append(Operand(bname, (("out_features",),)))
                self.attached.add(bname)
        self.attach([x], inputs)
        m = math.prod(int(s) for s in xs[:-1])
        self.emit(node, "fc", lead, inputs, lead_names + ["out_features"], 2.0 * m * n * k, pw_ops=0,
                  out_labels=self.source_labels(x)[:-1] + ["features"])

    def h_linear(self, node):
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        self._fc(node, x, w, b, 0)

    def h_addmm(self, node):  # bias + x @ w, GPT-2's Conv1D: w is (in, out)
        self._fc(node, node.args[1], node.args[2], node.args[0], 1)

    def h_mm(self, node):
        a, b = node.args[0], node.args[1]
        if self._weight(b) is not None:
            self._fc(node, a, b, None, 1)
        else:
            self._matmul(node, a, b)

    def h_matmul(self, node):
        a, b = node.args[0], node.args[1]
        if self._weight(b) is not None and self._meta(b).dim() == 2:
            self._fc(node, a, b, None, 1)
        else:
            self._matmul(node, a, b)

    h_bmm = h_matmul

    def h_grouped_mm_fallback(self, node):
        """A mixture-of-experts grouped GEMM (transformers' ``grouped_mm``: tokens sorted by expert,
        ``x (T, K) @ w[e] (K, N)`` for each expert's slice of rows): an fc whose weight has a leading
        experts axis. T counts token x top-k rows, so FLOPs are ``2 T K N``; tokens are the batch. The
        experts dim is whole here: ``capture.moe`` fuses the block around it into one op whose
        experts the search may split (expert parallelism)."""
        x, w = node.args[0], node.args[1]
        (t, k), (e, kw, n) = tuple(self._meta(x).shape), tuple(self._meta(w).shape)
        if kw != k:
            raise CaptureError(f"op {node.target} ({node.name}): weight {tuple(self._meta(w).shape)} does not "
                               f"match input {tuple(self._meta(x).shape)}")
        dims = [Dim("tokens", int(t), DimKind.BATCH), Dim("experts", int(e), splittable=False),
                Dim("out_features", int(n)), Dim("in_features", int(k), DimKind.REDUCTION)]
        inputs = [self.operand(x, ["tokens", "in_features"])]
        wname = self._weight(w)
        if wname is None:
            raise CaptureError(f"op {node.target} ({node.name}): the expert weights are not a parameter")
        axes = [("experts",), ("in_features",), ("out_features",)]
        if tuple(self.tensors[wname].shape) != (e, k, n):  # stored (E, N, K) and transposed for the call
            axes = [("experts",), ("out_features",), ("in_features",)]
        inputs.append(Operand(wname, tuple(axes)))
        self.attached.add(wname)
        self.attach([x], inputs)
        self.emit(node, "fc", dims, inputs, ["tokens", "out_features"], 2.0 * t * k * n, pw_ops=0,
                  out_labels=["batch", "features"])

    h__grouped_mm = h_grouped_mm_fallback

    def _matmul(self, node, a, b) -> None:
        sa, sb = tuple(self._meta(a).shape), tuple(self._meta(b).shape)
        if len(sa) < 2 or len(sb) < 2:
            raise CaptureError(f"op aten.matmul ({node.name}) on a vector is not supported")
        out = tuple(self._meta(node).shape)
        nb = len(out) - 2
        labels = self.source_labels(a)
        lead_labels = ["batch" if i == 0 else ("heads" if i == 1 else f"b{i}") for i in range(nb)]
        dims = [Dim(lead_labels[i], int(out[i]), DimKind.BATCH if i == 0 else DimKind.PARALLEL) for i in range(nb)]
        rows_label = "seq" if "seq" in labels else "rows"
        dims += [Dim(rows_label, int(sa[-2]), DimKind.SEQUENCE if rows_label == "seq" else DimKind.PARALLEL),
                 Dim("cols", int(sb[-1])), Dim("inner", int(sa[-1]), DimKind.REDUCTION)]
        dims = _unique(dims)
        names = [d.name for d in dims]
        lead = names[:nb]

        def side(shape, last2):
            off = nb - (len(shape) - 2)
            return [lead[off + i] if shape[i] == out[off + i] else None for i in range(len(shape) - 2)] + last2

        inputs = [self.operand(a, side(sa, [names[nb], names[nb + 2]])),
                  self.operand(b, side(sb, [names[nb + 2], names[nb + 1]]))]
        self.attach([a, b], inputs)
        flops = 2.0 * math.prod(out) * sa[-1]
        self.emit(node, "einsum", dims, inputs, names[:nb + 2], flops, equation="matmul")

    def h_scaled_dot_product_attention(self, node):
        q, k, v = node.args[:3]
        sq, sk, sv = (tuple(self._meta(t).shape) for t in (q, k, v))
        b, h, lq, e = sq
        lk, ev = sk[-2], sv[-1]
        dims = [Dim("batch", b, DimKind.BATCH), Dim("heads", h), Dim("seq", lq, DimKind.SEQUENCE),
                Dim("head_dim_v", ev), Dim("seq_kv", lk, DimKind.REDUCTION, splittable=False),
                Dim("head_dim", e, DimKind.REDUCTION, splittable=False)]
        inputs = [self.operand(q, ["batch", "heads", "seq", "head_dim"]),
                  self.operand(k, ["batch", "heads" if sk[1] == h else None, "seq_kv", "head_dim"]),
                  self.operand(v, ["batch", "heads" if sv[1] == h else None, "seq_kv", "head_dim_v"])]
        self.attach([q, k, v], inputs)
        flops = 2.0 * b * h * lq * lk * e + 2.0 * b * h * lq * lk * ev
        self.emit(node, "einsum", dims, inputs, ["batch", "heads", "seq", "head_dim_v"], flops,
                  equation="attention")

    def h_conv2d(self, node):
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        stride = node.args[3] if len(node.args) > 3 else (1, 1)
        padding = node.args[4] if len(node.args) > 4 else (0, 0)
        groups = node.args[6] if len(node.args) > 6 else 1
        self._conv(node, x, w, bias, stride, padding, groups)

    def h_convolution(self, node):
        x, w, bias, stride, padding, dilation, transposed, _, groups = node.args[:9]
        if transposed:
            raise CaptureError(f"op aten.convolution (transposed) in {self._op_name(node, 'conv')[1]!r} "
                               "is not supported yet")
        self._conv(node, x, w, bias, stride, padding, groups)

    def _conv(self, node, x, w, bias, stride, padding, groups) -> None:
        xs, ws, out = (tuple(self._meta(t).shape) for t in (x, w, node))
        if len(xs) != 4:
            raise CaptureError(f"op aten.conv ({node.name}) with a {len(xs)}-D input: only conv2d is supported")
        b, c, _, _ = xs
        co, ci, r, s = ws
        grouped = groups != 1
        # Channel and spatial splits run per rank (execute.local, execute.spatial: a spatial split gathers its halo
        # rows); a grouped convolution keeps its channels whole (each output channel reads only its
        # group's inputs), and a string padding ("same") its rows and columns.
        channels = not grouped
        spatial = not isinstance(padding, str)
        dims = [Dim("batch", b, DimKind.BATCH), Dim("in_channels", ci, DimKind.REDUCTION, splittable=channels),
                Dim("height", out[2], DimKind.SPATIAL, splittable=spatial),
                Dim("width", out[3], DimKind.SPATIAL, splittable=spatial),
                Dim("kernel_h", r, DimKind.REDUCTION, splittable=False),
                Dim("kernel_w", s, DimKind.REDUCTION, splittable=False),
                Dim("out_channels", co, DimKind.PARALLEL, splittable=channels)]
        inputs = [self.operand(x, ["batch", "in_channels" if not grouped else None, "height", "width"])]
        if inputs[0] is not None:
            # rows held in blocks must split evenly at the input's extent too (a convolution without
            # padding reads more rows than it writes): its splits must divide that extent
            read = inputs[0].shape or self.tensors[inputs[0].tensor].shape
            for axis in (2, 3):
                if inputs[0].axes[axis] and read[axis] != out[axis]:
                    lims = self.limits.setdefault(inputs[0].tensor, {})
                    lims[axis] = math.gcd(lims.get(axis, 0), int(read[axis]))
        wname = self._weight(w)
        if wname is None:
            raise CaptureError(f"op aten.conv2d ({node.name}): the weight is not a parameter")
        inputs.append(Operand(wname, (("out_channels",), ("in_channels",), ("kernel_h",), ("kernel_w",))))
        self.attached.add(wname)
        if bias is not None and self._weight(bias) is not None:
            inputs.append(Operand(self._weight(bias), (("out_channels",),)))
            self.attached.add(self._weight(bias))
        self.attach([x], inputs)
        flops = 2.0 * math.prod(out) * ci * r * s
        as_pair = lambda v: tuple(v) if isinstance(v, (list, tuple)) else (v, v)  # noqa: E731
        self.emit(node, "conv", dims, inputs, ["batch", "out_channels", "height", "width"], flops,
                  out_labels=["batch", "channels", "height", "width"], pw_ops=0, kernel=(r, s),
                  stride=as_pair(stride), padding=as_pair(padding))

    def h_embedding(self, node):
        w, ids = node.args[0], node.args[1]
        wname = self._weight(w)
        if wname is None:
            raise CaptureError(f"op aten.embedding ({node.name}): the table is not a parameter")
        vocab, dim = (int(s) for s in self._meta(w).shape)
        ishape = tuple(self._meta(ids).shape)
        labels = self.source_labels(ids) if self.val(ids).source else list(_labels_for_input(ishape, False))
        lead = _unique([Dim(lab, int(s), DimKind.BATCH if lab == "batch" else
                                 (DimKind.SEQUENCE if lab == "seq" else DimKind.PARALLEL))
                             for lab, s in zip(labels, ishape)] +
                            # a table split by rows (the vocabulary) looks up each rank's rows and
                            # sums the partial outputs (execute.local.look_up_locally)
                            [Dim("embed", dim), Dim("vocab", vocab, DimKind.REDUCTION)])
        names = [d.name for d in lead]
        inputs = [self.operand(ids, names[:-2]), Operand(wname, (("vocab",), ("embed",)))]
        self.attached.add(wname)
        self.emit(node, "embedding", lead, inputs, names[:-2] + ["embed"], 0.0,
                  out_labels=labels + ["embed"])

    def h_lstm(self, node):
        x, hx, params, has_biases, num_layers, _, _, bidirectional, batch_first = node.args[:9]
        if bidirectional:
            raise CaptureError(f"op aten.lstm ({node.name}): bidirectional LSTMs are not supported yet")
        xs = tuple(self._meta(x).shape)
        b, s = (xs[0], xs[1]) if batch_first else (xs[1], xs[0])
        inp = xs[2]
        hidden = int(self._meta(params[1]).shape[1])
        pnames = [self._weight(p) for p in params]
        # Only the batch is split: the runtime runs an LSTM as a local op on a batch shard.
        dims = [Dim("layers", int(num_layers), splittable=False), Dim("seq", s, DimKind.SEQUENCE, splittable=False),
                Dim("batch", b, DimKind.BATCH), Dim("hidden_out", hidden, splittable=False),
                Dim("hidden_in", max(inp, hidden), DimKind.REDUCTION, splittable=False)]
        order = ["batch", "seq", "hidden_in"] if batch_first else ["seq", "batch", "hidden_in"]
        inputs = [self.operand(x, order)]
        self.attach_params(pnames, inputs)
        self.attach([x], inputs)
        flops = 0.0
        for layer in range(int(num_layers)):
            i_size = inp if layer == 0 else hidden
            flops += 2.0 * b * s * 4 * hidden * (i_size + hidden)
        out_meta = node.meta["val"][0]
        name, module = self._op_name(node, "lstm")
        out = self._tensor(f"{name}:out", out_meta.shape, ["batch", "seq", "hidden"] if batch_first else
                           ["seq", "batch", "hidden"], self._bytes(out_meta))
        out_axes = [("batch",), ("seq",), ("hidden_out",)] if batch_first else [("seq",), ("batch",), ("hidden_out",)]
        self.ops.append(Op(name, "lstm", tuple(dims), tuple(i for i in inputs if i is not None),
                           (Operand(out, tuple(out_axes)),), flops,
                           tuple(sorted({"batch_first": bool(batch_first), **self.take_folded()}.items())),
                           module, None))
        parts = [_Val(out, ((0,), (1,), (2,)))] + [_Val(None)] * (len(node.meta["val"]) - 1)
        self.vals[node.name] = _Val(out, (), (), parts)

