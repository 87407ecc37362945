"""What a simulation returns: :class:`SimResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardplan.simulate.engine import Event


@dataclass(frozen=True)
class SimResult:
    """One simulated training iteration. Units: seconds and bytes.

    Per-device figures are dicts indexed by device rank, for every device of the plan. Only the
    devices in ``representative.values()`` were simulated; every other device copies the figures of
    its representative (SPMD plans: device 0 stands for all; pipelines: a stage's first rank stands
    for the stage). ``events`` lists the simulated devices' executed tasks (a collective gives one
    event per simulated member).

    * ``compute_seconds`` / ``comm_seconds``: busy time of the device's compute stream / its
      communication streams (``comm`` and, in pipelines, ``p2p``).
    * ``idle_seconds``: time in ``[0, iteration_seconds]`` when none of the device's streams runs.
    * ``peak_memory_bytes``: the largest peak over devices (``peak_memory_by_device`` per device):
      parameters, gradients and optimizer states resident throughout, plus kept activations
      allocated at their forward and freed at the end of their backward.
    * ``dependency_bound_seconds``: the longest chain of dependent tasks (no stream contention), a
      lower bound on ``iteration_seconds``.
    * ``bubble_fraction``: pipelines only, ``1 - sum of stage compute / (stages x flush time)``
      (flush time: the end of the last backward, before the gradient sync); None for SPMD plans.
    """

    iteration_seconds: float
    compute_seconds: dict[int, float]
    comm_seconds: dict[int, float]
    idle_seconds: dict[int, float]
    peak_memory_bytes: float
    events: tuple[Event, ...]
    peak_memory_by_device: dict[int, float] = field(default_factory=dict)
    representative: dict[int, int] = field(default_factory=dict)
    dependency_bound_seconds: float = 0.0
    bubble_fraction: float | None = None
    kind: str = "spmd"

    @property
    def devices(self) -> int:
        return len(self.compute_seconds)

    def to_chrome_trace(self, all_devices: bool = False) -> dict:
        """Chrome trace event format (``{"traceEvents": [...]}``, "X" events, pid = device, tid =
        stream, microseconds); opens in Perfetto (ui.perfetto.dev) and chrome://tracing.
        ``all_devices``: also draw the devices that were not simulated (copies of their representative)."""
        from shardplan.simulate.trace import chrome_trace

        return chrome_trace(self, all_devices=all_devices)

    def save_timeline_png(self, path: str, all_devices: bool = False) -> str:
        """A Gantt chart (one row per device and stream, compute and comm coloured apart) as PNG."""
        from shardplan.simulate.trace import save_timeline_png

        return save_timeline_png(self, path, all_devices=all_devices)


def summarise(makespan: float, events: list[Event], peaks: dict[int, float], representative: dict[int, int],
              dependency_bound: float, bubble_fraction: float | None = None, kind: str = "spmd") -> SimResult:
    """Per-device busy and idle time from the simulated devices' events."""
    compute: dict[int, float] = {}
    comm: dict[int, float] = {}
    intervals: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        d = e.end - e.start
        if e.stream == "compute":
            compute[e.device] = compute.get(e.device, 0.0) + d
        else:
            comm[e.device] = comm.get(e.device, 0.0) + d
        if d > 0:
            intervals.setdefault(e.device, []).append((e.start, e.end))
    idle: dict[int, float] = {}
    for dev in set(representative.values()):
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in sorted(intervals.get(dev, [])):
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        idle[dev] = max(0.0, makespan - busy)
    out_compute = {d: compute.get(r, 0.0) for d, r in representative.items()}
    out_comm = {d: comm.get(r, 0.0) for d, r in representative.items()}
    out_idle = {d: idle[r] for d, r in representative.items()}
    out_peak = {d: peaks.get(r, 0.0) for d, r in representative.items()}
    return SimResult(makespan, out_compute, out_comm, out_idle, max(out_peak.values(), default=0.0),
                     tuple(events), out_peak, dict(representative), dependency_bound, bubble_fraction, kind)
