"""Mixture-of-experts blocks as one op: the routed experts of a block (e.g. Mixtral's ``...mlp``:
router, token gather, grouped gate/up and down GEMMs, weighting, scatter back) fused into a single
``moe`` op, so the search can choose expert parallelism for the block as a whole.

The fused op's dims are ``batch`` (split: data parallel), ``seq`` and ``features`` (whole), and two
ways to split the experts, which the search may mix:

* ``experts`` (split over mesh axes A): **gather and reduce**. The block's input is read as
  ``(batch, seq, features)`` without ``experts``, so it is replicated over A (an all-gather of the
  tokens at the edge into the block); each rank runs its ``E / |A|`` experts on every token and the
  output, which lacks ``experts`` too, is a partial sum all-reduced over A. Exact for any routing,
  and no collective of its own: DTensor moves the tokens.
* ``experts_a2a`` (split over mesh axes B): **all-to-all dispatch** (GShard, Lepikhin et al. 2021;
  DeepSpeed-MoE). The input and output are read as ``(batch x experts_a2a, seq, features)``: each
  rank of B holds its own share of the tokens, sends each (token, choice) row to the rank holding
  that expert and gets the expert's output back: forward, all-to-alls of the row counts, the rows'
  expert ids and the rows there and back; backward, the rows' gradients both ways
  (``cost.analytic`` prices them from ``top_k``; ``execute.experts`` runs them). Uniform routing
  moves ``top_k / |B|`` of a rank's tokens per peer, against the whole token set for a gather.

Either way the experts' weights are indexed by both (``(experts, experts_a2a)`` on their leading
axis: each rank keeps ``E / (|A| |B|)`` experts), so their gradients are reduced over the batch split
only; the router's weight is indexed by ``features`` only: replicated, its gradient partial over
every split (each rank back-propagates through its own experts' rows, of its own tokens).
"""

from __future__ import annotations

import dataclasses
import math

from shardplan.cost.routing import A2A
from shardplan.ir.graph import Dim, DimKind, Graph, Op, Operand, TensorSpec

KIND = "moe"


def _inside(op: Op, block: str) -> bool:
    return op.module is not None and (op.module == block or op.module.startswith(block + "."))


def fuse_block(graph: Graph, block: str) -> Graph:
    """``graph`` with the ops of MoE module ``block`` replaced by one ``moe`` op named ``block``."""
    from shardplan.capture.values import CaptureError

    idx = [i for i, op in enumerate(graph.ops) if _inside(op, block)]
    ops = [graph.ops[i] for i in idx]
    made = {o.tensor for op in ops for o in op.outputs}
    acts, params, seen = [], {}, set()
    for op in ops:
        for o in op.inputs:
            spec = graph.tensor(o.tensor)
            if spec.is_param:
                params.setdefault(o.tensor, o.axes)
            elif o.tensor not in made and o.tensor not in seen:
                seen.add(o.tensor)
                acts.append(o.tensor)
    outside = [op for i, op in enumerate(graph.ops) if i not in set(idx)]
    read_outside = {o.tensor for op in outside for o in op.inputs}
    read = {o.tensor for op in graph.ops for o in op.inputs}
    outs = [t for t in dict.fromkeys(o.tensor for op in ops for o in op.outputs)
            if t in read_outside or t not in read]
    if len(acts) != 1 or len(outs) != 1:
        raise CaptureError(f"mixture-of-experts block {block!r} reads {len(acts)} activations ({', '.join(acts)}) "
                           f"and gives {len(outs)} ({', '.join(outs)}); shardplan fuses blocks with one of each")
    x = graph.tensor(acts[0])
    grouped = [op for op in ops if "experts" in op.dim_names]
    e = grouped[0].dim("experts").size
    rows = grouped[0].dim("tokens").size
    if len(x.shape) not in (2, 3) or rows % (x.shape[0] * (x.shape[1] if len(x.shape) == 3 else 1)):
        raise CaptureError(f"mixture-of-experts block {block!r}: input {x.name!r} of shape {x.shape} is not "
                           f"(batch, seq, features) or (tokens, features) with {rows} routed rows")
    tokens = x.shape[0] * (x.shape[1] if len(x.shape) == 3 else 1)
    features = x.shape[-1]
    ffn = grouped[-1].dim("in_features").size  # the down projection reads the expert width
    dims = [Dim("batch", x.shape[0], DimKind.BATCH)]
    x_axes = [("batch",)]
    if len(x.shape) == 3:
        dims.append(Dim("seq", x.shape[1], DimKind.SEQUENCE, splittable=False))
        x_axes.append(("seq",))
    dims += [Dim("experts", e, DimKind.PARALLEL), Dim(A2A, e, DimKind.PARALLEL),
             Dim("features", features, splittable=False)]
    x_axes[0] = ("batch", A2A)  # all-to-all dispatch: each rank of its group holds its own tokens
    x_axes.append(("features",))
    inputs = [Operand(x.name, tuple(x_axes))]
    limited = {x.name: (0, x.shape[0])}  # the tokens split by batch x experts_a2a: whole samples per rank
    for name, axes in params.items():
        shape = graph.tensor(name).shape
        if any(name == o.tensor for op in grouped for o in op.inputs):
            axes = (("experts", A2A),) + ((),) * (len(shape) - 1)  # the experts' own weights
            limited[name] = (0, e)  # both splits of the experts together: whole experts per rank
        elif any(_inside(op, block) and op.module == name.rpartition(".")[0] for op in ops):
            # a weight of the block itself (the router): replicated, read along the features
            axes = tuple(("features",) if i == len(shape) - 1 and s == features else () for i, s in enumerate(shape))
        else:
            axes = ((),) * len(shape)  # a weight from outside folded in (a norm's scale)
        inputs.append(Operand(name, axes))
    out = graph.tensor(outs[0])
    if out.shape == x.shape:
        out_axes = tuple(x_axes)
    elif len(out.shape) == 2 and out.shape[-1] == features:
        # flattened tokens; the walk gives the scatter back (index_add) the rows of what it adds
        # (tokens x top-k), the block returns one row per token
        out = dataclasses.replace(out, shape=(tokens, features), split_limits=())
        out_axes = (tuple(a for ax in x_axes[:-1] for a in ax), ("features",))
    else:
        raise CaptureError(f"mixture-of-experts block {block!r} maps {x.shape} to {out.shape}; shardplan "
                           f"fuses blocks that return one row of {features} features per token")
    kept = sum(graph.tensor(o.tensor).nbytes for op in ops for o in op.outputs if o.tensor != outs[0])

    def total(key):
        return sum(op.attr(key, 0) for op in ops)

    attrs = {"dispatches": total("dispatches"), "folded_ops": total("folded_ops") + len(ops) - 1,
             "folded_bytes": total("folded_bytes"), "pw_ops": 0, "top_k": rows // tokens, "ffn": ffn,
             "grouped_flops": sum(op.flops for op in grouped),
             "pointwise_flops": sum(op.flops for op in ops if op.kind == "elementwise"),
             "kept_bytes": kept}
    for key in ("folded_pool_input_bytes", "folded_pool_bytes"):
        if total(key):
            attrs[key] = total(key)
    fused = Op(block, KIND, tuple(dims), tuple(inputs), (Operand(out.name, out_axes),),
               flops=sum(op.flops for op in ops), attrs=tuple(sorted(attrs.items())), module=block,
               layer=ops[0].layer)
    last = idx[-1]
    # the output is named after the block (``<block>:out``, as capture names every op's output)
    old_name, out = out.name, dataclasses.replace(out, name=f"{block}:out")
    fused = dataclasses.replace(fused, outputs=(Operand(out.name, out_axes),))

    def renamed(op: Op) -> Op:
        if all(o.tensor != old_name for o in op.inputs):
            return op
        return dataclasses.replace(op, inputs=tuple(Operand(out.name, o.axes) if o.tensor == old_name else o
                                                    for o in op.inputs))
    new_ops = [fused if i == last else renamed(op) for i, op in enumerate(graph.ops)
               if i == last or i not in set(idx)]
    internal = made - {old_name}
    limited[out.name] = (0, x.shape[0])
    tensors = tuple(_limited(out if t.name == old_name else t, limited) for t in graph.tensors
                    if t.name not in internal)
    return Graph(graph.name, tuple(new_ops), tensors, graph.meta)


def _limited(spec: TensorSpec, limits: dict) -> TensorSpec:
    """``spec`` with the split limit ``limits[spec.name] = (axis, n)`` merged into its own: the axis's
    split count must then divide ``n`` as well as any limit it had."""
    if spec.name not in limits:
        return spec
    axis, n = limits[spec.name]
    old = list(spec.split_limits) or [0] * len(spec.shape)
    old[axis] = math.gcd(old[axis], n) if old[axis] else n
    return dataclasses.replace(spec, split_limits=tuple(old))


def fuse(graph: Graph) -> Graph:
    """Every routed-experts block of ``graph`` fused into one op (``meta["local_blocks"]`` lists them):
    the module holding ops with an ``experts`` dim, e.g. Mixtral's ``model.layers.0.mlp``."""
    blocks = sorted({op.module.rsplit(".", 1)[0] for op in graph.ops
                     if "experts" in op.dim_names and op.module and "." in op.module})
    for block in blocks:
        graph = fuse_block(graph, block)
    if not blocks:
        return graph
    return dataclasses.replace(graph, meta=tuple(graph.meta) + (("local_blocks", tuple(blocks)),))


def measure_routing(graph: Graph, module, example_kwargs: dict) -> Graph:
    """``graph`` with each fused block's routing profile (attribute ``expert_shares``: the fraction of
    the (token, choice) rows each expert received; ``expert_rows``: the rows each sample of the
    batch sent each expert, for batch tiles), measured by one forward pass of ``module`` on
    ``example_kwargs`` without gradients. The cost model then prices the busiest expert group of
    that routing (``cost.routing``) instead of uniform routing's expectation. ``module`` must hold
    real weights (not the meta device) and be the module ``graph`` was captured from; a graph
    without mixture-of-experts blocks is returned as it is."""
    import torch

    from shardplan.capture.values import CaptureError

    blocks = dict(graph.meta).get("local_blocks", ())
    if not blocks:
        return graph
    if any(p.is_meta for p in module.parameters()):
        raise CaptureError("measure_routing needs the model's weights; this module is on the meta device")
    counts: dict[str, torch.Tensor] = {}
    handles = []
    for op in graph.ops:
        if op.kind != KIND or op.name not in blocks:
            continue
        block = op.name
        # the experts' module owns the weights with a leading experts axis (as execute.apply finds it)
        weight = next(o.tensor for o in op.inputs if o.axes and "experts" in o.axes[0])
        sub = module.get_submodule(weight.rpartition(".")[0])
        if not hasattr(sub, "num_experts"):
            raise CaptureError(f"mixture-of-experts block {block!r}: module {weight.rpartition('.')[0]!r} holds "
                               f"the experts' weights but has no num_experts")
        total = int(sub.num_experts)
        samples = op.dim("batch").size

        def hook(mod, args, kwargs, block=block, total=total, samples=samples):
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            rows = index.reshape(samples, -1).to(torch.int64).cpu()  # each sample's tokens' choices
            seen = torch.zeros(samples, total, dtype=torch.int64).scatter_add_(1, rows, torch.ones_like(rows))
            counts[block] = counts.get(block, 0) + seen
        handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            module(**example_kwargs)
    finally:
        for h in handles:
            h.remove()
    ops = []
    for op in graph.ops:
        if op.kind == KIND and op.name in counts:
            by_sample = counts[op.name]
            c = by_sample.sum(dim=0).to(torch.float64)
            attrs = dict(op.attrs)
            attrs["expert_shares"] = tuple(float(x) for x in (c / c.sum()).tolist())
            attrs["expert_rows"] = tuple(tuple(int(x) for x in r) for r in by_sample.tolist())
            op = dataclasses.replace(op, attrs=tuple(sorted(attrs.items())))
        ops.append(op)
    return dataclasses.replace(graph, ops=tuple(ops))
