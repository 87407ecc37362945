"""GPipe and 1F1B schedules of a :class:`~shardplan.plan.PipelinePlan`, replayed as tasks.

Per stage ``i`` and microbatch ``j``: a forward task ``F(i, j)`` of a third of the stage's
``seconds_per_microbatch`` and a backward task ``B(i, j)`` of two thirds (forward + two backward
GEMMs, the analytic model's split). ``F(i, j)`` waits for the activation from stage ``i - 1``,
``B(i, j)`` for the gradient from stage ``i + 1`` (the last stage's ``B(p-1, j)`` for its own
``F(p-1, j)``). Each stage's compute stream runs its tasks strictly in the schedule's order:

* GPipe (Huang et al. 2019): ``F(i, 0..m-1)`` then ``B(i, m-1..0)``.
* 1F1B (PipeDream-Flush, Narayanan et al. 2021): ``w = min(p - i - 1, m)`` warm-up forwards, then
  alternately one forward and one backward, then the remaining ``w`` backwards.

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
    raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r} (interleaved 1F1B is not simulated yet)")


def simulate_pipeline(plan: PipelinePlan, cluster: Cluster | None = None, *, p2p_seconds=0.0, p2p_bytes=None,
                      sync_seconds=None, static_bytes=None, activation_bytes=None,
                      overlap: bool = True) -> SimResult:
    """Replay ``plan``'s schedule (see the module doc); per-stage arguments take a number or a list."""
    if plan.chunks != 1:
        raise ValueError("interleaved 1F1B (chunks > 1) is not simulated yet")
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
    for s in stages:
        ranks.append(r)
        r += s.data_parallel * s.tensor_parallel
    tg = TaskGraph()
    F: dict[tuple[int, int], int] = {}
    B: dict[tuple[int, int], int] = {}
    for i in range(p):
        dev = ranks[i]
        tg.static_bytes[dev] = static[i]
        lane = (dev, "compute")
        tg.set_strict(lane)
        if not overlap:
            for stream in ("compute", "comm", "p2p"):
                tg.merge((dev, stream), (dev, "serial"))
        for what, j in schedule_order(plan.schedule, p, i, m):
            mem = ((dev, act[i]),) if act[i] else ()
            if what == "F":
                F[i, j] = tg.add(f"stage {i} F{j}", T[i] / 3.0, [lane], alloc=mem)
            else:
                B[i, j] = tg.add(f"stage {i} B{j}", T[i] - T[i] / 3.0, [lane], free=mem)
    for i in range(p):
        for j in range(m):
            if i + 1 < p:
                if p2p[i] > 0:
                    s = tg.add(f"send act {i}->{i + 1} mb{j}", p2p[i], [(ranks[i], "p2p")], [F[i, j]], kind="comm")
                    tg.add_dep(F[i + 1, j], s)
                    s = tg.add(f"send grad {i + 1}->{i} mb{j}", p2p[i], [(ranks[i + 1], "p2p")], [B[i + 1, j]],
                               kind="comm")
                    tg.add_dep(B[i, j], s)
                else:
                    tg.add_dep(F[i + 1, j], F[i, j])
                    tg.add_dep(B[i, j], B[i + 1, j])
            else:
                tg.add_dep(B[i, j], F[i, j])
    for i in range(p):
        if sync[i] > 0:  # after the stage's last backward
            tg.add(f"stage {i} gradient sync", sync[i], [(ranks[i], "comm")], [B[i, j] for j in range(m)],
                   kind="comm")
    makespan, events, peaks, bound = tg.run()
    flush = max(e.end for e in events if e.stream == "compute")
    busy = sum(T) * m
    bubble = max(0.0, 1.0 - busy / (p * flush)) if flush > 0 else 0.0
    rep = {}
    for i, s in enumerate(stages):
        for k in range(s.data_parallel * s.tensor_parallel):
            rep[ranks[i] + k] = ranks[i]
    return summarise(makespan, events, peaks, rep, bound, bubble_fraction=bubble, kind="pipeline")
