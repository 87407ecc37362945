"""GPipe, 1F1B and interleaved 1F1B schedules of a :class:`~shardplan.plan.PipelinePlan`, replayed as tasks.

Per stage ``i`` and microbatch ``j``: a forward task ``F(i, j)`` of a third of the stage's
``seconds_per_microbatch`` and a backward task ``B(i, j)`` of two thirds (forward + two backward
GEMMs, the analytic model's split). ``F(i, j)`` waits for the activation from stage ``i - 1``,
``B(i, j)`` for the gradient from stage ``i + 1`` (the last stage's ``B(p-1, j)`` for its own
``F(p-1, j)``). Each stage's compute stream runs its tasks strictly in the schedule's order:

* GPipe (Huang et al. 2019): ``F(i, 0..m-1)`` then ``B(i, m-1..0)``.
* 1F1B (PipeDream-Flush, Narayanan et al. 2021): ``w = min(p - i - 1, m)`` warm-up forwards, then
  alternately one forward and one backward, then the remaining ``w`` backwards.
* Interleaved 1F1B (``plan.chunks = v > 1``): v chunks per rank, see :func:`interleaved_order`.

Point-to-point transfers run on the sender's ``p2p`` stream, one at a time: latency + bytes /
bandwidth on the lowest network level holding two adjacent stages (``p2p_bytes``), or a given
``p2p_seconds``. The planner's ``seconds_per_microbatch`` already includes point-to-point time, so
both default to 0 (no double counting). After its last backward each stage runs its data-parallel
gradient synchronisation on its comm stream: ``sync_seconds`` per stage, by default the plan's own
figure (the plan cost minus ``(m - 1) max T + sum T``, the part its formula charges after the flush).

Memory per stage: ``static_bytes`` resident (default: the record's ``memory_bytes`` minus the
activations the schedule keeps in flight) plus ``activation_bytes`` per microbatch (default 0),
allocated when ``F(i, j)`` starts and freed when ``B(i, j)`` ends. One representative device per
stage (the stage's first rank) is simulated; its ``d x t`` ranks copy it.
"""

from __future__ import annotations

import math

from shardplan.cluster.model import Cluster
from shardplan.cost.memory import inflight_microbatches
from shardplan.plan import PipelinePlan
from shardplan.simulate.engine import TaskGraph
from shardplan.simulate.result import SimResult, summarise


def _per(value, count: int, what: str) -> list[float]:
    if value is None:
        return [0.0] * count
    if isinstance(value, (int, float)):
        return [float(value)] * count
    value = [float(v) for v in value]
    if len(value) != count:
        raise ValueError(f"{what}: {len(value)} values for {count} entries")
    return value


def schedule_order(schedule: str, p: int, i: int, m: int) -> list[tuple[str, int]]:
    """Stage ``i``'s compute order: ("F" | "B", microbatch) pairs."""
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
    if schedule == "1f1b":
        w = min(p - i - 1, m)
        order = [("F", j) for j in range(w)]
        for k in range(m - w):
            order += [("F", w + k), ("B", k)]
        return order + [("B", j) for j in range(m - w, m)]
    raise ValueError(f"schedule must be 'gpipe', '1f1b' or 'interleaved', got {schedule!r}")


def interleaved_order(p: int, v: int, i: int, m: int) -> list[tuple[str, int, int]]:
    """Pipeline rank ``i``'s compute order under interleaved 1F1B (Narayanan et al. 2021, 2.2.2, as
    Megatron-LM runs it; m a multiple of p): ("F" | "B", virtual stage, microbatch) triples.

    Microbatches go through the rank's v chunks in groups of p: the k-th forward is chunk
    ``(k // p) % v`` of microbatch ``(k // (p v)) p + k % p``; backwards take the chunks in reverse.
    Warm-up: ``min(2 (p - i - 1) + (v - 1) p, m v)`` forwards, then one forward and one backward
    alternately, then the remaining backwards."""
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk * p + i, (k // (p * v)) * p + k % p

    w = min(2 * (p - i - 1) + (v - 1) * p, total)
    order = [("F", *unit(k, True)) for k in range(w)]
    for k in range(total - w):
        order += [("F", *unit(w + k, True)), ("B", *unit(k, False))]
    return order + [("B", *unit(k, False)) for k in range(total - w, total)]


def simulate_pipeline(plan: PipelinePlan, cluster: Cluster | None = None, *, p2p_seconds=0.0, p2p_bytes=None,
                      sync_seconds=None, static_bytes=None, activation_bytes=None,
                      overlap: bool = True) -> SimResult:
    """Replay ``plan``'s schedule (see the module doc); per-stage arguments take a number or a list."""
    if plan.chunks > 1:
        return _simulate_interleaved(plan, p2p_seconds=p2p_seconds, sync_seconds=sync_seconds,
                                     static_bytes=static_bytes, activation_bytes=activation_bytes, overlap=overlap)
    stages = plan.stages
    p, m = len(stages), plan.num_microbatches
    T = [s.seconds_per_microbatch for s in stages]
    if sync_seconds is None:
        rest = plan.cost - ((m - 1) * max(T) + sum(T))
        sync = [max(0.0, rest) if math.isfinite(rest) else 0.0] * p
    else:
        sync = _per(sync_seconds, p, "sync_seconds")
    if p2p_bytes is not None:
        if cluster is None:
            raise ValueError("p2p_bytes needs the cluster to price the transfers")
        nbytes = _per(p2p_bytes, p - 1, "p2p_bytes")
        group = stages[0].data_parallel * stages[0].tensor_parallel
        lv = cluster.levels[int(cluster.level_of_span(2 * group))]
        p2p = [lv.latency + b / lv.bandwidth if b > 0 else 0.0 for b in nbytes]
    else:
        p2p = _per(p2p_seconds, p - 1, "p2p_seconds")
    act = _per(activation_bytes, p, "activation_bytes")
    if static_bytes is None:
        static = [max(0.0, s.memory_bytes - inflight_microbatches(plan.schedule, p, i, m) * act[i])
                  for i, s in enumerate(stages)]
    else:
        static = _per(static_bytes, p, "static_bytes")

    ranks, r = [], 0
    for st in stages:
        ranks.append(r)
        r += st.data_parallel * st.tensor_parallel
    orders = [[(what, i, j) for what, j in schedule_order(plan.schedule, p, i, m)] for i in range(p)]
    widths = [st.data_parallel * st.tensor_parallel for st in stages]
    return _replay(T, ranks, widths, orders, m, p2p, act, static, sync, overlap, "stage")


def _simulate_interleaved(plan: PipelinePlan, *, p2p_seconds=0.0, sync_seconds=None, static_bytes=None,
                          activation_bytes=None, overlap: bool = True) -> SimResult:
    """Interleaved 1F1B: the plan's ``stages`` are its p x v chunks, chunk s on pipeline rank s mod p;
    each rank's compute stream runs :func:`interleaved_order`. ``sync_seconds`` (per rank) defaults to
    the plan cost minus ``m max_i D_i + (p - 1) max_s C_s`` (``search.pipeline``'s formula);
    ``p2p_seconds`` and ``activation_bytes`` are per chunk boundary / per chunk."""
    stages, v, m = plan.stages, plan.chunks, plan.num_microbatches
    q = len(stages)
    if q % v:
        raise ValueError(f"{q} pipeline chunks do not divide into {v} per rank")
    p = q // v
    if m % p:
        raise ValueError(f"interleaved 1F1B needs the microbatches ({m}) to be a multiple of the ranks ({p})")
    T = [s.seconds_per_microbatch for s in stages]
    rank_t = [sum(T[s] for s in range(q) if s % p == i) for i in range(p)]
    if sync_seconds is None:
        rest = plan.cost - (m * max(rank_t) + (p - 1) * max(T))
        sync = [max(0.0, rest) if math.isfinite(rest) else 0.0] * p
    else:
        sync = _per(sync_seconds, p, "sync_seconds")
    p2p = _per(p2p_seconds, q - 1, "p2p_seconds")
    act = _per(activation_bytes, q, "activation_bytes")
    if static_bytes is None:
        held = [inflight_microbatches("interleaved", p, i, m, v) * sum(act[s] for s in range(q) if s % p == i)
                for i in range(p)]
        static = [max(0.0, stages[i].memory_bytes - held[i]) for i in range(p)]
    else:
        static = _per(static_bytes, p, "static_bytes")
    width = stages[0].data_parallel * stages[0].tensor_parallel
    orders = [interleaved_order(p, v, i, m) for i in range(p)]
    return _replay(T, [i * width for i in range(p)], [width] * p, orders, m, p2p, act, static, sync, overlap,
                   "chunk")


def _replay(T, dev, widths, orders, m: int, p2p, act, static, sync, overlap: bool, label: str) -> SimResult:
    """Replay a pipeline schedule. Virtual stage s (time ``T[s]`` per microbatch, a third forward)
    sits on pipeline rank ``s mod p`` (p = ``len(dev)``; device ``dev[i]``, standing for ``widths[i]``
    devices), whose compute stream runs ``orders[i]`` (("F" | "B", stage, microbatch) triples) strictly
    in order. Boundary s sends activations forward and gradients back in ``p2p[s]`` seconds (0: a plain
    dependency), ``act[s]`` bytes per microbatch live from F to B, ``static[i]`` bytes stay resident,
    and ``sync[i]`` seconds of gradient synchronisation follow rank i's last backward."""
    p, q = len(dev), len(T)
    tg = TaskGraph()
    F: dict[tuple[int, int], int] = {}
    B: dict[tuple[int, int], int] = {}
    for i in range(p):
        tg.static_bytes[dev[i]] = static[i]
        lane = (dev[i], "compute")
        tg.set_strict(lane)
        if not overlap:
            for stream in ("compute", "comm", "p2p"):
                tg.merge((dev[i], stream), (dev[i], "serial"))
        for what, st, j in orders[i]:
            mem = ((dev[i], act[st]),) if act[st] else ()
            if what == "F":
                F[st, j] = tg.add(f"{label} {st} F{j}", T[st] / 3.0, [lane], alloc=mem)
            else:
                B[st, j] = tg.add(f"{label} {st} B{j}", T[st] - T[st] / 3.0, [lane], free=mem)
    for st in range(q):
        for j in range(m):
            if st + 1 < q:
                if p2p[st] > 0:
                    a = tg.add(f"send act {st}->{st + 1} mb{j}", p2p[st], [(dev[st % p], "p2p")], [F[st, j]],
                               kind="comm")
                    tg.add_dep(F[st + 1, j], a)
                    g = tg.add(f"send grad {st + 1}->{st} mb{j}", p2p[st], [(dev[(st + 1) % p], "p2p")],
                               [B[st + 1, j]], kind="comm")
                    tg.add_dep(B[st, j], g)
                else:
                    tg.add_dep(F[st + 1, j], F[st, j])
                    tg.add_dep(B[st, j], B[st + 1, j])
            else:
                tg.add_dep(B[st, j], F[st, j])
    for i in range(p):
        if sync[i] > 0:  # after the rank's last backward
            tg.add(f"{'stage' if q == p else 'rank'} {i} gradient sync", sync[i], [(dev[i], "comm")],
                   [B[st, j] for st in range(q) if st % p == i for j in range(m)], kind="comm")
    makespan, events, peaks, bound = tg.run()
    flush = max(e.end for e in events if e.stream == "compute")
    busy = sum(T) * m
    bubble = max(0.0, 1.0 - busy / (p * flush)) if flush > 0 else 0.0
    rep = {dev[i] + k: dev[i] for i in range(p) for k in range(widths[i])}
    return summarise(makespan, events, peaks, rep, bound, bubble_fraction=bubble, kind="pipeline")
