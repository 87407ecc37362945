"""Cluster model: identical devices joined by a hierarchy of network levels.

A cluster is ``prod(level.fanout)`` devices. Level 0 groups ``fanout_0`` devices (a node joined by
NVLink or PCIe), level 1 groups ``fanout_1`` level-0 groups (nodes joined by InfiniBand), and so on;
more levels (rack, pod) need no new code. Device ranks are numbered so that ranks ``0..fanout_0-1``
share a node.

Collectives are priced with the alpha-beta model per level (Hockney; Thakur, Rabenseifner & Gropp,
IJHPCA 2005, ring algorithms), composed hierarchically as NCCL does across nodes: a group of ``q``
devices that has ``q_l`` members per level-``l`` step runs the level-0 step on the whole buffer, the
level-1 step on ``1/q_0`` of it, and so on. For a buffer of ``n`` bytes per device:

    all_reduce     = sum_l  2 (q_l - 1) alpha_l + 2 (q_l - 1)/q_l * n_l / beta_l
    all_gather     = sum_l    (q_l - 1) alpha_l +   (q_l - 1)/q_l * n_l / beta_l   (n = gathered size)
    reduce_scatter = all_gather
    all_to_all     = sum_l    (q_l - 1) alpha_l +   (q_l - 1)/q_l * n   / beta_l
    n_l = n / prod_{j<l} q_j     (bytes still in play at level l; for all-to-all every level moves n)

with ``alpha_l`` the level's latency (s) and ``beta_l`` its bandwidth per device (bytes/s, one
direction). Units: bytes, seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np


class ClusterError(ValueError):
    """A cluster description that cannot be used; the message names the bad field."""


@dataclass(frozen=True)
class Device:
    """One accelerator. ``peak_flops`` is the dense rate of the dtype the model trains in."""

    name: str
    peak_flops: float  # FLOP/s
    memory_bytes: float  # bytes of device memory
    memory_bandwidth: float  # bytes/s to device memory
    efficiency: float = 1.0
    """Fraction of peak a large matmul reaches (calibration sets it; 1.0 = the datasheet)."""
    op_overhead: float = 0.0
    """Seconds of host-side dispatch per op and pass (kernel launch, DTensor sharding propagation);
    0 for the datasheet presets, measured by ``shardplan calibrate``."""
    conv_efficiency: float = 1.0
    """A convolution's FLOP rate over a large matmul's (1.0 = the same; measured by ``shardplan
    calibrate``: direct convolution kernels often run well below the GEMM rate on CPUs)."""

    split_op_overhead: float | None = None
    """``op_overhead`` for an op run sharded (any split factor above 1), for a runtime whose dispatch
    costs more on non-replicated placements. None = ``op_overhead``. ``shardplan calibrate`` sets it
    from a Llama probe run data parallel and replicated in turn: on torch 2.13 DTensor a call on
    sharded tensors costs about 1.45x one on replicated tensors (the profiler: 1.53)."""
    redistribute_overhead: float = 0.0
    """Seconds of host work per redistribution of a tensor between two layouts, per direction (the
    forward move, and its gradient's move back), on top of any communication: DTensor's Redistribute
    plans the transform, cuts or wraps the local tensor and records an autograd node even when no
    byte leaves the device (Replicate -> Shard is a local chunk). 0 for the datasheet presets;
    measured by ``shardplan calibrate`` (70-80 us per call on torch 2.13 here, quiet)."""
    all_to_all_by_gather: bool = False
    """The runtime moves a tensor from one split dim to another (an all-to-all) by gathering the split
    dims it leaves and cutting the new one locally: DTensor on CPU process groups (torch 2.13 logs
    "falling back with allgather + chunk"), which receives ``q - 1`` tiles per device where an
    all-to-all receives ``(q - 1) / q`` of one. False (NCCL's all-to-all) for the datasheet presets;
    ``shardplan calibrate`` sets it for a CPU mesh."""
    elementwise_bandwidth: float | None = None
    """Bytes/s that a training step's memory-bound kernels get: the cheap ops capture folds into heavy
    ones (norms, activations, residual adds, softmax), the loss, the optimizer's update and the
    gradient buckets' packing. None = ``memory_bandwidth`` (on a GPU such kernels stream near the
    datasheet rate). Measured by ``shardplan calibrate`` from a Llama probe's profiled kernels: on one
    CPU core they move the bytes the model counts for them at about a third of a 32 MB copy's rate
    (small tensors, broadcasts, several passes per op). A heavy op's own roofline keeps
    ``memory_bandwidth``."""
    pool_bandwidth: float | None = None
    """Bytes of input per second a pooling kernel gets through, forward and backward together; None =
    priced as any memory-bound op (``memory_bandwidth``). Measured by ``shardplan calibrate``: on one
    CPU core a 2x2 max pool reads about 1 GB/s, a twentieth of the copy bandwidth."""
    sync_stretch: float = 0.0
    """How much longer an op's compute takes, as a fraction of it, when a collective on the critical
    path follows it in the same pass: at every such sync point each rank waits for its slowest peer,
    and the wait grows with the compute since the last one (ranks' speeds jitter independently; on a
    shared 2-core VM a compute phase of 0.7-15 ms costs 20-30% more between all-reduces than alone).
    0 for the datasheet presets; measured by ``shardplan calibrate``. Collectives that overlap the
    backward pass (weight-gradient buckets) are no sync point."""
    sync_jitter: float = 0.0
    """Seconds waited at a sync point per ``T ^ sync_jitter_exponent``, ``T`` the seconds of compute
    since the previous one (s^0.5 at the default exponent): ranks' speeds jitter independently, so
    after ``T`` seconds of compute the slowest of them trails the others, by about
    ``sync_jitter x sqrt(T)`` for a random walk, and a collective on the critical path (or the end of
    a step timed on the slowest rank) waits that long. On this 2-core VM, compute phases of 0.5,
    2, 8 and 32 ms followed by an all-reduce waited 0.45, 0.85, 1.9 and 2.7 ms (about
    ``0.019 sqrt(T)``) in lock-step rounds of matrix products: a law of ``T``, not a fixed fraction
    of it; inside real steps the wait grows more slowly (``sync_jitter_exponent``). A plan-level term
    (``cost.step.step_seconds``: it depends on where the plan's sync points fall, so it has no
    per-op share); 0 for the datasheet presets, measured by ``shardplan calibrate``."""
    sync_jitter_horizon: float | None = None
    """Seconds of compute after which the wait at a sync point stops growing: the wait is
    ``sync_jitter x min(T, sync_jitter_horizon) ^ sync_jitter_exponent``. None = no horizon (the law
    holds for any ``T``). On this 2-core VM rounds of 16, 64 and 128 ms of compute before an
    all-reduce waited 1.3-1.8, 1.3-2.2 and 2.3-2.8 ms, where the square root of the short rounds' law
    says 2.6-3.6 and 3.7-5.1 ms for the long ones."""
    sync_jitter_exponent: float = 0.5
    """The power of the compute since the last sync point that the wait grows with, in [0, 1]:
    ``wait = sync_jitter x T ^ sync_jitter_exponent`` (``sync_jitter`` in s^(1 - exponent)). 0.5 is a
    random walk's square root; 0 a fixed wait per sync point. ``shardplan calibrate`` prices by the
    square root capped at a horizon, and keeps in its file's comments the power law, with no
    horizon, that prices both the tensor-parallel probe's typical step (many sync points a few ms
    apart) and the replicated probe's wait at its step's end (one sync point after 70-90 ms):
    exponents of 0 to 0.54 in session 21's calibrations, which ranked the fidelity CNN worse than the
    square root (docs/fidelity.md, session 21). A cluster file may set it."""
    gemm_efficiency: tuple[tuple[float, float], ...] = ()
    """A matrix product's FLOP rate over the large matmul's, by the product's smallest local dimension:
    ``((m_1, e_1), (m_2, e_2), ...)`` with rising ``m``; between points the rate is interpolated in
    ``log m``, outside them the end value holds; empty = 1 everywhere. Measured by ``shardplan
    calibrate`` (on one CPU core a (16 x 1024) @ (1024 x 1024) product runs at about a fifth of a
    512-cubed one's rate)."""

    conv_reduction_efficiency: tuple[tuple[float, float], ...] = ()
    """A convolution's FLOP rate, relative to ``conv_efficiency``'s reference convolution, by its local
    reduction length ``K = in_channels x kernel_h x kernel_w`` (the inner dim of the convolution seen
    as an im2col GEMM): ``((K_1, e_1), ...)`` with rising ``K``, interpolated in ``log K`` as
    ``gemm_efficiency``; empty = 1. Measured by ``shardplan calibrate``: on one CPU core a 3x3
    convolution of 3 input channels (``K = 27``, a CNN's first layer) runs at about a third of the
    rate of one of 64 (``K = 576``)."""
    conv_rows_efficiency: tuple[tuple[float, float], ...] = ()
    """The same by the convolution's local output rows ``M = batch x height x width`` (the im2col
    GEMM's row count); empty = 1. A data-parallel shard of a convolution has half the rows of the
    whole one and, on one CPU core, runs 5-10% below its rate; a 4 x 4 map of batch 8 (``M = 128``)
    at about two thirds of it."""

    @property
    def kernel_bandwidth(self) -> float:
        """Bytes/s of a step's memory-bound kernels: ``elementwise_bandwidth``, else ``memory_bandwidth``."""
        return self.memory_bandwidth if self.elementwise_bandwidth is None else self.elementwise_bandwidth

    def __post_init__(self) -> None:
        for name in ("gemm_efficiency", "conv_reduction_efficiency", "conv_rows_efficiency"):
            _check_curve(name, getattr(self, name))
        for f in ("peak_flops", "memory_bytes", "memory_bandwidth", "conv_efficiency"):
            _check_number("device.", f, getattr(self, f), positive=True)
        for f in ("op_overhead", "sync_stretch", "sync_jitter", "sync_jitter_exponent", "redistribute_overhead"):
            _check_number("device.", f, getattr(self, f), positive=False)
        for f in ("elementwise_bandwidth", "pool_bandwidth", "sync_jitter_horizon"):
            _check_number("device.", f, getattr(self, f), positive=True, optional=True)
        _check_number("device.", "split_op_overhead", self.split_op_overhead, positive=False, optional=True)
        if not 0 <= self.sync_jitter_exponent <= 1:
            raise ClusterError(f"device.sync_jitter_exponent must be in [0, 1], got {self.sync_jitter_exponent!r}")
        if not 0 < self.efficiency <= 1:
            raise ClusterError(f"device.efficiency must be in (0, 1], got {self.efficiency!r}")


@dataclass(frozen=True)
class Level:
    """One network level: ``fanout`` members (devices, or groups of the level below) per group."""

    name: str
    fanout: int
    bandwidth: float  # bytes/s per device, one direction
    latency: float  # seconds per message step
    gather_bandwidth: float | None = None
    """``bandwidth`` for the one-way collectives (all-gather, reduce-scatter, all-to-all) and the moves
    of a tensor between layouts on edges, for a runtime whose gathers run slower than its all-reduce
    (DTensor on gloo: a 16 MB all-gather of two ranks takes 10.5 ms where the all-reduce's bandwidth
    says 7); None = ``bandwidth``. Measured by ``shardplan calibrate``."""
    gather_latency: float | None = None
    """``latency`` for the same (DTensor on gloo: a 1 KB all-gather of two ranks takes 450 us, its
    all-reduce 350 us, which the ring model reads as two steps of 175 us); None = ``latency``."""
    all_to_all_bandwidth: float | None = None
    """``gather_bandwidth`` for the all-to-alls a runtime issues itself, outside DTensor's
    redistributions (``execute.experts``' token dispatch: c10d's ``all_to_all_single``); None = the
    one-way collectives' (``move_bandwidth``). Measured by ``shardplan calibrate``."""
    all_to_all_latency: float | None = None
    """``gather_latency`` for the same (gloo, two ranks: about 100 us for 1 KB against DTensor's
    all-gather's 430); None = ``move_latency``."""

    @property
    def move_bandwidth(self) -> float:
        """Bytes/s of a one-way collective or an edge's move: ``gather_bandwidth``, else ``bandwidth``."""
        return self.bandwidth if self.gather_bandwidth is None else self.gather_bandwidth

    @property
    def move_latency(self) -> float:
        """Seconds per step of a one-way collective or an edge's move: ``gather_latency``, else ``latency``."""
        return self.latency if self.gather_latency is None else self.gather_latency

    @property
    def a2a_bandwidth(self) -> float:
        """Bytes/s of an all-to-all: ``all_to_all_bandwidth``, else ``move_bandwidth``."""
        return self.move_bandwidth if self.all_to_all_bandwidth is None else self.all_to_all_bandwidth

    @property
    def a2a_latency(self) -> float:
        """Seconds per step of an all-to-all: ``all_to_all_latency``, else ``move_latency``."""
        return self.move_latency if self.all_to_all_latency is None else self.all_to_all_latency

    def __post_init__(self) -> None:
        if not isinstance(self.fanout, int) or isinstance(self.fanout, bool) or self.fanout < 1:
            raise ClusterError(f"level {self.name!r}: fanout must be a positive integer, got {self.fanout!r}")
        where = f"level {self.name!r}: "
        _check_number(where, "bandwidth", self.bandwidth, positive=True)
        _check_number(where, "latency", self.latency, positive=False)
        _check_number(where, "gather_bandwidth", self.gather_bandwidth, positive=True, optional=True)
        _check_number(where, "gather_latency", self.gather_latency, positive=False, optional=True)
        _check_number(where, "all_to_all_bandwidth", self.all_to_all_bandwidth, positive=True, optional=True)
        _check_number(where, "all_to_all_latency", self.all_to_all_latency, positive=False, optional=True)


@dataclass(frozen=True)
class Cluster:
    name: str
    device: Device
    levels: tuple[Level, ...]
    _span: tuple[int, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if not self.levels:
            raise ClusterError(f"cluster {self.name!r}: needs at least one network level")
        span, acc = [], 1
        for lv in self.levels:
            acc *= lv.fanout
            span.append(acc)
        object.__setattr__(self, "_span", tuple(span))

    @property
    def num_devices(self) -> int:
        return self._span[-1]

    @property
    def devices_per_node(self) -> int:
        return self.levels[0].fanout

    @property
    def spans(self) -> tuple[int, ...]:
        """Devices inside one group of each level (cumulative fanouts)."""
        return self._span

    def with_devices(self, devices: int) -> "Cluster":
        """The same machine cut or grown (top level) to hold at least ``devices`` devices."""
        if devices < 1:
            raise ClusterError(f"devices must be a positive integer, got {devices}")
        below = self._span[-2] if len(self.levels) > 1 else 1
        top = self.levels[-1]
        if len(self.levels) == 1 and devices <= top.fanout:
            return self
        groups = max(1, math.ceil(devices / below))
        if len(self.levels) == 1:
            raise ClusterError(f"cluster {self.name!r} has {self.num_devices} devices; {devices} requested")
        levels = self.levels[:-1] + (replace(top, fanout=groups),)
        return Cluster(self.name, self.device, levels)

    def level_of_span(self, devices: np.ndarray | int) -> np.ndarray:
        """Index of the lowest level whose groups hold ``devices`` consecutive ranks."""
        return np.minimum(np.searchsorted(np.array(self._span), np.asarray(devices), side="left"),
                          len(self.levels) - 1)

    def per_level(self, group: np.ndarray, stride: np.ndarray) -> np.ndarray:
        """Members per level of groups of ``group`` devices at rank distance ``stride``.

        ``group`` and ``stride`` broadcast together; the result has a trailing axis of one entry per
        level with product ``group``. A group of q ranks spaced by s occupies rank offsets
        s, 2s, .., (q-1)s; level l holds the factor of it that lies within [span_{l-1}, span_l).
        """
        group = np.asarray(group, dtype=np.float64)
        stride = np.asarray(stride, dtype=np.float64)
        lo = np.concatenate([[1.0], np.array(self._span[:-1], dtype=np.float64)])
        hi = np.array(self._span, dtype=np.float64)
        hi[-1] = np.inf  # the top level takes whatever is left
        first, last = stride[..., None], (stride * group)[..., None]
        return np.maximum(np.minimum(last, hi) / np.maximum(first, lo), 1.0)


def collective_seconds(cluster: Cluster, kind: str, nbytes: np.ndarray, q_levels: np.ndarray,
                       latency_share=1.0) -> np.ndarray:
    """Alpha-beta time of one collective; ``q_levels[..., l]`` members per level (see module doc).
    ``latency_share``: the fraction of the collective's latency terms this message pays (a tensor
    reduced in a bucket with others pays its share of the bucket's; 1 for a collective of its own)."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    q = np.asarray(q_levels, dtype=np.float64)
    total = np.zeros(np.broadcast_shapes(nbytes.shape, q.shape[:-1]))
    remaining = nbytes
    for l, lv in enumerate(cluster.levels):
        ql = q[..., l]
        frac = (ql - 1.0) / ql
        latency = latency_share * lv.latency
        if kind == "all_reduce":
            total = total + 2.0 * (ql - 1.0) * latency + 2.0 * frac * remaining / lv.bandwidth
        elif kind in ("all_gather", "reduce_scatter"):
            total = total + (ql - 1.0) * latency_share * lv.move_latency + frac * remaining / lv.move_bandwidth
        elif kind == "all_to_all":
            total = total + (ql - 1.0) * latency_share * lv.a2a_latency + frac * nbytes / lv.a2a_bandwidth
        else:
            raise ValueError(f"unknown collective {kind!r}")
        remaining = remaining / ql
    return total


def _check_number(where: str, name: str, value, *, positive: bool, optional: bool = False) -> None:
    """Refuse, naming the field, a value that is not a number (a bool is not one) or not above 0
    (``positive``) or below 0; ``optional``: None passes (the field is unset)."""
    if optional and value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value > 0 if positive else value >= 0):
        raise ClusterError(f"{where}{name} must be a {'positive' if positive else 'non-negative'} number, "
                           f"got {value!r}")


def _check_curve(name: str, pts) -> None:
    """A device efficiency curve: a tuple of (size, efficiency) pairs of positive numbers, sizes rising."""
    if not isinstance(pts, tuple) or any(not isinstance(q, tuple) or len(q) != 2 or not q[0] > 0 or not q[1] > 0
                                         for q in pts):
        raise ClusterError(f"device.{name} must be a list of [size, efficiency] pairs of positive numbers, "
                           f"got {pts!r}")
    if any(a[0] >= b[0] for a, b in zip(pts, pts[1:])):
        raise ClusterError(f"device.{name} must list rising sizes, got {pts!r}")


def curve_factor(points: tuple[tuple[float, float], ...], sizes) -> np.ndarray:
    """An efficiency curve (``Device.gemm_efficiency`` and the convolution curves) at ``sizes`` (an
    array): log-linear between the measured points, the end values outside them, 1 without points."""
    m = np.asarray(sizes, dtype=np.float64)
    if not points:
        return np.ones_like(m)
    xs = np.log([q[0] for q in points])
    ys = np.array([q[1] for q in points])
    return np.interp(np.log(np.maximum(m, 1.0)), xs, ys)


def gemm_factor(device: Device, smallest) -> np.ndarray:
    """``device.gemm_efficiency`` at the smallest local dims ``smallest`` (an array)."""
    return curve_factor(device.gemm_efficiency, smallest)
