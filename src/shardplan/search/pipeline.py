"""Pipeline planner: fills the arrays of ``stage_dp`` from the graph and the cluster (first version).

The layer chain is the graph's ops grouped by ``op.layer``; ops before layer 0 (embeddings) belong to
the first stage, ops after the last layer (head, loss) to the last. Every stage runs on a sub-mesh of
``d x t`` devices (t consecutive ranks inside a node, d replicas at stride t; stage i on ranks
``[i d t, (i + 1) d t)``). A layer's seconds per microbatch come from the core exact search
(``build_tables`` + ``solve`` on the sub-graph of that layer at the microbatch size on t devices),
cached per (layer signature, t, microbatch). Recomputation adds the recomputed forward (full: a third
of the compute and half of the intra-op communication; selective: a third of the attention core's
compute). ZeRO collectives over d are priced with ``collective_seconds``: ZeRO-2 reduce-scatters each
microbatch's gradients, ZeRO-3 also all-gathers the weights forward and backward; ZeRO-0/1 all-reduce
(reduce-scatter + all-gather, the same volume) once per iteration after the flush.

Search space (exact over it through ``stage_dp``): all stages share one sub-mesh shape d x t (as in
Megatron-LM); per stage its layers, recomputation and ZeRO level; the number of stages; t in powers
of two up to a node; d with d | batch; every microbatch count m with (batch / d) % m == 0; GPipe or
1F1B.

Interleaved 1F1B (Narayanan et al., SC 2021, section 2.2.2) is searched by enumeration over its own,
smaller space, as Megatron-LM runs it: the L layers cut into p x v equal chunks, chunk j on pipeline
rank j mod p, one recomputation/ZeRO option for all chunks, m a multiple of p. Its iteration time is

    T = m * max_i D_i + (p - 1) * max_j C_j + max_i S_i

with C_j a chunk's seconds per microbatch (point-to-point included), D_i = sum of rank i's v chunks
and S_i the sum of its chunks' gradient syncs: Narayanan's bubble ``(p - 1) / v`` of a rank's
microbatch time, exact for equal chunks and the larger of the two readings when the first or last
chunk also carries the embeddings or head. Activations in flight per rank follow
``cost.memory.inflight_microbatches("interleaved", ...)``.

Known approximations: point-to-point is priced on the lowest level holding two adjacent stage
groups, or, when stage groups are smaller than a node but the devices span several nodes, on the
inter-node level for every boundary (an upper bound: only the boundaries on node edges pay it);
per-microbatch gradient all-reduces of batch splits *inside* a stage's t devices are charged every
microbatch.
"""

from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass

import numpy as np

from shardplan.cluster.model import Cluster, collective_seconds
from shardplan.cost.analytic import PER_ITERATION, AnalyticCostModel
from shardplan.cost.configs import divisors, operand_layouts
from shardplan.cost.memory import RECOMPUTE, MemoryOptions, model_state_bytes, transformer_layer_activation_bytes
from shardplan.cost.tables import build_tables
from shardplan.ir.graph import DimKind, Dim, Graph, GraphError, Op, TensorSpec
from shardplan.plan import StageRecord
from shardplan.search.solve import GIB, PlanDoesNotFit, solve
from shardplan.search.stage_dp import min_peak_memory, stage_dp


class PipelineDoesNotFit(PlanDoesNotFit):
    """No pipeline plan fits; the message names the device memory or device count that would."""


@dataclass(frozen=True)
class PipelineResult:
    model: str
    devices: int
    batch: int
    num_microbatches: int
    schedule: str
    stages: tuple[StageRecord, ...]
    iteration_seconds: float
    bubble_fraction: float
    peak_memory_bytes: float
    search_seconds: float
    chunks: int = 1
    """Model chunks per pipeline rank: 1, or v >= 2 for interleaved 1F1B (``stages`` then lists the p x v
    chunks in pipeline order, chunk j on rank j mod p)."""


def layer_chain(graph: Graph) -> tuple[list[int], list[list[int]], list[int]]:
    """(pre ops, ops of each layer in order, post ops) by ``op.layer``."""
    pre, post, layers = [], [], {}
    seen_layer = False
    for i, op in enumerate(graph.ops):
        if op.layer is None:
            (post if seen_layer else pre).append(i)
        else:
            if post:
                raise GraphError(f"op {op.name!r} (layer {op.layer}) follows ops outside any layer; the layer "
                                 "chain must be embeddings, layers, head")
            seen_layer = True
            layers.setdefault(op.layer, []).append(i)
    if not layers:
        raise GraphError(f"graph {graph.name!r} has no ops with a layer index; nothing to pipeline")
    return pre, [layers[k] for k in sorted(layers)], post


def sub_graph(graph: Graph, ops: list[int], batch: int, dtype_bytes: int, name: str) -> Graph:
    """The ops ``ops`` alone, with every batch dim and batch axis resized to ``batch``."""
    batch_axes: dict[str, set[int]] = {}
    old_batch = None
    for i in ops:
        op = graph.ops[i]
        bdims = {d.name: d.size for d in op.dims if d.kind is DimKind.BATCH}
        for d in bdims.values():
            old_batch = d
        for o in op.inputs + op.outputs:
            for a, dims in enumerate(o.axes):
                if any(x in bdims for x in dims):
                    batch_axes.setdefault(o.tensor, set()).add(a)
    scale = batch / old_batch if old_batch else 1.0
    new_ops = []
    for i in ops:
        op = graph.ops[i]
        dims = tuple(Dim(d.name, batch if d.kind is DimKind.BATCH else d.size, d.kind, d.splittable) for d in op.dims)
        new_ops.append(Op(op.name, op.kind, dims, op.inputs, op.outputs, op.flops * scale, op.attrs, op.module, op.layer))
    names = {o.tensor for op in new_ops for o in op.inputs + op.outputs}
    tensors = []
    for t in graph.tensors:
        if t.name in names:
            shape = tuple(batch if a in batch_axes.get(t.name, ()) else s for a, s in enumerate(t.shape))
            tensors.append(TensorSpec(t.name, shape, dtype_bytes, t.is_param))
    return Graph(name, tuple(new_ops), tuple(tensors), graph.meta)


@dataclass(frozen=True)
class _Part:
    """One solved piece (a layer, the embeddings or the head) at (t, microbatch)."""

    seconds: float
    compute: float
    comm: float
    core_compute: float  # attention core: parameter-free contractions and softmaxes
    params: float  # parameters per device (tiles under the chosen plan)
    act_out_bytes: float  # output tiles per device, the generic activation estimate
    boundary_bytes: float  # the last op's output per device (what crosses a stage boundary)
    update: float = 0.0  # the optimizer step of its parameters: once per iteration, not per microbatch


class _Pricer:
    def __init__(self, graph: Graph, cluster: Cluster, opts_dtype: int = 2, optimizer: str = "adam"):
        self.graph, self.cluster, self.dtype, self.optimizer = graph, cluster, opts_dtype, optimizer
        self.pre, self.layers, self.post = layer_chain(graph)
        self.sig = [self._signature(ops) for ops in self.layers]
        self._cache: dict = {}

    def _signature(self, ops):
        return tuple((self.graph.ops[i].kind, tuple((d.size, d.kind) for d in self.graph.ops[i].dims)) for i in ops)

    def part(self, which: str, index: int, t: int, b: int) -> _Part:
        ops = self.pre if which == "pre" else self.post if which == "post" else self.layers[index]
        key = (which, self.sig[index] if which == "layer" else None, t, b)
        if key not in self._cache:
            self._cache[key] = self._solve(ops, t, b)
        return self._cache[key]

    def _solve(self, ops, t, b) -> _Part:
        if not ops:
            return _Part(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        sub = sub_graph(self.graph, ops, b, self.dtype, f"{self.graph.name}[{self.graph.ops[ops[0]].name}..]")
        model = AnalyticCostModel(self.cluster.with_devices(t), optimizer=self.optimizer)
        tables = build_tables(sub, model, t)
        sol = solve(tables)
        br = tables.breakdown(list(sol.choice))
        core = params = out = 0.0
        counted = set()
        for op, cfgs, c, node in zip(sub.ops, tables.configs, sol.choice, tables.nodes):
            has_param = False
            for o in op.inputs:
                spec = sub.tensor(o.tensor)
                if spec.is_param:
                    has_param = True
                    if o.tensor not in counted:
                        counted.add(o.tensor)
                        lay = operand_layouts(op, cfgs[c:c + 1], o.axes)[0]
                        params += spec.numel / float(np.prod(lay))
            for o in op.outputs:
                lay = operand_layouts(op, cfgs[c:c + 1], o.axes)[0]
                out += sub.tensor(o.tensor).nbytes / float(np.prod(lay))
            if not has_param and op.kind in ("einsum", "softmax"):
                core += float(node.compute[c])
        last = sub.ops[-1]
        boundary = sub.tensor(last.outputs[0].tensor).nbytes / t
        # the tables price one optimizer step (and gradient bucket copy) per op; a pipeline does both
        # once per iteration, after the last microbatch, so they leave the per-microbatch time
        # (``_config_arrays`` adds them once)
        update = sum(float(it.seconds[0]) for op, cfgs, c in zip(sub.ops, tables.configs, sol.choice)
                     for it in model.node_cost_items(sub, op, cfgs[c:c + 1])
                     if it.name in PER_ITERATION)
        return _Part(sol.cost - update, br["compute"] - update, br["comm"], core, params, out, boundary, update)


def _layer_act(pricer: _Pricer, part: _Part, t: int, b: int, recompute: str) -> float:
    g = pricer.graph
    if g.hint("family") == "transformer" and g.hint("hidden") and g.hint("heads") and g.hint("seq"):
        return transformer_layer_activation_bytes(g.hint("seq"), b, g.hint("hidden"), g.hint("heads"), t, recompute)
    if recompute == "full":
        return part.boundary_bytes
    return part.act_out_bytes


def _config_arrays(pricer: _Pricer, t: int, d: int, b: int, m: int, opts_list, limit: float,
                   devices: int | None = None):
    """(time, sync, max_inflight, static, act) arrays (O, L, L) for one mesh and microbatch."""
    cl = pricer.cluster
    L = len(pricer.layers)
    n0 = t * d
    dp_q = cl.per_level(np.float64(d), np.float64(t))
    # Point-to-point between stage groups of n0 consecutive ranks: on the lowest level holding two of
    # them; if stage groups are smaller than a node but the pipeline spans several nodes, some
    # boundary sits on a node edge, and every boundary is priced there (an upper bound: the DP does
    # not know a stage's position)
    span = 2 * n0
    if devices is not None and n0 < cl.devices_per_node < devices:
        span = max(span, cl.devices_per_node + 1)
    p2p_level = int(cl.level_of_span(span))
    lv = cl.levels[p2p_level]
    pre, post = pricer.part("pre", 0, t, b), pricer.part("post", 0, t, b)
    parts = [pricer.part("layer", i, t, b) for i in range(L)]
    k_idx, r_idx = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    valid = r_idx >= k_idx
    shape = (len(opts_list), L, L)
    time, sync = np.full(shape, np.inf), np.full(shape, np.inf)
    static, act = np.full(shape, np.inf), np.full(shape, np.inf)
    grad_b = 2.0  # 16-bit gradients and weights on the wire

    def csum(vals):
        c = np.concatenate([[0.0], np.cumsum(vals)])
        return c[r_idx + 1] - c[k_idx]

    p_layer = np.array([p.params for p in parts])
    update = (csum(np.array([p.update for p in parts])) + np.where(k_idx == 0, pre.update, 0.0)
              + np.where(r_idx == L - 1, post.update, 0.0))
    p_stage = csum(p_layer) + np.where(k_idx == 0, pre.params, 0.0) + np.where(r_idx == L - 1, post.params, 0.0)
    boundary = np.array([p.boundary_bytes for p in parts])[r_idx]
    p2p = np.where(r_idx < L - 1, 2.0 * (lv.latency + boundary / lv.bandwidth), 0.0)
    p2p = p2p + np.where(k_idx > 0, 2.0 * (lv.latency + np.array([0] + [p.boundary_bytes for p in parts[:-1]])[k_idx] / lv.bandwidth), 0.0)
    for oi, opts in enumerate(opts_list):
        extra = {"none": np.zeros(L), "full": np.array([p.compute / 3 + p.comm / 2 for p in parts]),
                 "selective": np.array([p.core_compute / 3 for p in parts])}[opts.recompute]
        t_layer = np.array([p.seconds for p in parts]) + extra
        tt = csum(t_layer) + np.where(k_idx == 0, pre.seconds, 0.0) + np.where(r_idx == L - 1, post.seconds, 0.0) + p2p
        grad_bytes = p_stage * grad_b
        if d > 1 and opts.zero >= 2:
            tt = tt + collective_seconds(cl, "reduce_scatter", grad_bytes, dp_q)
        if d > 1 and opts.zero >= 3:
            tt = tt + 2.0 * collective_seconds(cl, "all_gather", grad_bytes, dp_q)
        if d == 1 or opts.zero == 3:
            ss = np.zeros((L, L))
        elif opts.zero == 2:
            ss = collective_seconds(cl, "all_gather", grad_bytes, dp_q)
        else:
            ss = collective_seconds(cl, "all_reduce", grad_bytes, dp_q)
        # then the stage's optimizer step, once per iteration (ZeRO: on its 1/d share of the states)
        ss = ss + update / (d if opts.zero >= 1 and d > 1 else 1)
        w, g, o = model_state_bytes(p_stage, opts, d)
        buf = 2.0 * boundary * t  # an activation-sized communication buffer
        if opts.zero >= 3 and d > 1:
            buf = buf + 2.0 * p_layer.max() * opts.weight_bytes
        st = w + g + o + buf
        a_layer = np.array([_layer_act(pricer, p, t, b, opts.recompute) for p in parts])
        a = csum(a_layer) + np.where(k_idx == 0, pre.act_out_bytes, 0.0) + np.where(r_idx == L - 1, post.act_out_bytes, 0.0)
        time[oi] = np.where(valid, tt, np.inf)
        sync[oi] = np.where(valid, ss, np.inf)
        static[oi] = np.where(valid, st, np.inf)
        act[oi] = np.where(valid, a, np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        maxin = np.where(static <= limit, (limit - static) / act, -1.0)
    return time, sync, maxin, static, act


def option_list(d: int, zero_levels=(0, 1, 2, 3), recompute=RECOMPUTE) -> list[MemoryOptions]:
    zeros = tuple(zero_levels) if d > 1 else (0,)
    return [MemoryOptions(zero=z, recompute=r) for r in recompute for z in zeros]


def _interleaved_layout(arrays, p: int, v: int, m: int, L: int):
    """Every option's (value, per-rank time, sync, memory) for p ranks x v equal chunks; see the module doc."""
    from shardplan.cost.memory import inflight_microbatches

    time, sync, _, static, act = arrays
    c = L // (p * v)
    ranges = [(j * c, (j + 1) * c - 1) for j in range(p * v)]
    k = np.array([rg[0] for rg in ranges])
    r = np.array([rg[1] for rg in ranges])
    ct, cs, cst, cact = time[:, k, r], sync[:, k, r], static[:, k, r], act[:, k, r]  # (O, p v)
    rank = np.arange(p * v) % p
    infl = [inflight_microbatches("interleaved", p, i, m, v) for i in range(p)]
    dev_t = np.stack([ct[:, rank == i].sum(axis=1) for i in range(p)], axis=1)  # (O, p)
    dev_s = np.stack([cs[:, rank == i].sum(axis=1) for i in range(p)], axis=1)
    dev_mem = np.stack([cst[:, rank == i].sum(axis=1) + infl[i] * cact[:, rank == i].sum(axis=1)
                        for i in range(p)], axis=1)
    value = m * dev_t.max(axis=1) + (p - 1) * ct.max(axis=1) + dev_s.max(axis=1)
    return ranges, value, dev_t, dev_s, dev_mem


def _interleaved(arrays, m: int, L: int, max_stages: int, limit: float, best_value: float, min_stages: int = 2):
    """Best interleaved-1F1B layout for one (t, d, microbatch), better than ``best_value``:
    (value, p, v, option, chunk ranges, per-rank time, sync, memory), or None.
    Enumerates p (ranks) and v >= 2 (chunks per rank) with p * v | L and p | m."""
    found = None
    for p in range(max(2, min_stages), max_stages + 1):
        if m % p:
            continue
        for v in range(2, L // p + 1):
            if L % (p * v):
                continue
            ranges, value, dev_t, dev_s, dev_mem = _interleaved_layout(arrays, p, v, m, L)
            value = np.where(dev_mem.max(axis=1) <= limit, value, np.inf)
            o = int(np.argmin(value))
            if np.isfinite(value[o]) and value[o] < min(best_value, math.inf if found is None else found[0]):
                found = (float(value[o]), p, v, o, ranges, dev_t[o], dev_s[o], dev_mem[o])
    return found


def plan_pipeline(graph: Graph, cluster: Cluster, devices: int | None = None,
                  memory_limit_bytes: float | None = None,
                  schedules=("1f1b", "gpipe", "interleaved"), max_tensor_parallel: int | None = None,
                  zero_levels=(0, 1, 2, 3), recompute=RECOMPUTE, exact_devices: bool = False) -> PipelineResult:
    """Fastest pipeline plan for ``graph`` (its batch is the global batch) on ``devices`` of ``cluster``.

    ``schedules``, ``max_tensor_parallel``, ``zero_levels`` and ``recompute`` narrow the search space
    (e.g. :func:`dapple` searches 1F1B, no tensor parallelism, no ZeRO, no recomputation).
    ``exact_devices`` keeps only plans that use all ``devices`` (``shardplan run`` launches that many)."""
    unknown = set(schedules) - {"1f1b", "gpipe", "interleaved"}
    if unknown or not schedules:
        raise ValueError(f"unknown schedule(s) {sorted(unknown)}; known: 1f1b, gpipe, interleaved")
    start = _time.perf_counter()
    N = devices or cluster.num_devices
    limit = cluster.device.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
    B = next(d.size for op in graph.ops for d in op.dims if d.kind is DimKind.BATCH)
    pricer = _Pricer(graph, cluster)
    L = len(pricer.layers)
    best = None
    lean = math.inf
    t = 1
    configs = []
    while t <= min(cluster.devices_per_node, N, max_tensor_parallel or N):
        for d in [x for x in divisors(B) if t * x <= N and (x & (x - 1)) == 0]:
            if exact_devices and (N % (t * d) or N // (t * d) > L):
                continue
            for b in divisors(B // d):
                configs.append((t, d, b))
        t *= 2
    # Lower bound per configuration, from the fastest option (no recomputation, no ZeRO traffic:
    # every other option only adds time) on the whole chain as one stage: sum T >= A and
    # max T >= A / max_stages, so (m - 1) A / max_stages + A <= any plan's iteration time.
    bounded = []
    for t, d, b in configs:
        m = B // d // b
        max_stages = min(L, N // (t * d))
        work = (pricer.part("pre", 0, t, b).seconds + pricer.part("post", 0, t, b).seconds
                + sum(pricer.part("layer", i, t, b).seconds for i in range(L)))
        # interleaved on p ranks: T >= m max D + (p - 1) max C >= m A / p + (p - 1) (slowest layer)
        slowest = max(pricer.part("layer", i, t, b).seconds for i in range(L))
        lb_int = min((m * work / p + (p - 1) * slowest for p in range(2, max_stages + 1)
                      if m % p == 0 and any(L % (p * v) == 0 for v in range(2, L // p + 1))), default=math.inf)
        lb_int = lb_int if "interleaved" in schedules else math.inf
        lb_seq = (m - 1) * work / max_stages + work if set(schedules) - {"interleaved"} else math.inf
        bounded.append((min(lb_seq, lb_int), lb_seq, lb_int, t, d, b))
    bounded.sort()
    for lb, lb_seq, lb_int, t, d, b in bounded:
        if best is not None and lb >= best[0]:
            break
        m = B // d // b
        opts_list = option_list(d, zero_levels, recompute)
        max_stages = min(L, N // (t * d))
        min_stages = max_stages if exact_devices else 1
        arrays = _config_arrays(pricer, t, d, b, m, opts_list, limit, devices=N)
        time, sync, maxin, static, act = arrays
        if "interleaved" in schedules and (best is None or lb_int < best[0]):
            found = _interleaved(arrays, m, L, max_stages, limit,
                                 math.inf if best is None else best[0], min_stages)
            if found is not None:
                best = (found[0], found, t, d, b, m, "interleaved", arrays, opts_list)
        if best is not None and lb_seq >= best[0]:
            continue
        for sched in schedules:
            if sched == "interleaved":
                continue
            inflight = np.array([min(j + 1, m) if sched == "1f1b" else m for j in range(max_stages)], float)
            sol = stage_dp(time, sync, maxin, inflight, alpha=float(m - 1), beta=1.0, max_stages=max_stages,
                           min_stages=min_stages)
            if sol is None:
                lean = min(lean, min_peak_memory(static, act, inflight, max_stages))
                continue
            if best is None or sol.value < best[0]:
                best = (sol.value, sol, t, d, b, m, sched, arrays, opts_list)
    if best is None:
        raise PipelineDoesNotFit(
            f"{graph.name} does not fit on {N} devices of {cluster.name} with {limit / GIB:.1f} GiB each in any "
            f"pipeline plan; the leanest needs {lean / GIB:.1f} GiB per device. Use devices with at least "
            f"{lean / GIB:.1f} GiB or more devices.")
    value, sol, t, d, b, m, sched, (time, sync, maxin, static, act), opts_list = best
    if sched == "interleaved":
        _, p, v, o, ranges, dev_t, dev_s, dev_mem = sol
        opt = opts_list[o]
        stages = tuple(StageRecord(rg, d, t, opt.recompute, opt.zero, float(time[o, rg[0], rg[1]]),
                                   float(dev_mem[j % p])) for j, rg in enumerate(ranges))
        ideal = m * float(dev_t.sum()) / p
        pipe = value - float(dev_s.max())
        return PipelineResult(graph.name, p * t * d, B, m, sched, stages, value, max(0.0, 1.0 - ideal / pipe),
                              float(dev_mem.max()), _time.perf_counter() - start, chunks=v)
    p = len(sol.stages)
    stages = []
    for i, s in enumerate(sol.stages):
        infl = min(p - i, m) if sched == "1f1b" else m
        o = opts_list[s.option]
        stages.append(StageRecord((s.first, s.last), d, t, o.recompute, o.zero, float(time[s.option, s.first, s.last]),
                                float(static[s.option, s.first, s.last] + infl * act[s.option, s.first, s.last])))
    ideal = m * sol.sum_time / p  # every stage busy all the time, the work spread evenly
    pipe = value - sol.max_sync
    return PipelineResult(graph.name, p * t * d, B, m, sched, tuple(stages), value,
                          max(0.0, 1.0 - ideal / pipe), max(s.memory_bytes for s in stages),
                          _time.perf_counter() - start)


MEGATRON = {"175b": dict(t=8, p=16, micro_batch=1, recompute="full", zero=0),
            "530b": dict(t=8, p=35, micro_batch=1, recompute="full", zero=1)}
"""Published Megatron-LM layouts. 175B: NVIDIA/Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh
(t = 8, p = 16, micro-batch 1, full recomputation). 530B: MT-NLG (Smith et al. 2022: 8-way tensor
parallelism inside a node, 35 pipeline stages across nodes, 280 GPUs per replica, ZeRO-1 data
parallelism; micro-batch 1 and full recomputation as in Megatron-LM's large runs)."""


def price_fixed(graph: Graph, cluster: Cluster, t: int, d: int, p: int, micro_batch: int,
                recompute: str = "full", zero: int = 0, schedule: str = "1f1b",
                memory_limit_bytes: float | None = None, chunks: int = 1, optimizer: str = "adam") -> PipelineResult:
    """A hand-written configuration (uniform partition of the layers into p stages) priced by the same
    model as the search: e.g. Megatron-LM's GPT-3 175B, t = 8, p = 16, micro-batch 1, full
    recomputation (NVIDIA/Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh; Narayanan et al.
    2021). Memory is reported, not enforced."""
    start = _time.perf_counter()
    limit = cluster.device.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
    B = next(x.size for op in graph.ops for x in op.dims if x.kind is DimKind.BATCH)
    pricer = _Pricer(graph, cluster, optimizer=optimizer)
    L = len(pricer.layers)
    if L % p or B % (d * micro_batch):
        raise ValueError(f"{L} layers do not split into {p} equal stages, or batch {B} into d={d} x "
                         f"micro-batch {micro_batch}")
    m = B // (d * micro_batch)
    opts = MemoryOptions(zero=zero, recompute=recompute)
    arrays = _config_arrays(pricer, t, d, micro_batch, m, [opts], limit, devices=p * t * d)
    time, sync, maxin, static, act = arrays
    if schedule == "interleaved":
        if chunks < 2 or L % (p * chunks):
            raise ValueError(f"interleaved 1F1B needs chunks >= 2 with p x chunks dividing {L} layers; got "
                             f"p={p}, chunks={chunks}")
        ranges, value, dev_t, dev_s, dev_mem = _interleaved_layout(arrays, p, chunks, m, L)
        stages = tuple(StageRecord(rg, d, t, recompute, zero, float(time[0, rg[0], rg[1]]), float(dev_mem[0, j % p]))
                       for j, rg in enumerate(ranges))
        pipe = float(value[0] - dev_s[0].max())
        bubble = max(0.0, 1.0 - (m * float(dev_t[0].sum()) / p) / pipe)
        return PipelineResult(graph.name, p * t * d, B, m, schedule, stages, float(value[0]), bubble,
                              float(dev_mem[0].max()), _time.perf_counter() - start, chunks=chunks)
    per = L // p
    stages, ts, ss = [], [], []
    for i in range(p):
        k, r = i * per, (i + 1) * per - 1
        infl = min(p - i, m) if schedule == "1f1b" else m
        ts.append(float(time[0, k, r]))
        ss.append(float(sync[0, k, r]))
        stages.append(StageRecord((k, r), d, t, recompute, zero, ts[-1], float(static[0, k, r] + infl * act[0, k, r])))
    value = (m - 1) * max(ts) + sum(ts) + max(ss)
    bubble = max(0.0, 1.0 - (m * sum(ts) / p) / (value - max(ss)))
    return PipelineResult(graph.name, p * t * d, B, m, schedule, tuple(stages), value, bubble,
                          max(s.memory_bytes for s in stages), _time.perf_counter() - start)


def dapple(graph: Graph, cluster: Cluster, devices: int | None = None,
           memory_limit_bytes: float | None = None) -> PipelineResult:
    """DAPPLE's planning rule (Fan et al., PPoPP 2021) under this cost model: synchronous pipeline of
    data-parallel stage replicas with early-backward (1F1B) scheduling, no tensor parallelism inside a
    stage, no ZeRO sharding and no recomputation (DAPPLE bounds memory by its schedule instead). Searched
    exactly by the same DP, restricted to that space; one replication degree for all stages (DAPPLE
    allows a degree per stage, so this baseline can be slightly pessimistic)."""
    return plan_pipeline(graph, cluster, devices, memory_limit_bytes, schedules=("1f1b",), max_tensor_parallel=1,
                         zero_levels=(0,), recompute=("none",))


def price_pipeline(graph: Graph, cluster: Cluster, plan, memory_limit_bytes: float | None = None,
                   optimizer: str = "adam") -> PipelineResult:
    """A :class:`~shardplan.plan.PipelinePlan` (any stage ranges and per-stage options) priced on
    ``cluster`` by the model the search uses: ``(m - 1) max T + sum T + max S`` for GPipe / 1F1B, the
    interleaved formula of the module doc for ``plan.chunks > 1``. Used by ``shardplan run`` to predict a
    plan file's step time on the machine at hand (``optimizer``: the update the stages' time includes,
    ``shardplan run`` trains with plain SGD). Raises ValueError naming a plan that does not match."""
    from shardplan.cost.memory import inflight_microbatches

    start = _time.perf_counter()
    pricer = _Pricer(graph, cluster, optimizer=optimizer)
    L = len(pricer.layers)
    covered = [i for s in plan.stages for i in range(s.layers[0], s.layers[1] + 1)]
    if covered != list(range(L)):
        raise ValueError(f"pipeline plan stages {[s.layers for s in plan.stages]} do not cover the {L} layers of "
                         f"{graph.name!r} exactly once, in order")
    shapes = {(s.data_parallel, s.tensor_parallel) for s in plan.stages}
    if len(shapes) != 1:
        raise ValueError(f"pipeline plan has stages on different sub-mesh shapes {sorted(shapes)}; one is supported")
    (d, t), = shapes
    B = next(x.size for op in graph.ops for x in op.dims if x.kind is DimKind.BATCH)
    m = plan.num_microbatches
    if B % (d * m):
        raise ValueError(f"batch {B} does not split into {d} replicas x {m} microbatches")
    limit = cluster.device.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
    opts_list = sorted({MemoryOptions(zero=s.zero, recompute=s.recompute) for s in plan.stages},
                       key=lambda o: (o.zero, o.recompute))
    time, sync, _, static, act = _config_arrays(pricer, t, d, B // (d * m), m, opts_list, limit,
                                                devices=plan.devices)
    o = [opts_list.index(MemoryOptions(zero=s.zero, recompute=s.recompute)) for s in plan.stages]
    ct = [float(time[oi, s.layers[0], s.layers[1]]) for oi, s in zip(o, plan.stages)]
    cs = [float(sync[oi, s.layers[0], s.layers[1]]) for oi, s in zip(o, plan.stages)]
    v = max(plan.chunks, 1)
    p = len(plan.stages) // v
    rank_t = [sum(ct[j] for j in range(len(ct)) if j % p == i) for i in range(p)]
    rank_s = [sum(cs[j] for j in range(len(cs)) if j % p == i) for i in range(p)]
    if v == 1:
        value = (m - 1) * max(ct) + sum(ct) + max(cs)
    else:
        value = m * max(rank_t) + (p - 1) * max(ct) + max(rank_s)
    sched = "interleaved" if v > 1 else plan.schedule
    mem = []
    for j, (oi, s) in enumerate(zip(o, plan.stages)):
        i = j % p
        infl = inflight_microbatches(sched, p, i, m, v)
        mem.append(float(static[oi, s.layers[0], s.layers[1]] + infl * act[oi, s.layers[0], s.layers[1]]))
    rank_mem = [sum(mem[j] for j in range(len(mem)) if j % p == i) for i in range(p)] if v > 1 else mem
    stages = tuple(StageRecord(s.layers, d, t, s.recompute, s.zero, ct[j], rank_mem[j % p])
                   for j, s in enumerate(plan.stages))
    bubble = max(0.0, 1.0 - (m * sum(ct) / p) / (value - max(rank_s)))
    return PipelineResult(graph.name, p * t * d, B, m, sched, stages, value, bubble, max(rank_mem),
                          _time.perf_counter() - start, chunks=v)
