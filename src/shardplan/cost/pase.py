"""PaSE's published cost function, in its own units (Elango, IPDPS 2021, section III and code).

Units: "FLOP-equivalents" per training step and per device. Compute is counted in multiply-adds of
the sharded op (forward + two backward GEMMs); every communicated word (8 bytes) costs
``r = peak FLOP/s / word bandwidth`` FLOPs. PaSE's default machine, 10 TFLOP/s and 16 GB/s, gives
``r = 10e12 / (16e9 / 8) = 5000``. Divide a cost by the peak FLOP/s to get seconds.

Notation below: ``x'`` is a dim's extent per device (``x / c_x``), ``AR(w, q) = r * 2 (q-1) w / q``
the bandwidth term of a ring all-reduce of a w-word per-device buffer among q devices.
Formulas and quirks follow ``shared/reference/pase.md`` sections 5 and 7, op for op:

* GEMM-like ops (conv, fc, einsum, embedding): dims group into batch B, m, n, k by which operands
  hold them. compute ``B' (3 m'n'k' + 3 pw m'n')``; communication
  ``B' (AR(m'n', c_k) + AR(m'k', c_n) + AR(n'k', c_m))``.
* LSTM: GEMM over (layers, seq*batch, 4u, 2u) with pw = 3, plus a per-time-step relayout of the
  cell output into the next cell's input, times layers * seq.
* pool: ``prod(dom')`` plus halo words; norm: ``16 elems' + 4 AR(elems'/a', c_a) + 4 AR(a', others)``;
  softmax, softmax-xent, reduce-mean and elementwise as in PaSE; concat/stack/reshape cost 0.
* Edges: ``2 r max(0, prod(T) - [procs_dst <= procs_src] prod(min(S, T)))`` with S, T the
  producer and consumer tiles (forward activation plus backward gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardplan.cost.configs import ConfigSpace, operand_layouts
from shardplan.cost.tables import NodeCosts
from shardplan.ir.graph import Graph, GraphError, Op, TensorSpec

WORD_BYTES = 8  # PaSE counts words of 8 bytes


@dataclass(frozen=True)
class PaseCostModel:
    """PaSE's cost model. ``r`` = FLOPs per communicated word (default 5000 = 10 TFLOP/s / 2 GWords/s)."""

    r: float = 5000.0
    cutoff: int | None = None
    """PaSE's minimum slice per device; None takes the graph's hint (4 for CNNs, 1 otherwise)."""
    dedup_edges: bool = True
    """PaSE keeps one transfer per (producer, consumer) pair, the last one (its networkx quirk)."""
    name: str = "pase"
    unit: str = "FLOP-equivalents"

    @staticmethod
    def from_machine(peak_flops: float, bandwidth_bytes_per_s: float, **kw) -> "PaseCostModel":
        return PaseCostModel(r=peak_flops / (bandwidth_bytes_per_s / WORD_BYTES), **kw)

    def config_space(self, graph: Graph, devices: int) -> ConfigSpace:
        cutoff = self.cutoff if self.cutoff is not None else int(graph.hint("pase_cutoff", 1))
        return ConfigSpace(devices=devices, cutoff=cutoff, product="at_most")

    def frozen_dims(self, op: Op) -> frozenset[str]:
        if op.kind == "conv":
            return frozenset(d.name for d in op.dims if d.kind.value == "spatial")  # no halo exchange
        if op.kind == "lstm":
            return frozenset({"seq"})
        if op.kind == "moe":
            return frozenset({"experts_a2a"})  # PaSE prices no all-to-all: its experts split gathers
        return frozenset()

    # -- node costs ----------------------------------------------------------------------------
    def node_costs(self, graph: Graph, op: Op, configs: np.ndarray) -> NodeCosts:
        fn = _NODE.get(op.kind)
        if fn is None:
            raise GraphError(f"op {op.name!r}: the pase cost model has no formula for kind {op.kind!r}")
        c = configs.astype(np.float64)
        sizes = np.array([d.size for d in op.dims], dtype=np.float64)
        compute, comm = fn(self, graph, op, c, sizes)
        zeros = np.zeros(len(configs))
        compute = zeros + compute
        comm = zeros + comm
        return NodeCosts(total=compute + comm, compute=compute, comm=comm, memory=zeros)

    def AR(self, words: np.ndarray, procs: np.ndarray) -> np.ndarray:
        """Ring all-reduce bandwidth term in FLOP-equivalents; 0 when procs == 1."""
        return self.r * ((words / procs) * (2.0 * (procs - 1)))

    # -- edge costs ----------------------------------------------------------------------------
    def edge_costs(self, graph: Graph, tensor: TensorSpec, src_layouts: np.ndarray,
                   dst_layouts: np.ndarray) -> np.ndarray:
        """Cost matrix (L_src, L_dst) of moving a tensor between every pair of layouts."""
        return self.r * (2.0 * redistribution_words(tensor.shape, src_layouts, dst_layouts))


def redistribution_words(shape: tuple[int, ...], src_layouts: np.ndarray, dst_layouts: np.ndarray) -> np.ndarray:
    """Elements a consumer device lacks, (L_src, L_dst): its tile minus what it already holds.

    PaSE's rule: a device holds the overlap of its producer and consumer tiles only when the consumer
    runs on no more devices than the producer; otherwise it fetches its whole tile.
    """
    t = np.array(shape, dtype=np.float64)
    S = t / src_layouts[:, None, :]
    T = t / dst_layouts[None, :, :]
    src_procs = np.prod(src_layouts, axis=1).astype(np.float64)[:, None]
    dst_procs = np.prod(dst_layouts, axis=1).astype(np.float64)[None, :]
    needed = np.prod(T, axis=2)
    inter = np.where(dst_procs > src_procs, 0.0, np.prod(np.minimum(S, T), axis=2))
    return np.clip(needed - inter, 0.0, None)


# -- per-kind formulas: each returns (compute, comm) arrays over configurations ------------------

def _groups(op: Op) -> tuple[list[int], list[int], list[int], list[int]]:
    """(batch, m, n, k) dim indices of a two-input contraction, from operand membership."""
    out = set(op.outputs[0].dims())
    a = set(op.inputs[0].dims())
    b = set(op.inputs[1].dims())
    batch, m, n, k = [], [], [], []
    for i, name in enumerate(op.dim_names):
        if name not in out:
            k.append(i)
        elif name in a and name in b:
            batch.append(i)
        elif name in a:
            m.append(i)
        elif name in b:
            n.append(i)
        else:
            raise GraphError(f"op {op.name!r}: dim {name!r} is in the output but in neither input")
    return batch, m, n, k


def _gemm(model: PaseCostModel, per_proc_batch, m, n, k, cm, cn, ck, pw: int):
    comp = 3.0 * (m * n * k)
    if pw > 0:
        comp = comp + (3 * pw) * (m * n)
    comm = model.AR(m * n, ck) + model.AR(m * k, cn) + model.AR(n * k, cm)
    return per_proc_batch * comp, per_proc_batch * comm


def _contraction(model, graph, op, c, sizes):
    batch, m, n, k = _groups(op)
    per = sizes / c
    prod = lambda idx, arr: np.prod(arr[:, idx], axis=1) if idx else np.ones(len(arr))  # noqa: E731
    return _gemm(model, prod(batch, per), prod(m, per), prod(n, per), prod(k, per),
                 prod(m, c), prod(n, c), prod(k, c), int(op.attr("pw_ops", 0)))


def _lstm(model, graph, op, c, sizes):
    L, S, B, N, K = (op.dim_index(x) for x in ("layers", "seq", "batch", "hidden_out", "hidden_in"))
    u_out, u_in = sizes[N], sizes[K]
    per_L = sizes[L] / c[:, L]
    m = (sizes[S] * sizes[B]) / (c[:, S] * c[:, B])
    n = (4 * u_out) / c[:, N]
    k = (2 * u_in) / c[:, K]
    comp, comm = _gemm(model, per_L, m, n, k, c[:, S] * c[:, B], c[:, N], c[:, K], 3)
    # Re-layout of each cell output (b', n') into the next cell's input (b', k'), every time step.
    src_tile = np.stack([sizes[B] / c[:, B], u_out / c[:, N]], axis=1)
    dst_tile = np.stack([sizes[B] / c[:, B], u_in / c[:, K]], axis=1)
    src_procs, dst_procs = c[:, B] * c[:, N], c[:, B] * c[:, K]
    inter = np.where(dst_procs > src_procs, 0.0, np.prod(np.minimum(src_tile, dst_tile), axis=1))
    words = np.clip(np.prod(dst_tile, axis=1) - inter, 0.0, None)
    comm = comm + (sizes[L] * sizes[S]) * (model.r * words)
    return comp, comm


def _pool(model, graph, op, c, sizes):
    comp = np.prod(sizes / c, axis=1)
    r, s = op.attr("kernel")
    shape = np.array(graph.tensor(op.inputs[0].tensor).shape, dtype=np.float64)
    layout = operand_layouts(op, c.astype(np.int64), op.inputs[0].axes).astype(np.float64)
    return comp, _halo_words(shape, layout, r, s) * model.r


def _halo_words(shape: np.ndarray, layout: np.ndarray, r: int, s: int) -> np.ndarray:
    """Ghost elements a device needs from its neighbours for an (r, s) window (PaSE, NCHW)."""
    tile = shape / layout
    h = tile[:, 2] + np.where(layout[:, 2] > 1, r, 0)
    w = tile[:, 3] + np.where(layout[:, 3] > 1, s, 0)
    return (h * w - tile[:, 2] * tile[:, 3]) * tile[:, 0] * tile[:, 1]


def _norm(model, graph, op, c, sizes):
    a = op.dim_index(op.attr("axis"))
    per = sizes / c
    elems = np.prod(per, axis=1)
    comp = 16.0 * elems
    others = np.prod(np.delete(c, a, axis=1), axis=1)
    comm = 4.0 * model.AR(elems / per[:, a], c[:, a]) + 4.0 * model.AR(per[:, a], others)
    return comp, comm


def _softmax(model, graph, op, c, sizes):
    a = op.dim_index(op.attr("axis"))
    per = sizes / c
    elems = np.prod(per, axis=1)
    comp = 4.0 * elems + elems * sizes[a]
    rows = np.prod(np.delete(per, a, axis=1), axis=1)
    comm = model.AR(rows, c[:, a]) + model.AR(rows * sizes[a], c[:, a]) + model.AR(rows, c[:, a])
    return comp, comm


def _softmax_xent(model, graph, op, c, sizes):
    per = sizes / c
    rows = np.prod(per[:, :-1], axis=1)
    comp = 4.0 * np.prod(per, axis=1) + rows + rows
    comm = np.where(c[:, -1] > 1, model.r * (2.0 * rows), 0.0)
    return comp, comm


def _reduce_mean(model, graph, op, c, sizes):
    idx = [op.dim_index(n) for n in op.attr("reduced")]
    return 0.0, model.AR(np.prod(sizes / c, axis=1), np.prod(c[:, idx], axis=1))


def _elementwise(model, graph, op, c, sizes):
    return (1 + int(op.attr("pw_ops", 0))) * np.prod(sizes / c, axis=1), 0.0


def _free(model, graph, op, c, sizes):
    return 0.0, 0.0


_NODE = {
    "conv": _contraction, "fc": _contraction, "einsum": _contraction, "embedding": _contraction, "moe": _contraction,
    "lstm": _lstm, "pool": _pool, "norm": _norm, "softmax": _softmax, "softmax_xent": _softmax_xent,
    "reduce_mean": _reduce_mean, "elementwise": _elementwise,
    "concat": _free, "stack": _free, "unstack": _free, "reshape": _free, "transpose": _free,
}
