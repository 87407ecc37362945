"""What the capture walker knows about a value, and the helpers its two halves share
(``capture.export``: traversal and folding; ``capture.heavy``: the heavy-op handlers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardplan.ir.graph import Dim


class CaptureError(ValueError):
    """A module that cannot be captured; the message names the op and the module."""


def _unique(dims: list[Dim]) -> list[Dim]:
    """The dims with names made unique within the op (a second ``batch`` becomes ``batch_``)."""
    seen, out = set(), []
    for d in dims:
        nm = d.name
        while nm in seen:
            nm += "_"
        seen.add(nm)
        out.append(Dim(nm, d.size, d.kind, d.splittable))
    return out


@dataclass
class _Val:
    """What a node's value is, as far as the planner cares."""

    source: str | None  # IR tensor it comes from; None: a constant (masks, positions, buffers)
    amap: tuple[tuple[int, ...], ...] = ()  # per axis of this value: axes of ``source`` composing it
    params: tuple[str, ...] = ()  # parameters of folded ops on the way
    parts: list = field(default_factory=list)  # for multi-output nodes (split, lstm): one _Val each
    cheap: tuple[str, ...] = ()  # folded compute ops on the way (node names), priced on the consumer


def _labels_for_input(shape, is_float: bool) -> tuple[str, ...]:
    n = len(shape)
    if not is_float:
        return ("batch", "seq")[:n] + tuple(f"d{i}" for i in range(2, n))
    return {1: ("batch",), 2: ("batch", "features"), 3: ("batch", "seq", "features"),
            4: ("batch", "channels", "height", "width")}.get(n, ("batch",) + tuple(f"d{i}" for i in range(1, n)))
