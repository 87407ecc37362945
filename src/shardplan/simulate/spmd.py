"""The task graph of one training iteration of an SPMD plan, priced by the analytic cost model.

Per op, in program order (the analytic model's items, ``AnalyticCostModel.node_cost_items``):

* forward: the halo exchange (split spatial dims of conv/pool, its forward half) on the comm
  stream, then the forward compute (the forward share of the roofline), then the forward
  collectives (partial-sum all-reduce of a split reduction dim, the forward half of statistics
  all-reduces and of LSTM step collectives), one after another;
* every incoming edge with a redistribution cost: a comm task (half the edge cost: the forward
  move) after the producer's forward and before this op's forward;
* backward, ops in reverse: the reverse redistribution (the other half) after the consumer's
  backward, then the backward compute, then the critical backward collectives (input-gradient
  all-reduce, backward halves of halo/statistics/LSTM) that the producer's backward waits for;
* the weight-gradient all-reduce of every parameter, after the op's backward compute but off the
  critical path (priority 1: it runs when the comm stream has no critical work, overlapping the rest
  of the backward pass as DDP/FSDP gradient buckets do); a bucketed gradient is first copied into its
  flat bucket (the model's ``grad_bucket_pack``: a compute task right after the op's backward, as
  DDP's gradient hook copies it, which the all-reduce waits for);
* with ``optimizer=True``, an optimizer update per parameter tile after its gradient is reduced, on
  the compute stream at priority 1 (see :func:`optimizer_seconds`): the model's ``optimizer_update``
  item, one task per tile. Without overlap the iteration is then the cost tables' ``cost_of``;
* with a ``sync_jitter`` on the device (and more than one device), a wait task on the comm stream at
  every sync point of the prediction's walk (``cost.step.jitter_waits``: before a redistribution
  wherever it is a collective, in either pass; before an op's critical collectives, before the
  gradient reduction, at the step's end), each ``sync_jitter x (compute since the previous
  one) ^ sync_jitter_exponent`` (up to ``sync_jitter_horizon``), and the compute tasks without the per-op stretch: without
  overlap the iteration is then ``cost.step.step_seconds``.

Symmetry: under the analytic model every device of an SPMD plan runs the same tasks with the same
durations (every op's tiles are equal, the cost model prices one device's share), and every member
of a collective's group is in the same state as the device itself. So one device (rank 0) is
simulated and stands for all: a collective waits only for that device's comm stream, which is
exactly "all members free" when all members are alike.
"""

from __future__ import annotations

import numpy as np

from shardplan.cluster.model import Cluster
from shardplan.cost.analytic import AnalyticCostModel, update_seconds
from shardplan.cost.step import jitter_waits
from shardplan.cost.tables import edge_layouts
from shardplan.ir.graph import Graph
from shardplan.plan import Plan
from shardplan.simulate.engine import TaskGraph
from shardplan.simulate.result import SimResult, summarise


def optimizer_seconds(cluster: Cluster, optimizer: str, param_tile_bytes: float) -> float:
    """Seconds of one optimizer update of a parameter tile: the analytic model's ``update_seconds``
    (memory bound, ``(3 + 2 s) x tile`` bytes at the memory bandwidth plus one dispatch)."""
    return float(update_seconds(cluster.device, optimizer, float(param_tile_bytes)))


class OpEntry:
    """One op's tasks for K configurations, as Python lists (fast to index in a search loop)."""

    __slots__ = ("fwd_compute", "bwd_compute", "stretch_fwd", "stretch_bwd", "halo_fwd", "fwd_comm", "bwd_comm",
                 "grad_comm", "grad_pack", "params", "activations")

    def __init__(self, model: AnalyticCostModel, graph: Graph, op, configs: np.ndarray):
        items = model.node_cost_items(graph, op, configs)
        K = len(configs)
        fwd_c, bwd_c = np.zeros(K), np.zeros(K)
        self.stretch_fwd, self.stretch_bwd = [0.0] * K, [0.0] * K
        self.halo_fwd = None
        self.fwd_comm, self.bwd_comm, self.grad_comm, self.grad_pack = [], [], [], []
        for it in items:
            fwd, bwd = it.fwd, it.bwd
            if it.name == "optimizer_update":  # its own tasks, one per parameter (``optimizer=True``)
                continue
            if it.name == "grad_bucket_pack":  # its own task, before the gradient's all-reduce
                self.grad_pack.append((it.tensor, it.seconds.tolist()))
                continue
            if it.stream == "compute":
                fwd_c = fwd_c + fwd
                bwd_c = bwd_c + bwd
                if it.name == "sync_wait":  # replaced by the plan's jitter waits when the device has them
                    self.stretch_fwd, self.stretch_bwd = fwd.tolist(), bwd.tolist()
                continue
            if it.name == "halo":
                self.halo_fwd = fwd.tolist()
            elif np.any(fwd > 0):
                self.fwd_comm.append((it.name, fwd.tolist()))
            if np.any(bwd > 0):
                if it.critical:
                    self.bwd_comm.append((it.name, bwd.tolist()))
                else:
                    self.grad_comm.append((it.name, it.tensor, bwd.tolist()))
        self.fwd_compute, self.bwd_compute = fwd_c.tolist(), bwd_c.tolist()
        self.params = []
        act = np.zeros(K)
        for m in model.memory_items(graph, op, configs):
            if m.kind == "parameter":
                self.params.append((m.tensor, m.nbytes.tolist(), m.tile_bytes.tolist()))
            else:
                act = act + m.nbytes
        self.activations = act.tolist()


class Prepared:
    """Itemised costs of every op for a set of configurations per op (K rows each), and edges.

    ``configs[i]`` is (K_i, n_i). Built once per graph and configuration set; ``build_spmd`` then only
    indexes rows, so a search can simulate many plans cheaply (see :class:`Simulator`)."""

    def __init__(self, graph: Graph, model: AnalyticCostModel, configs, edges=None, entries=None,
                 edge_seconds=None):
        self.graph, self.model = graph, model
        self.configs = [np.asarray(c, dtype=np.int64) for c in configs]
        self.entries = entries if entries is not None else [
            OpEntry(model, graph, op, c) for op, c in zip(graph.ops, self.configs)]
        if edges is None and edge_seconds is None:
            raise ValueError("Prepared needs the cost tables' edges or the plan's priced edges")
        self.edges = edges  # cost-table edges, merged per op pair
        self._edge_seconds = edge_seconds  # or precomputed (src, dst, seconds, label, sync) for the chosen rows

    def edge_list(self, choice) -> list[tuple[int, int, float, str, int]]:
        """(src, dst, seconds of both directions, label, sync code) for every transfer; the code's
        bit 0 is set where the forward move is a collective, bit 1 where the backward one is
        (``EdgeTable.syncs``)."""
        if self._edge_seconds is not None:
            return self._edge_seconds
        return [(e.src, e.dst, float(e.cost[e.src_class[choice[e.src]], e.dst_class[choice[e.dst]]]),
                 "+".join(e.tensors), e.sync_code(choice[e.src], choice[e.dst])) for e in self.edges]


def edge_seconds(model: AnalyticCostModel, g: Graph, e, src_config: np.ndarray,
                 dst_config: np.ndarray, devices: int | None = None) -> tuple[float, int]:
    """The analytic model's redistribution seconds (both directions) of graph edge ``e``, and its sync
    code (bit 0: the forward move is a collective; bit 1: the backward one is); on the plan's
    ``devices``, priced as the cost tables price it (``AnalyticCostModel.edge_mesh``)."""
    src_op, dst_op = g.ops[e.src], g.ops[e.dst]
    mesh = model.edge_mesh(devices) if devices else None
    s = edge_layouts(src_op, src_config[None, :], src_op.outputs[e.src_out].axes, mesh)
    d = edge_layouts(dst_op, dst_config[None, :], dst_op.inputs[e.dst_in].axes, mesh)
    if np.array_equal(s, d):
        return 0.0, 0  # equal layouts move nothing (the formula's nbytes = 0 branch)
    tensor = g.read_spec(dst_op.inputs[e.dst_in])
    seconds, syncs = model.edge_prices(g, tensor, s, d, mesh=mesh)
    return float(seconds[0, 0]), int(syncs[0, 0])


def build_spmd(prep: Prepared, choice, devices: int, *, overlap: bool = True, optimizer: bool = True) -> TaskGraph:
    """The task graph of one iteration on the representative device 0 (see the module doc)."""
    g, model = prep.graph, prep.model
    cluster = model.cluster
    tg = TaskGraph()
    add = tg.add
    dev = 0
    C, M = (dev, "compute"), (dev, "comm")
    if not overlap:
        tg.merge(C, (dev, "serial"))
        tg.merge(M, (dev, "serial"))
    n = len(g.ops)
    names = [op.name for op in g.ops]
    incoming: list[list] = [[] for _ in range(n)]
    outgoing: list[list] = [[] for _ in range(n)]
    syncs: list[int] = [0] * n  # per op: bit 0, a collective brings an input; bit 1, one takes a gradient back
    for src, dst, cost, label, sync in prep.edge_list(choice):
        incoming[dst].append((src, cost, label))
        outgoing[src].append((dst, cost, label))
        syncs[dst] |= sync
    entries = prep.entries
    static = 0.0
    for i in range(n):
        for _, nbytes, _ in entries[i].params:
            static += nbytes[choice[i]]
    tg.static_bytes[dev] = static

    # jitter waits (``cost.step.jitter_waits``, the walk the prediction uses): at every sync point,
    # sync_jitter x (the compute since the previous one) ^ exponent, in place of the per-op stretch; a task
    # on the comm stream before the collective it delays
    jitter = cluster.device.sync_jitter if devices > 1 else 0.0
    waits: dict = {}
    if jitter:
        rows = [(choice[i], entries[i]) for i in range(n)]
        updates = [sum(optimizer_seconds(cluster, model.optimizer, tile[r]) for _, _, tile in e.params) if optimizer
                   else 0.0 for r, e in rows]
        waits = jitter_waits(
            jitter,
            fwd=[e.fwd_compute[r] - e.stretch_fwd[r] for r, e in rows],
            bwd=[e.bwd_compute[r] - e.stretch_bwd[r] for r, e in rows],
            fwd_sync=[(e.halo_fwd is not None and e.halo_fwd[r] > 0) or any(sec[r] > 0 for _, sec in e.fwd_comm)
                      for r, e in rows],
            bwd_sync=[any(sec[r] > 0 for _, sec in e.bwd_comm) for r, e in rows],
            moved=[bool(syncs[i] & 1) for i in range(n)],
            moved_back=[bool(syncs[i] & 2) for i in range(n)],
            reduces=any(sec[r] > 0 for r, e in rows for _, _, sec in e.grad_comm),
            after_backward=sum(sec[r] for r, e in rows for _, sec in e.grad_pack) + sum(updates),
            horizon=cluster.device.sync_jitter_horizon, exponent=cluster.device.sync_jitter_exponent)

    def wait(key, label: str, deps, priority: int = 0) -> int:
        return add(f"sync wait ({label})", waits[key], [M], deps, priority=priority, kind="wait")

    fwd_done = [0] * n
    for i in range(n):
        row, ent, name = choice[i], entries[i], names[i]
        deps, gate = [], []
        if ("before fwd", i) in waits:
            gate = [wait(("before fwd", i), f"before {name} fwd", [fwd_done[src] for src, _, _ in incoming[i]])]
        for src, cost, label in incoming[i]:
            if cost > 0:
                deps.append(add(f"redistribute {label} ({names[src]} -> {name}) fwd", 0.5 * cost, [M],
                                [fwd_done[src]] + gate, kind="comm"))
            else:
                deps.append(fwd_done[src])
        if ent.halo_fwd is not None and ent.halo_fwd[row] > 0:
            deps = [add(f"{name}.halo fwd", ent.halo_fwd[row], [M], deps, kind="comm")]
        a = ent.activations[row]
        work = ent.fwd_compute[row] - (ent.stretch_fwd[row] if jitter else 0.0)
        prev = add(f"{name} fwd", work, [C], deps, alloc=((dev, a),) if a else ())
        if ("after fwd", i) in waits:
            prev = wait(("after fwd", i), f"after {name} fwd", [prev])
        for label, sec in ent.fwd_comm:
            if sec[row] > 0:
                prev = add(f"{name}.{label} fwd", sec[row], [M], [prev], kind="comm")
        fwd_done[i] = prev

    loss = fwd_done[n - 1]
    bwd_done = [0] * n
    tails: list[int] = []  # the last tasks of the step: gradient all-reduces and updates
    opt = model.optimizer
    for i in range(n - 1, -1, -1):
        row, ent, name = choice[i], entries[i], names[i]
        deps = [fwd_done[i], loss]
        for dst, cost, label in outgoing[i]:
            if cost > 0:
                deps.append(add(f"redistribute {label} ({names[dst]} -> {name}) bwd", cost - 0.5 * cost,
                                [M], [bwd_done[dst]], kind="comm"))
            else:
                deps.append(bwd_done[dst])
        a = ent.activations[row]
        work = ent.bwd_compute[row] - (ent.stretch_bwd[row] if jitter else 0.0)
        comp = add(f"{name} bwd", work, [C], deps, free=((dev, a),) if a else ())
        prev = comp
        if ("after bwd", i) in waits:
            prev = wait(("after bwd", i), f"after {name} bwd", [prev])
        for label, sec in ent.bwd_comm:
            if sec[row] > 0:
                prev = add(f"{name}.{label} bwd", sec[row], [M], [prev], kind="comm")
        if ("inputs bwd", i) in waits:
            prev = wait(("inputs bwd", i), f"before {name}'s inputs bwd", [prev])
        bwd_done[i] = prev
        packed: dict[str, int] = {}
        for tensor, sec in ent.grad_pack:
            if sec[row] > 0:
                packed[tensor] = add(f"{name}.grad_bucket_pack {tensor}", sec[row], [C], [comp])
        grads: dict[str, int] = {}
        for label, tensor, sec in ent.grad_comm:
            if sec[row] > 0:
                grads[tensor] = add(f"{name}.{label} {tensor}", sec[row], [M], [packed.get(tensor, comp)],
                                    priority=1, kind="comm")
                tails.append(grads[tensor])
        if optimizer:
            for tensor, _, tile in ent.params:
                tails.append(add(f"{name}.optimizer {tensor}", optimizer_seconds(cluster, opt, tile[row]), [C],
                                 [grads.get(tensor, comp)], priority=1))
    if ("reduce", -1) in waits:
        tails.append(wait(("reduce", -1), "gradient reduction", [bwd_done[0]], priority=1))
    if ("end", -1) in waits:
        wait(("end", -1), "end of step, slowest rank", tails + [bwd_done[0]], priority=1)
    return tg


_CACHE: dict = {}
_CACHE_GRAPHS = 8


def prepare_tables(tables, model: AnalyticCostModel) -> Prepared:
    """A :class:`Prepared` over every configuration of ``tables`` (cached per tables object and model)."""
    import weakref

    key = (id(tables), model, "tables")
    hit = _CACHE.get(key)
    if hit is None or hit[0]() is not tables:
        if len(_CACHE) >= _CACHE_GRAPHS:
            _CACHE.pop(next(iter(_CACHE)))
        hit = (weakref.ref(tables), Prepared(tables.graph, model, tables.configs, edges=tables.edges))
        _CACHE[key] = hit
    return hit[1]


def prepare_plan(graph: Graph, model: AnalyticCostModel, plan: Plan) -> Prepared:
    """A :class:`Prepared` for one plan (one row per op), with per-(op, configuration) items and
    per-(edge, layouts) redistribution cached per graph and model, so that calling ``simulate`` in a
    search loop on plans that differ in a few ops re-prices only those ops."""
    import weakref

    configs = plan_configs(graph, plan)
    key = (id(graph), model)
    hit = _CACHE.get(key)
    if hit is None or hit[0]() is not graph:
        if len(_CACHE) >= _CACHE_GRAPHS:
            _CACHE.pop(next(iter(_CACHE)))
        hit = (weakref.ref(graph), {}, {})
        _CACHE[key] = hit
    op_cache, edge_cache = hit[1], hit[2]
    entries = []
    for i, (op, c) in enumerate(zip(graph.ops, configs)):
        k = (i, c.tobytes())
        ent = op_cache.get(k)
        if ent is None:
            ent = op_cache[k] = OpEntry(model, graph, op, c)
        entries.append(ent)
    edges = []
    for e in graph.edges():
        src, dst = configs[e.src][0], configs[e.dst][0]
        k = (e.src, e.src_out, e.dst, e.dst_in, src.tobytes(), dst.tobytes())
        sec = edge_cache.get(k)
        if sec is None:
            sec = edge_cache[k] = edge_seconds(model, graph, e, src, dst, plan.devices)
        edges.append((e.src, e.dst, sec[0], e.tensor, sec[1]))
    return Prepared(graph, model, configs, entries=entries, edge_seconds=edges)


def plan_configs(graph: Graph, plan: Plan) -> list[np.ndarray]:
    """Each op's configuration in ``plan`` as a (1, n) array; PlanError if the plan is for another graph."""
    plan.check_graph(graph)
    return [np.array([[f for _, f in p.split]], dtype=np.int64) for p in plan.ops]


def run_spmd(prep: Prepared, choice, devices: int, *, overlap: bool = True, optimizer: bool = True) -> SimResult:
    tg = build_spmd(prep, choice, devices, overlap=overlap, optimizer=optimizer)
    makespan, events, peaks, bound = tg.run()
    return summarise(makespan, events, peaks, {d: 0 for d in range(devices)}, bound, kind="spmd")


class Simulator:
    """Simulate many plans of one graph quickly: itemises every configuration of the cost tables once.

    ``tables`` must come from ``build_tables(graph, AnalyticCostModel(cluster, optimizer), devices)``
    with the same cluster and optimizer; ``run(choice)`` then costs only the event replay (what an
    MCMC search calls in its loop). Redistribution uses the tables' edges (merged per op pair)."""

    def __init__(self, tables, cluster: Cluster, optimizer: str = "adam"):
        if tables.model_name != "analytic":
            raise ValueError(f"the simulator prices tasks with the analytic cost model; tables are "
                             f"{tables.model_name!r}")
        self.tables = tables
        self.prep = Prepared(tables.graph, AnalyticCostModel(cluster, optimizer=optimizer), tables.configs,
                             edges=tables.edges)

    def run(self, choice, *, overlap: bool = True, optimizer: bool = True) -> SimResult:
        if isinstance(choice, Plan):
            choice = choice.to_choice(self.tables)
        return run_spmd(self.prep, list(choice), self.tables.devices, overlap=overlap, optimizer=optimizer)
