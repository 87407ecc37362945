"""The Llama probes behind ``shardplan calibrate``'s compute efficiency and dispatch cost, and the timing
primitives every measurement of it uses.

A probe is a small Llama applied with DTensor on the mesh of all ranks as ``shardplan run`` applies
plans (replicated, or data parallel), timed for a training step; the cost model's price of its
arithmetic and traffic at the measured rates, subtracted from the step, leaves the host work per
dispatch (``dispatch_overhead``). The mostly arithmetic probe (``COMPUTE_PROBE``) is also profiled
(``probe_kernel_seconds``): its products give the compute efficiency (``product_efficiency``), its
memory-bound kernels the bandwidth they get inside a step (``step_bandwidth``); with both rates fixed,
``fit_efficiency`` fits the dispatch cost to it and the dispatch-bound ``PROBE``.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist


def best_time(fn, reps: int) -> float:
    """Best seconds of a collective ``fn`` over ``reps`` repetitions: ranks aligned by a barrier, each
    timing its own call (no trailing barrier, whose latency is not the collective's), the slowest
    rank's time per repetition, the fastest repetition kept. On a shared machine the noise is
    one-sided (a neighbour only ever slows a call down), so the minimum is the stable figure;
    ``shardplan run`` reports the matching ``best_step_seconds``."""
    fn()
    return min(slowest_rank_seconds(fn) for _ in range(reps))


def slowest_rank_seconds(fn) -> float:
    """Seconds of one call of ``fn`` on the slowest rank, every rank starting from a common barrier."""
    return max(rank_seconds(fn))


def rank_seconds(fn) -> list[float]:
    """Seconds of one call of ``fn`` on every rank (in rank order), every rank starting from a common
    barrier: the slowest is :func:`slowest_rank_seconds`'s figure, the others show how long each rank
    would wait for it at a sync point after the call."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - t0])
    every = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(every, took)
    return [float(t) for t in every]


def local_time(fn, reps: int, inner: int = 8) -> float:
    """Best seconds of a local ``fn`` while every rank runs it at once: ranks start together (one
    barrier per batch), each times ``inner`` back-to-back calls, so no barrier latency is inside the
    timing (a barrier over gloo costs a large fraction of a small matmul); the fastest batch is kept
    (see ``best_time``)."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return min(times)


def round_times(steps, rounds: int) -> list[list[float]]:
    """Seconds of each of ``steps`` in each of ``rounds`` rounds that run one step of each,
    round-robin (so the machine's state of the moment is shared by the steps of a round, as in
    ``shardplan run --plan A --plan B``), per step in round order; every step timed from a common
    barrier, the slowest rank's time kept."""
    return [[max(ranks) for ranks in step] for step in round_rank_times(steps, rounds)]


def round_rank_times(steps, rounds: int) -> list[list[list[float]]]:
    """As :func:`round_times`, with every rank's seconds of each step (:func:`rank_seconds`): per
    step, per round in order, the ranks' times."""
    for step in steps:
        step()
    times: list[list[list[float]]] = [[] for _ in steps]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            times[i].append(rank_seconds(step))
    return times


def end_wait(rank_times: list[list[float]]) -> float:
    """Mean seconds a rank waits at the end of a step for the slowest (``max - mean`` over ranks, the
    mean over rounds; ``rank_times`` as one step's entry of :func:`round_rank_times`): for a step with
    no sync point inside, the wait ``cost.step.jitter_waits`` prices at its end."""
    return statistics.mean(max(r) - statistics.mean(r) for r in rank_times)


def best_and_median(times: list[float]) -> tuple[float, float]:
    """(fastest, median) of one step's times."""
    return min(times), statistics.median(times)


def paired_times(steps, rounds: int) -> list[tuple[float, float]]:
    """(best, median) seconds of each of ``steps`` over the rounds of :func:`round_times`."""
    return [best_and_median(t) for t in round_times(steps, rounds)]


def typical_step(tp: list[float], replicated: list[float], replicated_step: float) -> float:
    """A sync-heavy probe's expected step, in the units of the calibrated rates: the mean over rounds
    of ``tp_i / replicated_i`` (each round's two steps from :func:`round_times`, taken back to back,
    as ``benchmarks/fidelity.py``'s "paired" measure pairs plans) times ``replicated_step``, the
    replicated probe's step that the rates were fitted to (``execute.calibrate``: its best batch,
    whose dispatch cost the fit reads).

    The ratio is what the waits at sync points add to a step, the drift the two steps of a round share
    cancelled. Anchoring it at the rounds' own fastest replicated step (sessions 18-19) let that
    step's luck into the fit: in runs 20.2 and 20.3 the fastest of 60 rounds was 14% and 19% under
    the step the rates were fitted to, and the fitted jitter fell to 0.012 and 0.005, where the
    calibrations anchored this way read 0.023-0.028 (docs/fidelity.md, session 20).

    The mean, not the median of sessions 18-20: the cost model adds up expected waits, and a sync
    point's waits have a long tail that the median leaves out. Repriced on session 21's six
    recorded runs (``benchmarks/reprice.py``), Llama ranks 0.93 paired on average with the mean,
    0.86 with the median, the CNN 0.88 with either; run 21.4, taken after the first three had
    suggested it, went from 0.87 to 0.99."""
    if len(tp) != len(replicated) or not tp:
        raise ValueError(f"typical_step: {len(tp)} tensor-parallel and {len(replicated)} replicated rounds; "
                         "expected the same number, at least one")
    return statistics.mean(t / r for t, r in zip(tp, replicated)) * replicated_step


PROBE = dict(batch=4, seq=32, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=8, vocab_size=512)
"""The Llama whose step, less its modelled arithmetic, calibrates the dispatch cost: small enough to be
dispatch-bound, big enough for realistic tensors (a tiny one reads 4x less per call on this machine)."""
COMPUTE_PROBE = dict(batch=8, seq=64, hidden_size=192, intermediate_size=768, num_hidden_layers=2,
                     num_attention_heads=12, num_key_value_heads=12, vocab_size=1024)
"""A Llama whose step is mostly arithmetic (about 5 GFLOP): with ``PROBE`` it fits the compute
efficiency as well as the dispatch cost (``fit_efficiency``)."""


def probe_step(p: int, reps: int, probe: dict | None = None, layout: str = "replicated"):
    """(best seconds of one training step, captured graph, dispatch units) of ``build_probe``'s step."""
    step, graph, units = build_probe(p, probe, layout)
    return local_time(step, reps, inner=2), graph, units


def probe_model(probe: dict | None = None):
    """(module, example kwargs, captured graph) of the probe Llama of size ``probe`` (None: a tiny one),
    seeded: what :func:`build_probe` applies, and what a saved calibration's fits are redone on
    (:func:`wait_laws`)."""
    from shardplan.capture import capture
    from shardplan.capture.models import build

    torch.manual_seed(0)
    size = probe or dict(batch=2, seq=8, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    module, kwargs = build("llama", **size)
    module.eval()
    return module, kwargs, capture(module, (), kwargs, name="llama")


def build_probe(p: int, probe: dict | None = None, layout: str = "replicated"):
    """(one training step, captured graph, dispatch units) of a Llama applied on the mesh of all
    ranks as ``shardplan run`` applies plans, in ``layout`` (see ``LAYOUTS``); the step
    is forward, backward, the bucketed gradient reduction and the SGD update ``shardplan run`` takes.
    Dispatch units: 3 x its exported aten calls plus one per parameter update (the cost model charges
    each captured op ``3 x dispatches x op_overhead`` and each distinct parameter's update one
    ``op_overhead``; ``cost.analytic``). ``probe`` sets the Llama's size."""
    from shardplan.execute.apply import apply
    from shardplan.plan import Plan
    from torch.distributed.device_mesh import init_device_mesh

    module, kwargs, graph = probe_model(probe)
    tables, choice = probe_tables(graph, p, layout)
    pm = apply(module, graph, Plan.from_choice(tables, choice), init_device_mesh("cpu", (p,)))
    calls = sum(op.attr("dispatches", 0) for op in graph.ops)
    updates = len({o.tensor for op in graph.ops for o in op.inputs if graph.tensor(o.tensor).is_param})

    def step():
        out = pm(**kwargs)
        with pm.context():
            out.logits.float().pow(2).mean().backward()
            pm.reduce_gradients()
            with torch.no_grad():
                for q in module.parameters():
                    q.add_(q.grad, alpha=-1e-3)
                    q.grad = None

    return step, graph, 3.0 * calls + updates


def sharded_dispatch_ratio(p: int, reps: int, **rates) -> float:
    """How much more a dispatch unit costs on sharded tensors than on replicated ones: ``PROBE`` run
    replicated and data parallel in turn, ``4 reps`` rounds (each round times two steps of each, on
    the slowest rank, the two in alternating order), each step less its modelled cost without
    dispatch (``probe_tables`` at ``rates``) over its units; the median over rounds of the data-parallel
    residual over the replicated one. Paired, so that the machine's drift cancels: a data-parallel
    residual taken on its own (``data_parallel_probe_op_overhead``) read 0.93-1.99x ``op_overhead``
    across 17 calibrations, the paired ratio 1.39-1.55 in six (torch.profiler: 1.53, DTensor's
    Python dispatch of a Llama step's 1060 calls at equal shapes). ``split_op_overhead`` is
    ``op_overhead`` times this ratio."""
    runs = []
    for layout in ("replicated", "data_parallel"):
        step, graph, units = build_probe(p, PROBE, layout)
        tables, choice = probe_tables(graph, p, layout, **rates)
        step()
        runs.append((step, tables.cost_of(choice), units))
    ratios = []
    for k in range(4 * reps):
        residual = [0.0, 0.0]
        for j in ((0, 1) if k % 2 else (1, 0)):
            step, cost, units = runs[j]
            dist.barrier()
            t0 = time.perf_counter()
            step()
            step()
            t = torch.tensor([(time.perf_counter() - t0) / 2])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            residual[j] = (float(t) - cost) / units
        if residual[0] > 0 and residual[1] > 0:
            ratios.append(residual[1] / residual[0])
    return statistics.median(ratios) if ratios else float("nan")


LAYOUTS = ("replicated", "data_parallel", "tensor_parallel")
"""The plans a probe runs: every op replicated, data parallel, or Megatron's tensor parallelism
(``execute.plans.tensor_parallel``)."""


def probe_tables(graph, p: int, layout: str, peak_flops: float = 1e18, memory_bandwidth: float = 1e18,
                  efficiency: float = 1.0, gemm: tuple = (), latency: float = 1e-6, bandwidth: float = 1e9,
                  elementwise_bandwidth: float | None = None):
    """Cost tables of a probe at the given rates with no dispatch cost (``op_overhead`` 0), and the
    probe's plan in ``layout`` (one of ``LAYOUTS``)."""
    from shardplan.cluster.model import Cluster, Device, Level
    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.tables import build_tables
    from shardplan.execute.launch import RUN_OPTIMIZER
    from shardplan.execute.plans import replicated, tensor_parallel
    from shardplan.search.baselines import data_parallel

    rates = Device("measured", peak_flops, 1e12, memory_bandwidth, efficiency=efficiency, gemm_efficiency=gemm,
                   elementwise_bandwidth=elementwise_bandwidth)
    cluster = Cluster("measured", rates, (Level("pg", p, bandwidth, latency),))
    tables = build_tables(graph, AnalyticCostModel(cluster, optimizer=RUN_OPTIMIZER), p)
    plans = {"replicated": replicated, "data_parallel": data_parallel, "tensor_parallel": tensor_parallel}
    if layout not in plans:
        raise ValueError(f"probe layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    return tables, list(plans[layout](tables))


def dispatch_overhead(p: int, reps: int, peak_flops: float | None = None, memory_bandwidth: float | None = None,
                       probe: dict | None = None, layout: str = "replicated", latency: float = 1e-6,
                       bandwidth: float = 1e9, gemm: tuple = (), efficiency: float = 1.0,
                       elementwise_bandwidth: float | None = None) -> float:
    """Seconds per dispatch unit of a probe (``probe_step``): its step less what the cost model
    charges for its arithmetic, memory traffic and collectives (none replicated) at the measured
    rates (none when they are not given), over its dispatch units."""
    seconds, graph, units = probe_step(p, reps, probe, layout)
    tables, choice = probe_tables(graph, p, layout, peak_flops or 1e18, memory_bandwidth or 1e18, efficiency,
                                   gemm, latency, bandwidth, elementwise_bandwidth)
    return max(seconds - tables.cost_of(choice), 0.0) / units


GEMM_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
"""The kernels whose profiled self time is a probe's products (a linear's forward and both backward
products, attention's batched ones)."""

METADATA_OPS = frozenset(f"aten::{n}" for n in (
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "as_strided", "expand",
    "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "alias", "detach",
    "empty", "empty_strided", "empty_like", "resolve_conj", "resolve_neg", "to", "lift_fresh", "contiguous",
    "matmul", "linear", "numpy_T", "expand_as", "view_as", "flatten", "unflatten", "is_same_size", "result_type"))
"""aten calls that move no data (views, allocations, composites whose work is in the kernels they call):
their profiled self time is dispatch, which ``op_overhead`` prices, not memory traffic."""


def probe_kernel_seconds(step, rounds: int = 3, steps: int = 2) -> tuple[float, float]:
    """(products, memory-bound kernels): seconds per training step this rank spends inside a probe's
    matrix products (self time of ``GEMM_KERNELS``) and inside every other aten call that touches data
    (elementwise ops, norms, softmax, copies, reductions, the optimizer's updates: the self time of
    every ``aten::`` event that is neither a product nor in ``METADATA_OPS``), under
    ``torch.profiler``; each the fastest of ``rounds`` rounds of ``steps`` steps of ``step`` (from
    :func:`build_probe`). DTensor's own dispatch (the profiler's ``PythonSubclass``) and autograd's
    bookkeeping are in neither."""
    from torch.profiler import ProfilerActivity, profile

    step()
    gemm, memory = float("inf"), float("inf")
    for _ in range(rounds):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        table = prof.key_averages()
        us = sum(e.self_cpu_time_total for e in table if e.key in GEMM_KERNELS)
        rest = sum(e.self_cpu_time_total for e in table
                   if e.key.startswith("aten::") and e.key not in GEMM_KERNELS and e.key not in METADATA_OPS)
        gemm, memory = min(gemm, us / 1e6 / steps), min(memory, rest / 1e6 / steps)
    return gemm, memory


def step_bandwidth(memory_seconds: float, modelled, bandwidth: float) -> float:
    """The memory bandwidth (bytes/s) at which the model prices a probe's memory-bound work at its
    profiled time (``memory_seconds``, from :func:`probe_kernel_seconds`).

    ``modelled(b)``: the probe's modelled seconds without dispatch at memory bandwidth ``b``; the bytes
    the model charges at that rate are ``(modelled(bandwidth) - modelled(inf)) x bandwidth``. Kept at
    or below ``bandwidth`` (a copy's rate, which no kernel of a step beats)."""
    nbytes = (modelled(bandwidth) - modelled(1e18)) * bandwidth
    if memory_seconds <= 0 or nbytes <= 0:
        return bandwidth
    return min(nbytes / memory_seconds, bandwidth)


def product_efficiency(gemm_seconds: float, modelled) -> float:
    """The compute efficiency at which the model prices a probe's products at their profiled time.

    ``modelled(e)``: the probe's modelled seconds without dispatch at efficiency ``e``, ``G / e + R``
    with ``G`` its products at the microbenchmarks' rates and ``R`` the rest (memory-bound work), so
    ``G = modelled(0.5) - modelled(1)``; the efficiency is ``G / gemm_seconds``, kept within the
    0.2-1 of :func:`fit_efficiency`'s grid."""
    g = modelled(0.5) - modelled(1.0)
    return min(max(g / gemm_seconds, 0.2), 1.0) if gemm_seconds > 0 else 1.0


def fit_efficiency(probes, modelled, grid=None) -> tuple[float, float]:
    """(efficiency, op_overhead) that best explain the probes' measured steps.

    ``probes``: (seconds, dispatch units) per probe; ``modelled(e)``: the probes' modelled seconds
    without dispatch at compute efficiency ``e`` (a list). A step is modelled as
    ``modelled(e) + units x op_overhead``; for each ``e`` on a grid from 0.2 to 1 (steps of 0.01) the
    non-negative ``op_overhead`` minimising the squared relative errors is solved in closed form, and
    the ``e`` with the smallest error wins. A dispatch-bound probe pins the overhead, a compute-bound
    one the efficiency: the fraction of the microbenchmarks' hot-cache rate that a model's GEMMs get
    inside a training step (cold operands, freshly written gradients). ``grid``: the efficiencies to
    try instead (one: only the overhead is fitted)."""
    import numpy as np

    t = np.array([s for s, _ in probes], dtype=np.float64)
    n = np.array([u for _, u in probes], dtype=np.float64)
    best = (float("inf"), 1.0, 0.0)
    for e in (np.linspace(0.2, 1.0, 81) if grid is None else grid):
        r = (t - np.array(modelled(float(e)), dtype=np.float64)) / t  # relative residual before dispatch
        a = n / t
        o = max(float(np.dot(r, a) / np.dot(a, a)), 0.0)
        err = float(np.sum((r - o * a) ** 2))
        if err < best[0] - 1e-15:
            best = (err, float(e), o)
    return best[1], best[2]


def fit_sync_jitter(seconds: float, graph, cluster, p: int, choose) -> float:
    """The ``Device.sync_jitter`` (s^0.5) at which ``cost.step.step_seconds`` prices a probe's plan at
    its measured step (``seconds``): the step is its cost tables' price without the per-op sync
    stretch plus ``sync_jitter x W``, ``W`` the walk's sum of ``sqrt(compute since the last sync
    point)`` over the plan's sync points (``cost.step.sync_waits`` at a jitter of 1), so
    ``sync_jitter = (seconds - base) / W``, at least 0. ``cluster``: every other rate calibrated;
    ``choose(tables)``: the probe's plan. Fitted on a tensor-parallel probe, whose collectives sit on
    the critical path as most plans' do, it replaces the synthetic rounds' figure (``_sync_jitter``
    in ``execute.calibrate``), which waits for a peer in lock-step microbenchmarks only."""
    from dataclasses import replace

    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.step import sync_waits
    from shardplan.cost.tables import build_tables
    from shardplan.execute.launch import RUN_OPTIMIZER

    unit = replace(cluster, device=replace(cluster.device, sync_jitter=1.0))
    model = AnalyticCostModel(unit, optimizer=RUN_OPTIMIZER)
    tables = build_tables(graph, model, p)
    choice = list(choose(tables))
    waits, stretch = sync_waits(model, tables, choice)
    base = tables.cost_of(choice) - stretch
    return max((seconds - base) / waits, 0.0) if waits > 0 else 0.0


JITTER_HORIZONS = (None, 4e-3, 8e-3, 16e-3, 32e-3, 64e-3)
"""Candidate ``Device.sync_jitter_horizon`` values (seconds; None: none) that :func:`jitter_law` tries."""


def horizon_from_end_wait(wait: float, step: float, fit) -> tuple[float | None, float]:
    """(``Device.sync_jitter_horizon`` in s or None, ``Device.sync_jitter`` at it) that price a step
    with no sync point inside at its measured end wait: for each candidate of ``JITTER_HORIZONS``,
    ``fit(horizon)`` gives the jitter refitted at it (``fit_sync_jitter`` on the tensor-parallel
    probe), and the horizon whose ``jitter x sqrt(min(step, horizon))`` comes nearest ``wait`` (s,
    :func:`end_wait` of the replicated probe, whose compute is ``step`` seconds) wins, the earliest
    on a tie. The law is then pinned at both ends: the tensor-parallel probe's short segments set
    the jitter, a whole step's wait the horizon."""
    best = (float("inf"), None, 0.0)
    for h in JITTER_HORIZONS:
        j = fit(h)
        err = abs(j * math.sqrt(step if h is None else min(step, h)) - wait)
        if err < best[0] - 1e-12:
            best = (err, h, j)
    return best[1], best[2]


def exponent_from_end_wait(wait: float, step: float, fit, iterations: int = 20) -> tuple[float, float]:
    """(``Device.sync_jitter_exponent`` in [0, 1], ``Device.sync_jitter`` at it) of the law
    ``wait = jitter x T ^ exponent`` (no horizon) that prices both a sync-heavy probe's typical step
    and the wait at the end of a step with no sync point inside: ``fit(exponent)`` gives the jitter
    that prices the probe (``fit_sync_jitter`` on the tensor-parallel probe, whose sync points come a
    few ms of compute apart) and ``wait`` (s, :func:`end_wait` of the replicated probe) comes after
    ``step`` seconds of compute. The end wait priced, ``fit(a) x step ^ a``, grows with ``a`` (the
    probe's waits are fixed in sum, and each of its segments is shorter than ``step``), so the
    exponent is found by bisection; 0 (one wait per sync point, whatever the compute before it) or 1
    where the end wait lies outside what the probe allows. A probe priced at or over its step by
    the rest of the model (jitter 0 at every exponent) gives (0.5, 0.0)."""
    def priced(a: float) -> tuple[float, float]:
        j = fit(a)
        return j * step ** a, j

    lo, hi = 0.0, 1.0
    (at_lo, j_lo), (at_hi, j_hi) = priced(lo), priced(hi)
    if j_lo <= 0 and j_hi <= 0:
        return 0.5, 0.0
    if at_lo >= wait:
        return lo, j_lo
    if at_hi <= wait:
        return hi, j_hi
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if priced(mid)[0] > wait:
            hi = mid
        else:
            lo = mid
    a = (lo + hi) / 2
    return a, fit(a)


def wait_laws(typical: float, wait: float, step: float, graph, cluster, p: int, choose,
              laws=("horizon", "exponent")) -> dict:
    """The waits' laws pinned at a sync-heavy probe's typical step (``typical`` seconds, its plan
    ``choose(tables)`` on ``graph``, every other rate from ``cluster``) and at the wait ``wait`` at the
    end of a step of ``step`` seconds with no sync point inside (:func:`end_wait`):
    ``{"horizon": (sync_jitter_horizon, sync_jitter)}``, the square root capped at the horizon of
    :func:`horizon_from_end_wait`, and ``{"exponent": (sync_jitter_exponent, sync_jitter)}``, no
    horizon and the exponent of :func:`exponent_from_end_wait`. ``execute.calibrate`` prices by the
    first and keeps the second in its comments; ``benchmarks/reprice.py --refit`` redoes one of them
    from a saved calibration's comments (``laws``: which to fit, each some twenty jitter fits)."""
    from dataclasses import replace

    def at(**fields):
        return fit_sync_jitter(typical, graph, replace(cluster, device=replace(cluster.device, **fields)), p, choose)

    fits = {"horizon": lambda: horizon_from_end_wait(wait, step, lambda h: at(sync_jitter_horizon=h)),
            "exponent": lambda: exponent_from_end_wait(
                wait, step, lambda a: at(sync_jitter_horizon=None, sync_jitter_exponent=a))}
    return {law: fits[law]() for law in laws}


def jitter_law(points) -> tuple[float, float | None]:
    """(``sync_jitter`` in s^0.5, ``sync_jitter_horizon`` in s or None) that best fit measured waits:
    ``points`` are ``(compute seconds T, wait seconds w)``; for each horizon ``h`` of
    ``JITTER_HORIZONS`` the least-squares ``j`` of ``w = j sqrt(min(T, h))`` is
    ``sum(w x) / sum(x^2)`` with ``x = sqrt(min(T, h))``, and the horizon with the smallest squared
    error wins (the earliest on a tie: a horizon only where it fits strictly better than none)."""
    best = (float("inf"), 0.0, None)
    for h in JITTER_HORIZONS:
        xs = [math.sqrt(max(t, 0.0) if h is None else min(max(t, 0.0), h)) for t, _ in points]
        den = sum(x * x for x in xs)
        if den <= 0:
            continue
        j = max(sum(w * x for (_, w), x in zip(points, xs)) / den, 0.0)
        err = sum((w - j * x) ** 2 for (_, w), x in zip(points, xs))
        if err < best[0] - 1e-18:
            best = (err, j, h)
    return best[1], best[2]

