"""Timelines of a :class:`~shardplan.simulate.result.SimResult`: Chrome trace JSON and a PNG Gantt chart.

The Chrome trace event format (Google, "Trace Event Format", docs.google.com/document/d/1CvAClvFfyA5R-
PhYUmn5OOQtYMH4h6I0nSsKchNAySU): complete events ``{"ph": "X", "name", "ts", "dur", "pid", "tid"}``
with times in microseconds; ``pid`` is the device rank, ``tid`` the stream (0 compute, 1 comm,
2 p2p), named by "M" (metadata) events. Perfetto (ui.perfetto.dev) and chrome://tracing open it.
matplotlib is imported only inside :func:`save_timeline_png` (Agg backend, no display needed).
"""

from __future__ import annotations

STREAM_TIDS = {"compute": 0, "comm": 1, "p2p": 2}
COLOURS = {"compute": "#4C72B0", "comm": "#DD8452", "wait": "#AAAAAA"}


def _device_events(result, all_devices: bool):
    """(device, event) pairs; with ``all_devices`` every device repeats its representative's events."""
    by_dev: dict[int, list] = {}
    for e in result.events:
        by_dev.setdefault(e.device, []).append(e)
    if not all_devices:
        return [(e.device, e) for e in result.events]
    out = []
    for dev in sorted(result.representative):
        for e in by_dev.get(result.representative[dev], []):
            out.append((dev, e))
    return out


def chrome_trace(result, all_devices: bool = False) -> dict:
    events = []
    devices, streams = set(), set()
    for dev, e in _device_events(result, all_devices):
        tid = STREAM_TIDS.get(e.stream, 3)
        devices.add(dev)
        streams.add((dev, e.stream, tid))
        events.append({"name": e.name, "cat": e.kind, "ph": "X", "ts": e.start * 1e6,
                       "dur": (e.end - e.start) * 1e6, "pid": dev, "tid": tid,
                       "args": {"stream": e.stream}})
    meta = []
    for dev in sorted(devices):
        rep = result.representative.get(dev, dev)
        label = f"device {dev}" + (f" (as device {rep})" if rep != dev else "")
        meta.append({"name": "process_name", "ph": "M", "ts": 0, "dur": 0, "pid": dev, "tid": 0,
                     "args": {"name": label}})
    for dev, stream, tid in sorted(streams):
        meta.append({"name": "thread_name", "ph": "M", "ts": 0, "dur": 0, "pid": dev, "tid": tid,
                     "args": {"name": stream}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"iteration_seconds": result.iteration_seconds, "kind": result.kind}}


def save_timeline_png(result, path: str, all_devices: bool = False) -> str:
    """One row per (device, stream), bars coloured by compute / comm; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows: dict[tuple[int, str], list[tuple[float, float]]] = {}
    kinds: dict[tuple[int, str], list[str]] = {}
    for dev, e in _device_events(result, all_devices):
        key = (dev, e.stream)
        rows.setdefault(key, []).append((e.start * 1e3, (e.end - e.start) * 1e3))
        kinds.setdefault(key, []).append(e.kind)
    order = sorted(rows, key=lambda k: (k[0], STREAM_TIDS.get(k[1], 3)))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.35 * max(1, len(order))))
    for y, key in enumerate(order):
        colours = [COLOURS.get(k, "#55A868") for k in kinds[key]]
        ax.broken_barh(rows[key], (y - 0.4, 0.8), facecolors=colours, edgecolor="black", linewidth=0.2)
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([f"dev {d} {s}" for d, s in order])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, max(result.iteration_seconds * 1e3, 1e-9))
    ax.set_title(f"simulated iteration: {result.iteration_seconds * 1e3:.3f} ms")
    shown = {k for ks in kinds.values() for k in ks} | {"compute", "comm"}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items() if k in shown],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
