"""The analytic cost model: seconds per training step on a given cluster.

Every formula, its units and its source are written out in ``docs/cost_model.md``; in short, for an
op under a configuration ``c`` (split factor per iteration dim) on ``P = prod(c)`` devices:

* compute (s) = max(F / (peak * efficiency), B / memory_bandwidth)  -- the roofline (Williams et
  al., CACM 2009), with F = training FLOPs of one device's shard (forward x 3 for contractions:
  forward plus the two backward GEMMs; x 2 for other ops) and B = bytes of its operand tiles read
  and written (x 3 / x 2 likewise).
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
* edges: redistribution between producer and consumer layouts, forward and backward: the bytes a
  consumer device lacks (PaSE's tile rule) over the lowest network level spanning both ops.
* memory per device (bytes): parameter tiles x (weight + gradient + optimizer states) plus the
  activation tiles an op keeps for the backward pass (its output and any graph input it reads).

Device ranks are laid out with the op's non-batch dims innermost, so tensor-parallel groups stay
inside a node and data-parallel groups cross nodes (Megatron-LM's placement, Narayanan et al. 2021).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardplan.cluster.model import Cluster, collective_seconds
from shardplan.cost.configs import ConfigSpace, operand_layouts
from shardplan.cost.pase import redistribution_words
from shardplan.cost.tables import NodeCosts
from shardplan.ir.graph import DimKind, Graph, GraphError, Op, TensorSpec

CONTRACTIONS = frozenset({"conv", "fc", "einsum", "lstm"})
FREE = frozenset({"concat", "stack", "unstack", "reshape", "transpose"})
KNOWN = CONTRACTIONS | FREE | {"embedding", "pool", "norm", "softmax", "softmax_xent", "reduce_mean",
                               "elementwise"}
OPTIMIZER_STATES = {"adam": 2, "sgd_momentum": 1, "sgd": 0}
"""Optimizer state tensors per parameter, each of the parameter's size (Adam: first and second moment)."""


@dataclass(frozen=True)
class AnalyticCostModel:
    cluster: Cluster
    optimizer: str = "adam"
    name: str = "analytic"
    unit: str = "seconds"
    dedup_edges: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZER_STATES)}")

    def config_space(self, graph: Graph, devices: int) -> ConfigSpace:
        if devices > self.cluster.num_devices:
            raise ValueError(f"{devices} devices requested but cluster {self.cluster.name!r} has "
                             f"{self.cluster.num_devices}")
        return ConfigSpace(devices=devices, cutoff=1, product="divides")

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
        spec = graph.tensor(operand.tensor)
        layout = operand_layouts(op, configs, operand.axes).astype(np.float64)
        return np.prod(np.array(spec.shape, dtype=np.float64) / layout, axis=1) * spec.dtype_bytes

    # -- node costs ----------------------------------------------------------------------------------
    def node_costs(self, graph: Graph, op: Op, configs: np.ndarray) -> NodeCosts:
        if op.kind not in KNOWN:
            raise GraphError(f"op {op.name!r}: the analytic cost model has no formula for kind {op.kind!r}")
        K = len(configs)
        c = configs.astype(np.float64)
        procs = np.prod(c, axis=1)
        strides = self.strides(op, configs)
        dev = self.cluster.device
        operands = list(op.inputs) + list(op.outputs)
        tiles = [self.tile_bytes(graph, op, configs, o) for o in operands]
        memory = np.zeros(K)
        for o, t in zip(op.inputs, tiles):
            spec = graph.tensor(o.tensor)
            if spec.is_param:
                memory += t * (2 + OPTIMIZER_STATES[self.optimizer])  # weight, gradient, states
            elif graph.producer(o.tensor) is None:
                memory += t  # a graph input kept for the backward pass
        for t in tiles[len(op.inputs):]:
            memory += t  # activations kept for the backward pass

        if op.kind in FREE:
            return NodeCosts(total=np.zeros(K), compute=np.zeros(K), comm=np.zeros(K), memory=memory)

        factor = 3.0 if op.kind in CONTRACTIONS else 2.0
        flops = 0.0 if op.kind == "embedding" else op.flops  # a lookup is a gather, not a GEMM
        compute = np.maximum(factor * flops / procs / (dev.peak_flops * dev.efficiency),
                             factor * sum(tiles) / dev.memory_bandwidth) + factor * dev.op_overhead
        compute = compute + self._folded(op, procs)

        comm = np.zeros(K)
        split = c > 1
        index = {n: i for i, n in enumerate(op.dim_names)}
        skip_rule = op.kind == "lstm"
        for j, (o, t) in enumerate(zip(operands, tiles)):
            is_output = j >= len(op.inputs)
            if not is_output:
                spec = graph.tensor(o.tensor)
                needs_grad = spec.is_param or graph.producer(o.tensor) is not None
                if not needs_grad or (skip_rule and not spec.is_param):
                    continue
            elif skip_rule:
                continue
            present = set(o.dims())
            missing = [i for i, n in enumerate(op.dim_names) if n not in present]
            if not missing:
                continue
            q = self.group_levels(configs, strides, missing)
            active = np.any(split[:, missing], axis=1)
            comm += np.where(active, collective_seconds(self.cluster, "all_reduce", t, q), 0.0)

        if op.kind in ("conv", "pool"):
            comm += self._halo(graph, op, configs, c, strides)
        if op.kind in ("norm", "softmax", "softmax_xent"):
            a = index[op.attr("axis")]
            if op.dims[a].kind is not DimKind.BATCH:  # batch norm keeps per-device statistics
                rows = np.prod(np.array([d.size for d in op.dims], dtype=np.float64) / c, axis=1) / (
                    op.dims[a].size / c[:, a])
                q = self.group_levels(configs, strides, [a])
                # two statistics forward (max/sum or mean/var), two backward
                comm += np.where(split[:, a], 4.0 * collective_seconds(
                    self.cluster, "all_reduce", rows * graph.tensor(op.outputs[0].tensor).dtype_bytes, q), 0.0)
        if op.kind == "lstm":
            comm += self._lstm_steps(graph, op, configs, c, strides)
        return NodeCosts(total=compute + comm, compute=compute, comm=comm, memory=memory)

    def _folded(self, op: Op, procs: np.ndarray) -> np.ndarray | float:
        """The cheap ops capture folded into ``op`` (norms, rotary, activations, casts): each reads and
        writes its output once forward and twice backward (6 x ``folded_bytes`` of traffic, shared by
        the op's devices), and costs two dispatches (forward and backward) of ``op_overhead``."""
        n, nbytes = op.attr("folded_ops", 0), op.attr("folded_bytes", 0)
        if not n:
            return 0.0
        dev = self.cluster.device
        return 6.0 * nbytes / procs / dev.memory_bandwidth + 2.0 * n * dev.op_overhead

    def _halo(self, graph: Graph, op: Op, configs, c, strides) -> np.ndarray:
        """Ghost rows of the input from both neighbours, forward and backward, per split spatial dim."""
        r, s = op.attr("kernel")
        x = op.inputs[0]
        in_tile = self.tile_bytes(graph, op, configs, x)
        spec = graph.tensor(x.tensor)
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
    def edge_costs(self, graph: Graph, tensor: TensorSpec, src_layouts: np.ndarray,
                   dst_layouts: np.ndarray) -> np.ndarray:
        """Seconds to move a tensor (and its gradient back) between every pair of layouts."""
        nbytes = redistribution_words(tensor.shape, src_layouts, dst_layouts) * tensor.dtype_bytes
        span = np.maximum(np.prod(src_layouts, axis=1)[:, None], np.prod(dst_layouts, axis=1)[None, :])
        level = self.cluster.level_of_span(span)
        bw = np.array([lv.bandwidth for lv in self.cluster.levels])[level]
        lat = np.array([lv.latency for lv in self.cluster.levels])[level]
        return np.where(nbytes > 0, 2.0 * (lat + nbytes / bw), 0.0)
