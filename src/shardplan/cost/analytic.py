"""The analytic cost model: seconds per training step on a given cluster.

Every formula, its units and its source are written out in ``docs/cost_model.md``; in short, for an
op under a configuration ``c`` (split factor per iteration dim) on ``P = prod(c)`` devices:

* compute (s) = max(F / (peak * efficiency), B / memory_bandwidth)  -- the roofline (Williams et
  al., CACM 2009), with F = training FLOPs of one device's shard (forward x 3 for contractions:
  forward plus the two backward GEMMs; x 2 for other ops) and B = bytes of its operand tiles read
  and written (x 3 / x 2 likewise). The cheap ops folded into an op, the loss, the optimizer's
  update and gradient packing are memory-bound kernels, priced at ``Device.kernel_bandwidth``
  (the in-step ``elementwise_bandwidth`` when calibrated, else ``memory_bandwidth``).
* intra-op communication: the *missing-dims rule*. A device's shard of an operand is computed (or
  its gradient accumulated) by every device that differs from it only in the split dims the operand
  does not index. So the op all-reduces
    - its output over the split dims the output lacks (partial sums of a split reduction dim),
    - the gradient of every input that needs one over the split dims that input lacks (for a weight:
      the data-parallel gradient all-reduce over replicas; for an activation: the partial gradient
      when an output-only dim is split, as in Megatron's column-parallel layer),
  each a hierarchical alpha-beta all-reduce (``cluster.collective_seconds``) of the operand's tile.
  Plus halo exchange for split spatial dims of conv and pool, statistics all-reduces for a split
  normalised or softmax axis, and per-time-step collectives for a split LSTM hidden dim.
* edges: redistribution between producer and consumer layouts over the lowest network level
  spanning both ops: forward, the bytes a consumer device lacks (PaSE's tile rule); backward, the
  bytes of the gradient a producer device lacks; plus the device's ``redistribute_overhead`` per
  direction that changes the layout.
* memory per device (bytes): parameter tiles x (weight + gradient + optimizer states) plus the
  activation tiles an op keeps for the backward pass (its output and any graph input it reads).
* per plan, not per op (``cost.step``: ``sync_waits``, ``step_seconds``): ranks wait for their
  slowest peer at every sync point, ``sync_jitter x sqrt(compute since the previous one)``; the
  predicted step swaps these for the per-op ``sync_stretch`` that the search adds up.

``node_cost_items`` returns these terms itemised (:class:`CostItem`: stream, forward share, on the
critical path or not) and ``node_costs`` adds them, so the event simulator (``shardplan.simulate``)
and the cost tables use one set of formulas.

Device ranks are laid out with the op's non-batch dims innermost, so tensor-parallel groups stay
inside a node and data-parallel groups cross nodes (Megatron-LM's placement, Narayanan et al. 2021).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardplan.cluster.model import Cluster, collective_seconds, curve_factor, gemm_factor
from shardplan.cluster.mesh import default_mesh
from shardplan.cost.configs import ConfigSpace, operand_layouts
from shardplan.cost.moves import gathered_words, inner_copy_words, placed_words
from shardplan.cost.pase import redistribution_words
from shardplan.cost.routing import A2A, block_load, token_all_to_all
from shardplan.cost.tables import NodeCosts
from shardplan.ir.graph import DimKind, Graph, GraphError, Op, TensorSpec

CONTRACTIONS = frozenset({"conv", "fc", "einsum", "lstm", "moe"})
FREE = frozenset({"concat", "stack", "unstack", "reshape", "transpose"})
KNOWN = CONTRACTIONS | FREE | {"embedding", "pool", "norm", "softmax", "softmax_xent", "reduce_mean",
                               "elementwise"}
GRAD_BUCKET_BYTES = 25.0 * 1024 * 1024
"""Bytes per weight-gradient all-reduce bucket: DDP's default (``bucket_cap_mb=25``), and what
``execute.gradients.reduce_gradients`` packs."""
PER_ITERATION = frozenset({"optimizer_update", "grad_bucket_pack"})
"""Cost items paid once per training iteration, after the last backward pass: a pipeline pays them once,
not once per microbatch."""
OPTIMIZER_STATES = {"adam": 2, "sgd_momentum": 1, "sgd": 0}
"""Optimizer state tensors per parameter, each of the parameter's size (Adam: first and second moment)."""


def update_seconds(device, optimizer: str, tile_bytes):
    """Seconds of one optimizer step on a parameter tile of ``tile_bytes`` (a number or an array):
    memory bound, it reads the weight, its gradient and the ``s`` optimizer states and writes the
    weight and the states back, ``(3 + 2 s) x tile`` bytes at ``kernel_bandwidth`` (Adam, s = 2: reads
    p, g, m, v and writes p, m, v as ``torch.optim.Adam(fused=True)`` does; plain SGD: 3 x), plus one
    ``op_overhead`` (a loop over parameters; a multi-tensor kernel would pay it once for all). Its
    FLOPs (about 10 per element for Adam) are far below the memory-bound time on any device."""
    return (3.0 + 2.0 * OPTIMIZER_STATES[optimizer]) * tile_bytes / device.kernel_bandwidth + device.op_overhead


@dataclass(frozen=True)
class CostItem:
    """One term of an op's time per configuration (seconds, arrays over the K configurations).

    ``stream``: "compute" or "comm". ``critical``: False for work that may overlap the rest of the
    backward pass (the weight-gradient all-reduce, as DDP/FSDP buckets run it); everything else
    delays the next op. ``seconds`` is the term for both passes; ``fwd`` the part of it in the
    forward pass, the rest (``bwd``) runs in the backward pass.
    """

    name: str
    stream: str
    critical: bool
    seconds: np.ndarray
    fwd: np.ndarray
    tensor: str | None = None

    @property
    def bwd(self) -> np.ndarray:
        return self.seconds - self.fwd


@dataclass(frozen=True)
class MemoryItem:
    """Bytes per device one op keeps for one operand. ``kind``: "parameter" (weight + gradient +
    optimizer states, resident all the time; ``tile_bytes`` is the weight tile alone) or
    "activation" (an output or graph input kept from the forward to the backward pass)."""

    kind: str
    tensor: str
    nbytes: np.ndarray
    tile_bytes: np.ndarray


@dataclass(frozen=True)
class AnalyticCostModel:
    cluster: Cluster
    optimizer: str = "adam"
    name: str = "analytic"
    unit: str = "seconds"
    dedup_edges: bool = False
    grad_bucket_bytes: float | None = GRAD_BUCKET_BYTES
    """Weight gradients are all-reduced in buckets of this many bytes (DDP, FSDP and ``shardplan run``
    do), so each pays the latency pro rata, ``tile / grad_bucket_bytes`` of a collective's; None: one
    all-reduce per gradient, each paying the whole latency. A bucketed gradient is first copied into
    its flat buffer (``grad_bucket_pack``: read and written once at memory bandwidth, after the
    backward pass; ``shardplan run`` and DDP without ``gradient_as_bucket_view`` both copy)."""
    exact_tiles: bool = True
    """Edges priced by the blocks each rank holds on the mesh the runtime lays the plan on
    (``placed_words``); False: PaSE's rule, which assumes every rank's new tile overlaps its old one
    as far as the split factors allow."""
    expert_imbalance: bool = True
    """A mixture-of-experts block split over its experts is priced at its busiest expert group's rows
    (``cost.routing``: the op's measured routing profile, else uniform routing's expectation): its
    expert GEMMs, inner activations and token all-to-alls; False: every group gets the mean."""
    mesh: tuple[int, ...] | None = None
    """The device mesh plans are made for (``--mesh 8x8``: 8 nodes of 8 GPUs, say): only configurations
    that lay on it are searched (``ConfigSpace.mesh``), edges are priced by the blocks ranks hold on
    it, and the runtime runs the plan on it. None: the mesh of the device count's prime factors, which
    takes every configuration, and a coarser one at run time where the blocks are the same."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZER_STATES)}")

    def config_space(self, graph: Graph, devices: int) -> ConfigSpace:
        if devices > self.cluster.num_devices:
            raise ValueError(f"{devices} devices requested but cluster {self.cluster.name!r} has "
                             f"{self.cluster.num_devices}")
        if self.mesh is not None and math.prod(self.mesh) != devices:
            raise ValueError(f"mesh {'x'.join(map(str, self.mesh))} holds {math.prod(self.mesh)} devices; "
                             f"planning for {devices}")
        return ConfigSpace(devices=devices, cutoff=1, product="divides", mesh=self.mesh)

    def frozen_dims(self, op: Op) -> frozenset[str]:
        if op.kind == "lstm":
            return frozenset({"seq"})  # the recurrence runs step after step
        return frozenset()

    # -- helpers -----------------------------------------------------------------------------------
    def strides(self, op: Op, configs: np.ndarray) -> np.ndarray:
        """Rank distance between neighbours along each dim: non-batch dims innermost, (K, n)."""
        order = [i for i, d in enumerate(op.dims) if d.kind is not DimKind.BATCH]
        order += [i for i, d in enumerate(op.dims) if d.kind is DimKind.BATCH]
        strides = np.ones(configs.shape, dtype=np.float64)
        acc = np.ones(len(configs), dtype=np.float64)
        for i in order:
            strides[:, i] = acc
            acc = acc * configs[:, i]
        return strides

    def group_levels(self, configs: np.ndarray, strides: np.ndarray, dims: list[int]) -> np.ndarray:
        """Members per network level of the group spanned by ``dims``: (K, levels)."""
        q = np.ones((len(configs), len(self.cluster.levels)))
        for i in dims:
            q = q * self.cluster.per_level(configs[:, i].astype(np.float64), strides[:, i])
        return q

    def tile_bytes(self, graph: Graph, op: Op, configs: np.ndarray, operand) -> np.ndarray:
        """Bytes per device of the block of ``operand`` each configuration gives it, at the extents
        the op reads (``Graph.read_spec``: a pooled map's, not the tensor's)."""
        spec = graph.read_spec(operand)
        layout = operand_layouts(op, configs, operand.axes).astype(np.float64)
        return np.prod(np.array(spec.shape, dtype=np.float64) / layout, axis=1) * spec.dtype_bytes

    # -- node costs ----------------------------------------------------------------------------------
    def memory_items(self, graph: Graph, op: Op, configs: np.ndarray) -> list[MemoryItem]:
        """Bytes per device of every tile ``op`` keeps, one item per operand, in the order
        ``node_costs`` sums them (its ``memory`` is their sum)."""
        operands = list(op.inputs) + list(op.outputs)
        items = []
        for j, o in enumerate(operands):
            t = self.tile_bytes(graph, op, configs, o)
            if j < len(op.inputs):
                spec = graph.tensor(o.tensor)
                if spec.is_param:  # weight, gradient, optimizer states: resident all the time
                    if not self.owns(graph, op, o.tensor):
                        continue  # a tied weight is held once, placed as its first reader has it
                    items.append(MemoryItem("parameter", o.tensor, t * (2 + OPTIMIZER_STATES[self.optimizer]),
                                            t))
                elif graph.producer(o.tensor) is None:  # a graph input kept for the backward pass
                    items.append(MemoryItem("activation", o.tensor, t, t))
            else:  # an output: an activation kept for the backward pass
                items.append(MemoryItem("activation", o.tensor, t, t))
        if op.attr("kept_bytes"):  # a fused block's inner activations (``capture.moe``), on the busiest device
            c = configs.astype(np.float64)
            t = op.attr("kept_bytes") * self.expert_load(op, c) / np.prod(c, axis=1)
            items.append(MemoryItem("activation", op.name, t, t))
        return items

    def node_cost_items(self, graph: Graph, op: Op, configs: np.ndarray) -> list[CostItem]:
        """The terms of ``op``'s time, itemised: every formula of the module doc as one
        :class:`CostItem` with its stream, pass split and whether it is on the critical path.

        ``node_costs`` adds these items (compute items into ``compute``, comm items into ``comm``, in
        this order), so the cost tables and the event simulator (``shardplan.simulate``) share one
        source of truth. Free ops (views, concatenations) have no items.
        """
        if op.kind not in KNOWN:
            raise GraphError(f"op {op.name!r}: the analytic cost model has no formula for kind {op.kind!r}")
        if op.kind in FREE:
            return []
        c = configs.astype(np.float64)
        procs = np.prod(c, axis=1)
        strides = self.strides(op, configs)
        dev = self.cluster.device
        operands = list(op.inputs) + list(op.outputs)
        tiles = [self.tile_bytes(graph, op, configs, o) for o in operands]

        factor = 3.0 if op.kind in CONTRACTIONS else 2.0
        # a contraction that reads only graph inputs and weights (a first layer) computes no input
        # gradient: forward plus the weight-gradient GEMM
        passes = factor - 1.0 if op.kind in CONTRACTIONS and self._reads_only_inputs(graph, op) else factor
        flops = 0.0 if op.kind == "embedding" else op.flops  # a lookup is a gather, not a GEMM
        if op.kind == "moe":  # the busiest expert group's GEMMs (cost.routing)
            flops = flops + (self.expert_load(op, c) - 1.0) * op.attr("grouped_flops", 0.0)
        rate = dev.peak_flops * dev.efficiency * (dev.conv_efficiency if op.kind == "conv" else 1.0)
        if dev.gemm_efficiency and op.kind in ("fc", "einsum", "moe"):
            rate = rate * gemm_factor(dev, self.smallest_gemm_dim(op, c))
        if op.kind == "conv" and (dev.conv_reduction_efficiency or dev.conv_rows_efficiency):
            rows, reduction = self.conv_gemm_dims(op, c)
            rate = rate * curve_factor(dev.conv_reduction_efficiency, reduction) * curve_factor(
                dev.conv_rows_efficiency, rows)
        compute = np.maximum(passes * flops / procs / rate,
                             passes * sum(tiles) / dev.memory_bandwidth) + self._dispatch(op, factor, procs)
        # forward is one of the passes (contractions: 1 GEMM of 3, or of 2 for a first layer; others: 1 of 2)
        items = [CostItem("compute", "compute", True, compute, compute / passes)]
        n_folded = op.attr("folded_ops", 0)
        if n_folded:
            folded, fwd = self._folded(op, procs)
            items.append(CostItem("folded", "compute", True, folded, np.minimum(fwd, folded)))

        split = c > 1
        index = {n: i for i, n in enumerate(op.dim_names)}
        skip_rule = op.kind == "lstm"
        acts = [o for o in op.inputs if not graph.tensor(o.tensor).is_param]
        after_backward: list[CostItem] = []  # work after the backward pass, not stretched by a sync point
        for j, (o, t) in enumerate(zip(operands, tiles)):
            is_output = j >= len(op.inputs)
            is_param = False
            if not is_output:
                spec = graph.tensor(o.tensor)
                is_param = spec.is_param
                needs_grad = spec.is_param or graph.producer(o.tensor) is not None
                if not needs_grad or (skip_rule and not spec.is_param):
                    continue
            elif skip_rule:
                continue
            present = set(o.dims())
            missing = [i for i, n in enumerate(op.dim_names) if n not in present]
            if is_param and not present and acts:
                # a parameter of a cheap op folded into this one (a norm's scale, captured graphs):
                # it acts on the op's input before the op, whose gradient is reduced at the op, so
                # its own gradient is partial only over the split dims of that input (the batch)
                seen = set(acts[0].dims()) | ({"experts"} if op.kind == "moe" else set())
                # (in a mixture-of-experts block the gradient reaching the norm is partial over
                # the gathered experts split too: each rank back-propagates its own experts)
                missing = [i for i, n in enumerate(op.dim_names) if n in seen]
            elif is_param and not any(op.dims[op.dim_index(n)].kind is DimKind.REDUCTION for n in present):
                # a parameter outside the contraction (a bias: added to the reduced result) has a
                # whole gradient on every device of a reduction split; only other splits make it partial
                missing = [i for i in missing if op.dims[i].kind is not DimKind.REDUCTION]
            if not missing:
                continue
            q = self.group_levels(configs, strides, missing)
            active = np.any(split[:, missing], axis=1)
            share = t / self.grad_bucket_bytes if is_param and self.grad_bucket_bytes else 1.0
            seconds = np.where(active, collective_seconds(self.cluster, "all_reduce", t, q, share), 0.0)
            if is_output:  # forward partial sums
                items.append(CostItem("output_allreduce", "comm", True, seconds, seconds, o.tensor))
            elif is_param:  # the weight gradient: overlaps the rest of the backward pass (DDP buckets)
                items.append(CostItem("weight_grad_allreduce", "comm", False, seconds, np.zeros_like(seconds),
                                      o.tensor))
                if self.grad_bucket_bytes:  # copied into its flat bucket first: read + write at memory bandwidth
                    pack = np.where(active, 2.0 * t / dev.kernel_bandwidth, 0.0)
                    after_backward.append(CostItem("grad_bucket_pack", "compute", True, pack, np.zeros_like(pack),
                                                   o.tensor))
            else:  # the input (activation) gradient: the producer's backward waits for it
                items.append(CostItem("input_grad_allreduce", "comm", True, seconds, np.zeros_like(seconds),
                                      o.tensor))

        if op.kind in ("conv", "pool"):
            fwd = 0.5 * self._halo(graph, op, configs, c, strides)
            # a model input (the image) has no gradient whose halo rows go back
            both = fwd if graph.producer(op.inputs[0].tensor) is None else 2.0 * fwd
            items.append(CostItem("halo", "comm", True, both, fwd, op.inputs[0].tensor))
        if op.kind in ("norm", "softmax", "softmax_xent"):
            a = index[op.attr("axis")]
            if op.dims[a].kind is not DimKind.BATCH:  # batch norm keeps per-device statistics
                rows = np.prod(np.array([d.size for d in op.dims], dtype=np.float64) / c, axis=1) / (
                    op.dims[a].size / c[:, a])
                q = self.group_levels(configs, strides, [a])
                # two statistics forward (max/sum or mean/var), two backward
                stats = np.where(split[:, a], 4.0 * collective_seconds(
                    self.cluster, "all_reduce", rows * graph.tensor(op.outputs[0].tensor).dtype_bytes, q), 0.0)
                items.append(CostItem("statistics_allreduce", "comm", True, stats, 0.5 * stats))
        if op.kind == "moe" and A2A in index:
            moves, fwd = token_all_to_all(self, graph, op, configs, c, strides)
            items.append(CostItem("token_all_to_all", "comm", True, moves, fwd, op.inputs[0].tensor))
        if op.kind == "lstm":
            steps = self._lstm_steps(graph, op, configs, c, strides)
            items.append(CostItem("lstm_step_collectives", "comm", True, steps, 0.5 * steps))
        loss = graph.hint("loss_output")
        for o, t in zip(op.outputs, tiles[len(op.inputs):]):
            if o.tensor == loss:
                items.extend(self._loss_items(graph, op, o, t, configs, strides, split))
        if dev.sync_stretch:
            items.append(self._sync_wait(items, len(configs)))
        items.extend(after_backward)
        params = [t for o, t in zip(op.inputs, tiles) if graph.tensor(o.tensor).is_param
                  and self.owns(graph, op, o.tensor)]
        if params:  # after the backward pass, so not stretched by a sync point
            update = sum(update_seconds(dev, self.optimizer, t) for t in params)
            items.append(CostItem("optimizer_update", "compute", True, update, np.zeros(len(configs))))
        return items

    def _loss_items(self, graph: Graph, op: Op, out, tile: np.ndarray, configs: np.ndarray, strides,
                    split: np.ndarray) -> list[CostItem]:
        """The training step's loss on a captured graph's output (``graph.hint("loss_output")``), as
        ``shardplan run`` computes it: the output gathered whole on every rank (an all-gather over the
        split dims it has; dims it lacks were summed by its forward all-reduce), then the loss,
        ``mean(y^2)``, on the whole tensor: read and written about 3 times forward and 3 times
        backward at memory bandwidth, 2 aten calls per pass. The gather's backward is a local slice."""
        present = [i for i, n in enumerate(op.dim_names) if n in set(out.dims())]
        q = self.group_levels(configs, strides, present)
        members = np.prod(np.where(split[:, present], configs[:, present], 1).astype(np.float64), axis=1)
        whole = graph.tensor(out.tensor).nbytes
        gather = np.where(members > 1, collective_seconds(self.cluster, "all_gather", tile * members, q), 0.0)
        dev = self.cluster.device
        work = np.full(len(configs), 6.0 * whole / dev.kernel_bandwidth + 3.0 * 2 * dev.op_overhead)
        return [CostItem("loss_gather", "comm", True, gather, gather, out.tensor),
                CostItem("loss", "compute", True, work, 0.5 * work)]

    def expert_load(self, op: Op, c: np.ndarray) -> np.ndarray:
        """(K,) rows of a ``moe`` op's busiest expert group over the mean (``cost.routing.block_load``);
        1 for other ops and with ``expert_imbalance`` off."""
        if op.kind != "moe" or not self.expert_imbalance:
            return np.ones(len(c))
        return block_load(op, c)

    def _sync_wait(self, items: list[CostItem], K: int) -> CostItem:
        """Waiting for the slowest peer at a sync point: ``sync_stretch x`` the op's compute in each pass
        that ends in a collective on the critical path (the weight-gradient all-reduce is none: it
        overlaps the rest of the backward pass)."""
        comm_fwd, comm_bwd, work_fwd, work_bwd = (np.zeros(K) for _ in range(4))
        for it in items:
            if it.stream == "comm" and it.critical:
                comm_fwd, comm_bwd = comm_fwd + it.fwd, comm_bwd + it.bwd
            elif it.stream == "compute":
                work_fwd, work_bwd = work_fwd + it.fwd, work_bwd + it.bwd
        rho = self.cluster.device.sync_stretch
        fwd = np.where(comm_fwd > 0, rho * work_fwd, 0.0)
        return CostItem("sync_wait", "compute", True, fwd + np.where(comm_bwd > 0, rho * work_bwd, 0.0), fwd)

    def node_costs(self, graph: Graph, op: Op, configs: np.ndarray) -> NodeCosts:
        """Per-configuration compute, comm and memory of ``op``: the sums of ``node_cost_items`` and
        ``memory_items``."""
        items = self.node_cost_items(graph, op, configs)
        K = len(configs)
        memory = np.zeros(K)
        for m in self.memory_items(graph, op, configs):
            memory += m.nbytes
        if not items:
            return NodeCosts(total=np.zeros(K), compute=np.zeros(K), comm=np.zeros(K), memory=memory)
        compute = None
        comm = np.zeros(K)
        for it in items:
            if it.stream == "compute":
                compute = it.seconds if compute is None else compute + it.seconds
            else:
                comm += it.seconds
        return NodeCosts(total=compute + comm, compute=compute, comm=comm, memory=memory)

    @staticmethod
    def owns(graph: Graph, op: Op, param: str) -> bool:
        """Whether ``op`` is the first reader of ``param``: the op whose memory holds it and whose
        time includes its optimizer step. A tied weight (GPT's token embedding, read by the lookup
        and the head) is held and stepped once, placed as its first reader has it (``execute.apply``)."""
        return graph.ops[graph.first_reader(param)].name == op.name

    @staticmethod
    def smallest_gemm_dim(op: Op, configs: np.ndarray) -> np.ndarray:
        """Smallest of a matrix product's local (m, n, k) per configuration (K,): for an fc, n is
        ``out_features``, k ``in_features`` and m every other dim but ``experts``; for an einsum, n is
        ``cols``, k ``inner`` and m the row dim (batch and heads are a batch of products); for a fused
        mixture-of-experts block, m is one expert's rows (local tokens x top-k / experts), n and k
        the features and the expert width."""
        local = {d.name: d.size / configs[:, i] for i, d in enumerate(op.dims)}
        if op.kind == "moe":  # each expert's GEMMs: its routed rows of the local tokens, features, width
            rows = local["batch"] * local.get("seq", 1.0) * op.attr("top_k", 1) / op.dim("experts").size
            return np.minimum(np.minimum(rows, op.dim("features").size), op.attr("ffn", 1)) * np.ones(len(configs))
        if op.kind == "fc":
            n, k = local.get("out_features", 1.0), local.get("in_features", 1.0)
            m = np.ones(len(configs))
            for name, v in local.items():
                if name not in ("out_features", "in_features", "experts"):
                    m = m * v
        else:
            n, k = local.get("cols", 1.0), local.get("inner", 1.0)
            m = local.get("seq", local.get("rows", 1.0))
        return np.minimum(np.minimum(m, n), k) * np.ones(len(configs))

    @staticmethod
    def _reads_only_inputs(graph: Graph, op: Op) -> bool:
        """True when every input of ``op`` is a parameter or a graph input (training data, which needs
        no gradient): its backward pass computes the weight gradients only."""
        return all(graph.tensor(o.tensor).is_param or graph.producer(o.tensor) is None for o in op.inputs)

    @staticmethod
    def conv_gemm_dims(op: Op, configs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A convolution's local im2col GEMM dims per configuration: rows ``M`` (the product of its
        batch and spatial dims) and reduction length ``K`` (in channels x kernel height x width, its
        reduction dims), each (K,) after the configuration's splits."""
        rows = np.ones(len(configs))
        reduction = np.ones(len(configs))
        for i, d in enumerate(op.dims):
            if d.kind in (DimKind.BATCH, DimKind.SPATIAL):
                rows = rows * (d.size / configs[:, i])
            elif d.kind is DimKind.REDUCTION:
                reduction = reduction * (d.size / configs[:, i])
        return rows, reduction

    def _dispatch(self, op: Op, factor: float, procs: np.ndarray) -> np.ndarray:
        """Host-side dispatch of ``op`` per step and configuration: ``factor`` passes of ``op_overhead``
        for a hand-built op; for a captured op, ``3 x dispatches x op_overhead`` (every exported aten
        call the op stands for, its folded ops and views included, once forward and about twice
        backward). A configuration that splits the op pays ``split_op_overhead`` per call instead,
        when the device has one."""
        dev = self.cluster.device
        d = op.attr("dispatches")
        calls = factor if d is None else 3.0 * d
        split = dev.op_overhead if dev.split_op_overhead is None else dev.split_op_overhead
        return calls * np.where(procs > 1, split, dev.op_overhead)

    def _folded(self, op: Op, procs: np.ndarray) -> tuple:
        """(seconds, forward seconds) of the cheap ops capture folded into ``op`` (norms, rotary,
        activations, casts, pools): each reads and writes its output once forward and twice backward
        (6 x ``folded_bytes`` of traffic, shared by the op's devices; forward 2 of the 6), and costs two
        dispatches (forward and backward) of ``op_overhead`` unless the op counts its ``dispatches``
        (then they are in :meth:`_dispatch`). Pooling kernels, when the device has a measured
        ``pool_bandwidth``, take ``folded_pool_input_bytes / P / pool_bandwidth`` instead (a CPU max
        pool runs far below the copy bandwidth), a third of it forward."""
        n, nbytes = op.attr("folded_ops", 0), op.attr("folded_bytes", 0)
        if not n:
            return 0.0, 0.0
        dev = self.cluster.device
        per_dispatch = 0.0 if op.attr("dispatches") is not None else dev.op_overhead
        pool = 0.0
        if dev.pool_bandwidth and op.attr("folded_pool_input_bytes", 0):
            nbytes = nbytes - op.attr("folded_pool_bytes", 0)
            pool = op.attr("folded_pool_input_bytes") / procs / dev.pool_bandwidth
        traffic = nbytes / procs / dev.kernel_bandwidth
        return 6.0 * traffic + 2.0 * n * per_dispatch + pool, 2.0 * traffic + n * per_dispatch + pool / 3.0

    def _halo(self, graph: Graph, op: Op, configs, c, strides) -> np.ndarray:
        """Ghost rows of the input from both neighbours, forward and backward, per split spatial dim."""
        r, s = op.attr("kernel")
        x = op.inputs[0]
        in_tile = self.tile_bytes(graph, op, configs, x)
        spec = graph.read_spec(x)
        layout = operand_layouts(op, configs, x.axes).astype(np.float64)
        out = np.zeros(len(configs))
        for axis, k in ((2, r), (3, s)):
            if not x.axes[axis]:
                continue  # this input axis is never split by the op
            rows = spec.shape[axis] / layout[:, axis]
            halo = in_tile / rows * max(k - 1, 0)  # (k - 1) ghost rows in all, split over two sides
            dim = op.dim_index(x.axes[axis][0])
            level = self.cluster.level_of_span(strides[:, dim] * 2)
            bw = np.array([lv.bandwidth for lv in self.cluster.levels])[level]
            lat = np.array([lv.latency for lv in self.cluster.levels])[level]
            out += np.where(layout[:, axis] > 1, 2.0 * (2 * lat + halo / bw), 0.0)
        return out

    def _lstm_steps(self, graph: Graph, op: Op, configs, c, strides) -> np.ndarray:
        """Each layer and time step: all-gather h over a split hidden_out, all-reduce over split hidden_in."""
        i = {n: op.dim_index(n) for n in ("layers", "seq", "batch", "hidden_out", "hidden_in")}
        sizes = {n: op.dims[j].size for n, j in i.items()}
        dtype = graph.tensor(op.outputs[0].tensor).dtype_bytes
        steps = sizes["layers"] * sizes["seq"] / c[:, i["layers"]]
        b = sizes["batch"] / c[:, i["batch"]]
        gathered = b * sizes["hidden_out"] * dtype
        ag = collective_seconds(self.cluster, "all_gather", gathered,
                                self.group_levels(configs, strides, [i["hidden_out"]]))
        partial = b * 4 * sizes["hidden_out"] / c[:, i["hidden_out"]] * dtype
        ar = collective_seconds(self.cluster, "all_reduce", partial,
                                self.group_levels(configs, strides, [i["hidden_in"]]))
        per_step = np.where(c[:, i["hidden_out"]] > 1, ag, 0.0) + np.where(c[:, i["hidden_in"]] > 1, ar, 0.0)
        return 2.0 * steps * per_step  # forward and backward

    # -- edge costs ----------------------------------------------------------------------------------
    def edge_mesh(self, devices: int) -> tuple[int, ...] | None:
        """The mesh edges are priced on (``placed_words``): the model's ``mesh`` when given, which the
        runtime then runs the plan on; else the mesh of ``devices``' prime factors, which takes every
        configuration and which the runtime lays a plan on, or a coarser one with the same blocks
        (``execute.apply.choose_mesh``); None with ``exact_tiles`` off (PaSE's rule)."""
        if not self.exact_tiles:
            return None
        return tuple(self.mesh) if self.mesh is not None else default_mesh(devices)

    def edge_bytes(self, tensor: TensorSpec, src_layouts: np.ndarray,
                   dst_layouts: np.ndarray, mesh: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) bytes one device receives when a tensor moves between every pair of
        layouts (``(L_src, L_dst)`` arrays): the rules ``edge_costs`` prices. With ``mesh``, the layouts
        are placed (``cluster.mesh.placed_layouts``) and the busiest device's bytes are exact
        (``placed_words``); without, PaSE's rule of best overlap. A pair with no byte in a direction is
        a local cut or no change there: no collective, so no sync point either."""
        n = len(tensor.shape)
        src, dst = src_layouts[:, :n], dst_layouts[:, :n]
        if mesh is not None:
            fwd = placed_words(tensor.shape, mesh, src_layouts, dst_layouts) * tensor.dtype_bytes
            bwd = placed_words(tensor.shape, mesh, dst_layouts, src_layouts).T * tensor.dtype_bytes
        else:
            fwd = redistribution_words(tensor.shape, src, dst) * tensor.dtype_bytes
            bwd = redistribution_words(tensor.shape, dst, src).T * tensor.dtype_bytes
        fwd = np.where((src == 1).all(axis=1)[:, None], 0.0, fwd)  # whole -> split: a local cut
        bwd = np.where((dst == 1).all(axis=1)[None, :], 0.0, bwd)  # the gradient comes back whole
        if self.cluster.device.all_to_all_by_gather:
            fwd = np.maximum(fwd, gathered_words(tensor.shape, src, dst) * tensor.dtype_bytes)
            bwd = np.maximum(bwd, gathered_words(tensor.shape, dst, src).T * tensor.dtype_bytes)
        return fwd, bwd

    def edge_costs(self, graph: Graph, tensor: TensorSpec, src_layouts: np.ndarray,
                   dst_layouts: np.ndarray) -> np.ndarray:
        """Seconds to move a tensor between every pair of layouts and its gradient back (the first of
        ``edge_prices``)."""
        return self.edge_prices(graph, tensor, src_layouts, dst_layouts)[0]

    def edge_prices(self, graph: Graph, tensor: TensorSpec, src_layouts: np.ndarray,
                    dst_layouts: np.ndarray, mesh: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, sync codes) of every pair of layouts, both ``(L_src, L_dst)``; the codes say which
        directions are collectives: bit 0 (1) the forward move, bit 1 (2) the gradient's move back.
        Only a collective is a sync point of the jitter walk (``cost.step``); a cut, its copies and
        DTensor's host work are local.

        Seconds to move a tensor between every pair of layouts and its gradient back: forward, what
        a consumer device lacks of its tile; backward, what a producer device lacks of the gradient's
        tile (both by PaSE's rule, ``redistribution_words``), except that a whole tensor is held by
        every device (the runtime replicates an unsplit op), so cutting a split out of it moves no
        byte, and that a runtime without an all-to-all (``Device.all_to_all_by_gather``) gathers
        what a change of split dim leaves (``gathered_words``); each move that carries bytes pays
        the level's ``move_latency`` and its bytes at ``move_bandwidth`` (the one-way collectives'
        rates, ``gather_latency`` and ``gather_bandwidth`` when calibrated), and each direction that changes the layout the device's
        ``redistribute_overhead``, and each gather or cut along an inner dim its local copy
        (``inner_copy_words``, read and written at ``Device.kernel_bandwidth``; docs/cost_model.md,
        *Redistribution on edges*)."""
        fwd, bwd = self.edge_bytes(tensor, src_layouts, dst_layouts, mesh)
        changed = (src_layouts[:, None, :] != dst_layouts[None, :, :]).any(axis=2)  # factors or blocks
        n = len(tensor.shape)
        src_layouts, dst_layouts = src_layouts[:, :n], dst_layouts[:, :n]
        span = np.maximum(np.prod(src_layouts, axis=1)[:, None], np.prod(dst_layouts, axis=1)[None, :])
        level = self.cluster.level_of_span(span)
        bw = np.array([lv.move_bandwidth for lv in self.cluster.levels])[level]
        lat = np.array([lv.move_latency for lv in self.cluster.levels])[level]
        moves = np.where(fwd > 0, lat + fwd / bw, 0.0) + np.where(bwd > 0, lat + bwd / bw, 0.0)
        # concatenations after inner gathers and copies of inner cuts, both ways: read + write each
        copies = (inner_copy_words(tensor.shape, src_layouts, dst_layouts)
                  + inner_copy_words(tensor.shape, dst_layouts, src_layouts).T) * tensor.dtype_bytes
        seconds = (moves + 2.0 * copies / self.cluster.device.kernel_bandwidth
                   + np.where(changed, 2.0 * self.cluster.device.redistribute_overhead, 0.0))
        return seconds, (fwd > 0).astype(np.uint8) | ((bwd > 0).astype(np.uint8) << 1)
