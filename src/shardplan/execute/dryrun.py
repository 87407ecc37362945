"""A plan's training step on N ranks without N processes (``shardplan run --dry-run``).

One process plays rank 0 of a fake process group of ``devices`` ranks (``torch.testing``'s fake
backend: every collective returns at once and moves nothing) while the model lives in fake tensors
(``FakeTensorMode``: shapes and dtypes, no storage, no arithmetic). The plan is applied exactly as
``shardplan run`` applies it (``execute.apply``) and one training step runs: forward, loss, backward
and the bucketed gradient reduction. So a plan for 64 ranks of a model that fits no machine here is
checked in seconds, before any cluster is booked:

* everything DTensor decides at run time (sharding propagation, the redistributions the plan asks
  for, the per-rank products) runs for real on rank 0's shapes, so a plan the runtime cannot execute
  fails here, with the reason, instead of in N processes;
* every collective the step issues is recorded (``Collective``: kind, bytes, group size, phase), the
  communication the plan really costs, to set beside what the cost model priced.

Only rank 0 is played: a rank whose shards differ in shape (an uneven split) is not exercised, and
numbers are not computed, so nothing is compared with single device (that is ``run --check``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all",
         "broadcast_": "broadcast", "shard_dim_alltoall": "all_to_all"}
"""aten collectives (functional ones, as DTensor issues them, and c10d's in-place ones, as the
gradient buckets are reduced and inputs are broadcast) by the kind the cost model prices
(``cluster.model.collective_seconds``; a broadcast is listed, not priced). ``shard_dim_alltoall`` is
DTensor's all-to-all of one mesh axis (issued where the runtime has one, ``dry_run``'s ``all_to_all``)."""


@dataclass(frozen=True)
class Collective:
    """One collective of a step, as rank 0 issued it.

    ``nbytes``: the whole message in the cost model's convention (``collective_seconds``): the
    reduced tensor for an all-reduce, the gathered tensor for an all-gather (the local shard times
    the group), the input of a reduce-scatter or all-to-all. ``ranks``: the group's size.
    ``phase``: "forward" (up to the loss), "backward", or "gradients" (the data-parallel buckets)."""

    kind: str
    nbytes: int
    ranks: int
    phase: str
    source: str = ""
    """"redistribution": issued by a DTensor redistribution (a planned move, a partial sum reduced,
    either way); "exchange": by a nested move's exchange (``execute.exchange``; the bytes its
    busiest rank receives are in ``DryRun.exchanges``); "halo": a split convolution's halo rows
    (``execute.spatial``); "": anything else (gradient buckets, the experts' token all-to-alls,
    input broadcasts)."""


@dataclass(frozen=True)
class DryRun:
    """What one rank's step of a plan did on a fake process group."""

    devices: int
    mesh: tuple[int, ...]
    collectives: tuple[Collective, ...]
    copy_bytes: int
    """Bytes rank 0's redistributions copied locally in the step (concatenations, cut-out copies)."""
    seconds: float
    """Wall time of the apply and the step here (fake tensors: host work only, no arithmetic)."""
    exchanges: tuple = ()
    """The step's nested moves made by one exchange (``execute.exchange.Move``: the bytes the busiest
    rank receives, which rank 0's ``all_to_all`` records, its sends, do not say)."""

    def summary(self) -> dict:
        """{kind: {"count", "bytes"}} over the step, kinds in order of first use."""
        out: dict[str, dict] = {}
        for c in self.collectives:
            s = out.setdefault(c.kind, {"count": 0, "bytes": 0})
            s["count"] += 1
            s["bytes"] += c.nbytes
        return out

    def to_dict(self) -> dict:
        return {"devices": self.devices, "mesh": list(self.mesh), "seconds": self.seconds,
                "collectives": self.summary(), "redistribution_copy_bytes": self.copy_bytes,
                "exchanges": {"count": len(self.exchanges),
                              "busiest_rank_bytes": sum(m.busiest_bytes for m in self.exchanges)},
                "by_phase": {p: sum(c.phase == p for c in self.collectives)
                             for p in ("forward", "backward", "gradients")}}


def _group_size(name: str, args) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return int(args[1] if name == "all_gather_into_tensor" else args[2])
    if name in ("all_reduce", "all_to_all_single"):
        return _resolve_process_group(args[-1]).size()
    if name == "shard_dim_alltoall":
        return _resolve_process_group(args[3]).size()
    for a in args:  # c10d's in-place ops carry the process group, boxed as a script object
        if isinstance(a, dist.ProcessGroup):
            return int(a.size())
        if isinstance(a, torch.ScriptObject):
            try:
                return int(dist.ProcessGroup.unbox(a).size())
            except RuntimeError:  # another script object (the reduce op)
                continue
    return dist.get_world_size()


COPIES = frozenset({"cat", "clone", "copy_", "contiguous"})
"""aten calls that copy data; counted when a redistribution makes them (``CollectiveRecorder``)."""


def _called_from(found) -> bool:
    """Whether a frame below the caller's caller runs a code object ``found(code)`` accepts."""
    frame = sys._getframe(3)
    while frame is not None:
        if found(frame.f_code):
            return True
        frame = frame.f_back
    return False


def _in_exchange() -> bool:
    """Whether the current call comes from an exchange (``execute.exchange.Route.run``)."""
    from shardplan.execute.exchange import Route

    return _called_from(lambda code: code is Route.run.__code__)


def _in_halo() -> bool:
    """Whether the current call exchanges a split convolution's halo rows (``execute.spatial._Rows``)."""
    from shardplan.execute.spatial import _Rows

    return _called_from(lambda code: code in (_Rows.forward.__code__, _Rows.backward.__code__))


def _in_redistribution() -> bool:
    """Whether the current call comes from DTensor's redistribution of a local tensor (its
    ``redistribute_local_tensor``, which every planned move and every propagation cut goes through)."""
    return _called_from(lambda code: code.co_name == "redistribute_local_tensor")


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective dispatched while it is active, with the phase set by the caller, and
    the bytes the redistributions copy locally (``copy_bytes``: the concatenations after inner
    gathers and the copies of inner cuts, which ``cost.moves.inner_copy_words`` prices)."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.seen: list[Collective] = []
        self.copy_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in COPIES:
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and _in_redistribution():
                self.copy_bytes += out.numel() * out.element_size()
            return out
        kind = KINDS.get(name)
        if kind is not None:
            first = args[1] if name == "alltoall_base_" else args[0]  # (output, input, ...): the input
            tensors = [first] if isinstance(first, torch.Tensor) else [t for t in first if isinstance(t, torch.Tensor)]
            ranks = _group_size(name, args)
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if kind == "all_gather":
                nbytes *= ranks
            source = ("exchange" if _in_exchange() else "halo" if _in_halo() else
                      "redistribution" if _in_redistribution() else "")
            self.seen.append(Collective(kind, int(nbytes), int(ranks), self.phase, source))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_world(devices: int):
    """A fake default process group of ``devices`` ranks in this process (this process is rank 0)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs this process's default process group, and one is already set up")
    dist.init_process_group("fake", rank=0, world_size=devices, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _fake_safe_kernels():
    """Kernels whose fake (shape-only) version refuses what their CPU version runs, swapped for the
    equivalent the library itself falls back to: transformers' routed experts call
    ``torch._grouped_mm``, whose fake implementation takes bf16 only, so its own per-expert fallback
    (same shapes, same calls into the experts' weights) is used instead. And DTensor works out a
    strided shard's rows (a view merging a whole dim with a split one: attention's output split
    along ``head_dim`` flattened for ``o_proj``) with small index tensors it reads back, which fake
    tensors cannot; those are computed on real ones (they depend on sizes only)."""
    from unittest import mock

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor.placement_types import _StridedShard

    rows = _StridedShard.local_shard_size_and_offset

    def real_rows(*args, **kwargs):
        with unset_fake_temporarily():
            return rows(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_StridedShard, "local_shard_size_and_offset", real_rows))
        try:
            import transformers.integrations.moe as moe
        except ImportError:
            moe = None
        if moe is not None and hasattr(moe, "_can_use_grouped_mm"):
            stack.enter_context(mock.patch.object(moe, "_can_use_grouped_mm", lambda *a, **k: False))
        yield


@contextlib.contextmanager
def _with_all_to_all(on: bool):
    """DTensor changes a split dim on one mesh axis by an all-to-all, except on a CPU mesh, where it
    all-gathers and cuts (gloo had no all-to-all). A dry run's mesh is a CPU mesh, so for a plan
    priced for a runtime with an all-to-all (``Device.all_to_all_by_gather`` false: NCCL) the
    all-to-all is issued as on that runtime."""
    if not on:
        yield
        return
    from unittest import mock

    import torch.distributed.tensor.placement_types as placement_types
    from torch.distributed._functional_collectives import _group_or_group_name, _resolve_group

    def alltoall(input, gather_dim, shard_dim, mesh, mesh_dim):
        group = _group_or_group_name(_resolve_group((mesh, mesh_dim)))
        return torch.ops._dtensor.shard_dim_alltoall(input, gather_dim, shard_dim, group)

    with mock.patch.object(placement_types, "shard_dim_alltoall", alltoall):
        yield


def dry_run(model: str, config: str, batch: int, seq: int, plan, graph=None, all_to_all: bool = False) -> DryRun:
    """Apply ``plan`` to the built-in or Hugging Face ``model`` (as ``shardplan run`` builds it) on a
    fake process group of ``plan.devices`` ranks and run one training step in fake tensors; returns
    the step's collectives. A plan the runtime cannot run raises the runtime's error. ``graph``: the
    model's capture (``execute.launch.capture_model``) when the caller has it already. ``all_to_all``:
    the runtime priced has an all-to-all (``_with_all_to_all``)."""
    from shardplan.capture.models import build, parse_config
    from shardplan.execute.launch import capture_model

    graph = graph if graph is not None else capture_model(model, config, batch, seq)
    size = parse_config(config)
    return dry_run_module(lambda: build(model, batch=batch, seq=seq, **size), graph, plan, all_to_all)


def dry_run_module(make, graph, plan, all_to_all: bool = False) -> DryRun:
    """:func:`dry_run` of any model: ``make()`` returns ``(module, forward kwargs)`` and is called
    under ``FakeTensorMode`` (so its weights and inputs are fake); ``graph`` is the module's capture,
    which ``plan`` was made for."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from shardplan.execute.apply import apply, choose_mesh
    from shardplan.execute.exchange import watch
    from shardplan.execute.worker import _loss

    t0 = time.perf_counter()
    mesh_shape = choose_mesh(graph, plan)
    recorder = CollectiveRecorder()
    with fake_world(plan.devices), _fake_safe_kernels(), _with_all_to_all(all_to_all), watch() as moves:
        mesh = init_device_mesh("cpu", mesh_shape)  # outside the fake mode: the mesh's rank table is real
        with FakeTensorMode(allow_non_fake_inputs=True):
            torch.manual_seed(0)
            module, kwargs = make()
            module.eval()
            pm = apply(module, graph, plan, mesh)
            with recorder:
                loss = _loss(pm(**kwargs))
                recorder.phase = "backward"
                with pm.context():
                    loss.backward()
                    recorder.phase = "gradients"
                    pm.reduce_gradients()
    return DryRun(plan.devices, tuple(mesh_shape), tuple(recorder.seen), recorder.copy_bytes,
                  time.perf_counter() - t0, tuple(moves))
