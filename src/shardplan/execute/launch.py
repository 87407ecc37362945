"""``shardplan run``: check a plan against a model, launch torchrun, and report measured vs predicted."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch

from shardplan.capture import capture
from shardplan.capture.models import HF_MODELS, TORCH_MODELS, build, parse_config
from shardplan.cost.step import step_seconds
from shardplan.cost.tables import build_tables
from shardplan.execute.apply import ApplyError, check, choose_mesh
from shardplan.plan import Plan
from shardplan.search.solve import solve

RUNNABLE = tuple(TORCH_MODELS + HF_MODELS)
RUN_OPTIMIZER = "sgd"
"""What ``shardplan run``'s ranks train with (``worker._sgd_step``: ``p -= lr * grad``, no optimizer
states), so the cost model prices that update and that memory for a run."""


def pin_to_core() -> None:
    """Pin this rank to one core (local rank r on core r) when the machine has a core per local rank,
    so ranks do not migrate and trade cores mid-step; a no-op elsewhere."""
    local = int(os.environ.get("LOCAL_RANK", "-1"))
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if 0 <= local < world <= len(cores):
        os.sched_setaffinity(0, {cores[local]})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def capture_model(model: str, config: str, batch: int, seq: int, routing: bool = False):
    """The graph of a runnable model as ``shardplan run`` builds it, captured on the meta device
    (shapes are all the graph needs: no weight memory, however large the model).

    ``routing``: a model with mixture-of-experts blocks is also built as the ranks build it (seed 0:
    the same weights and the same synthetic batch) and its routing measured on that batch
    (``capture.moe.measure_routing``), so the prediction prices the busiest expert group of the
    routing the ranks will run, not uniform routing's."""
    if model not in RUNNABLE:
        raise ApplyError(f"shardplan run knows models {', '.join(RUNNABLE)}; got {model!r}")
    module, kwargs = build(model, batch=batch, seq=seq, device="meta", **parse_config(config))
    graph = capture(module, (), kwargs, name=model)
    if routing and dict(graph.meta).get("local_blocks"):
        import torch

        from shardplan.capture.moe import measure_routing

        with torch.random.fork_rng():
            torch.manual_seed(0)  # as execute.worker builds each rank's model and batch
            module, kwargs = build(model, batch=batch, seq=seq, **parse_config(config))
        module.eval()
        graph = measure_routing(graph, module, kwargs)
    return graph


def prepare(model: str, config: str, batch: int, seq: int, devices: int, cost_model, plan_file: str | None,
            graph=None):
    """(plan, predicted seconds) after every check that can fail before a process starts; ``graph``:
    the model's capture when the caller has it already (``capture_model``)."""
    graph = graph if graph is not None else capture_model(model, config, batch, seq, routing=True)
    tables = build_tables(graph, cost_model, devices)
    mesh = getattr(cost_model, "mesh", None)
    if plan_file:
        plan = Plan.load(plan_file)
        if plan.devices != devices:
            check(graph, plan, (devices,))  # names the model mismatch first, else the device count
        if mesh is not None:  # --mesh: the plan runs on it (a plan made for another mesh is refused)
            if plan.mesh and tuple(plan.mesh) != tuple(mesh):
                raise ApplyError(f"plan file {plan_file!r} was made for mesh {'x'.join(map(str, plan.mesh))}; "
                                 f"--mesh asks for {'x'.join(map(str, mesh))}")
            plan = dataclasses.replace(plan, mesh=tuple(mesh))
        check(graph, plan, choose_mesh(graph, plan))
        choice = plan.to_choice(tables)
    else:
        sol = solve(tables, model=cost_model)
        choice = list(sol.choice)
        plan = Plan.from_choice(tables, choice, method=sol.method, optimal=sol.optimal, note=sol.note)
        check(graph, plan, choose_mesh(graph, plan))
    return plan, step_seconds(cost_model, tables, choice)


# glibc malloc, left to itself, hands every freed block of 128 KiB-32 MiB back to the kernel (or trims
# the heap top), so each training step faults its activations and gradients in afresh: 15-19 MB and
# ~4500 minor page faults per step of the fidelity CNN, 10-20% of its median step on this machine.
# Keeping freed memory in the heap (blocks up to 32 MiB, the heap top up to 1 GiB) removes them
# (26 faults per step); larger blocks are still mapped per allocation. A user's own GLIBC_TUNABLES wins.
MALLOC_TUNABLES = ("glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824:"
                   "glibc.malloc.top_pad=67108864")


@dataclass(frozen=True)
class Hosts:
    """The hosts a run's ranks live on. Every host runs the same ``shardplan run`` with its own
    ``node_rank``; each starts ``devices / nnodes`` ranks under torchrun, and they meet at rank 0's
    host, ``master_addr:master_port`` (torchrun's static rendezvous: global ranks ``node_rank x
    per host`` onwards on each host). Rank 0's host reports the run. One host (the default): local
    ranks, localhost and a free port."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"--nnodes must be a positive integer, got {self.nnodes!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must lie in 0..{self.nnodes - 1} for {self.nnodes} host(s), got "
                             f"{self.node_rank}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("a run on several hosts needs --master-addr (rank 0's host) and --master-port, the "
                             "same on every host")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be a TCP port (1-65535), got {self.master_port}")

    def per_host(self, devices: int) -> int:
        """Ranks this host starts: ``devices`` split evenly over the hosts."""
        if devices % self.nnodes:
            raise ValueError(f"{devices} ranks do not split evenly over {self.nnodes} hosts; give --devices a "
                             f"multiple of --nnodes")
        return devices // self.nnodes

    def ranks(self, devices: int) -> range:
        """The global ranks this host starts."""
        n = self.per_host(devices)
        return range(self.node_rank * n, (self.node_rank + 1) * n)


def torchrun(nproc: int, module: str, args: list[str], timeout_s: float = 600.0,
             hosts: Hosts = Hosts()) -> subprocess.CompletedProcess:
    """``python -m module args`` on ``nproc`` ranks of this host under torchrun (one thread each by
    default, malloc keeping freed memory: ``MALLOC_TUNABLES``), meeting the other ``hosts``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts.nnodes), "--node_rank",
           str(hosts.node_rank), "--nproc_per_node", str(nproc), "--master_addr", hosts.master_addr,
           "--master_port", str(hosts.master_port or _free_port()), "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=worker_env(os.environ))


def worker_env(base) -> dict:
    """The ranks' environment: ``base`` with one thread each and ``MALLOC_TUNABLES`` unless it sets
    ``OMP_NUM_THREADS`` or ``GLIBC_TUNABLES`` itself."""
    return dict(base, OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"),
                GLIBC_TUNABLES=base.get("GLIBC_TUNABLES", MALLOC_TUNABLES))


def last_lines(proc: subprocess.CompletedProcess, n: int = 5) -> str:
    return "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-n:])


def launch(model: str, config: str, batch: int, seq: int, plan, steps: int, do_check: bool,
           timeout_s: float = 600.0, worker: str = "shardplan.execute.worker", hosts: Hosts = Hosts()) -> dict:
    """torchrun ``worker`` (``shardplan.execute.worker`` for SPMD plans, ``.pipeline_worker`` for
    pipeline plans) on the plan's devices; rank 0's JSON result with every rank's errors. ``plan`` may
    be a list of SPMD plans on the same devices: one launch runs them all, their steps interleaved, and
    the result holds one entry per plan under ``"plans"``. On several ``hosts`` this host starts its
    share of the ranks; a host other than rank 0's returns only ``ok``, its ranks and their errors
    (``"node_rank"``, ``"ranks"``, ``"rank_errors"``)."""
    plans = list(plan) if isinstance(plan, (list, tuple)) else [plan]
    here = hosts.per_host(plans[0].devices)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if worker == "shardplan.execute.worker" and gpus and here > gpus:
        # where torch sees GPUs, every SPMD rank runs on one of its own with NCCL (worker.rank_device)
        raise RuntimeError(f"the plan asks for {here} ranks on this host, but it has {gpus} GPU(s): "
                           f"each rank runs on a GPU of its own")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        args = ["--model", model, "--config", config or "", "--batch", str(batch), "--seq", str(seq),
                "--steps", str(steps), "--out", out_path] + (["--check"] if do_check else [])
        for i, p in enumerate(plans):
            plan_path = os.path.join(tmp, f"plan{i}.json")
            with open(plan_path, "w") as fh:
                fh.write(p.to_json())
            args += ["--plan", plan_path]
        proc = torchrun(here, worker, args, timeout_s, hosts)
        if hosts.node_rank:  # rank 0 lives elsewhere and reports the run; here, only this host's ranks
            result = {"ok": proc.returncode == 0, "node_rank": hosts.node_rank,
                      "ranks": list(hosts.ranks(plans[0].devices)), "rank_errors": []}
            if proc.returncode and not any(n.startswith("result.json.rank") for n in os.listdir(tmp)):
                result["rank_errors"].append(f"torchrun exited with {proc.returncode}:\n{last_lines(proc)}")
        elif not os.path.exists(out_path):
            raise RuntimeError(f"torchrun exited with {proc.returncode} and no result:\n{last_lines(proc)}")
        else:
            with open(out_path) as fh:
                result = json.load(fh)
        for name in os.listdir(tmp):
            if name.startswith("result.json.rank"):
                with open(os.path.join(tmp, name)) as fh:
                    result["rank_errors"] += json.load(fh).get("rank_errors", [])
    return result


def is_pipeline_plan(path: str | None) -> bool:
    """Whether the plan file at ``path`` is a pipeline plan (``"kind": "pipeline"``)."""
    if not path:
        return False
    from shardplan.plan import PlanError, _parse_json

    try:
        with open(path) as fh:
            raw = _parse_json(fh.read(), f"plan file {path!r}")
    except OSError as exc:
        raise PlanError(f"plan file {path!r}: {exc.strerror}") from None
    return isinstance(raw, dict) and raw.get("kind") == "pipeline"


def prepare_pipeline(model: str, config: str, batch: int, seq: int, devices: int, cluster, plan_file: str | None):
    """(pipeline plan, predicted seconds) after every check that can fail before a process starts: the
    plan file (or, without one, the pipeline search restricted to what runs here: no tensor parallelism
    inside a stage) against the model's blocks, the device count and the batch."""
    from shardplan.execute.pipeline import (PipelineError, PipelineSpec, check_pipeline, check_tensor_parallel,
                                            find_layout)
    from shardplan.plan import PipelinePlan, PlanError
    from shardplan.search.pipeline import plan_pipeline, price_pipeline

    if model not in RUNNABLE:
        raise ApplyError(f"shardplan run knows models {', '.join(RUNNABLE)}; got {model!r}")
    module, kwargs = build(model, batch=batch, seq=seq, **parse_config(config))
    graph = capture(module, (), kwargs, name=model)
    try:
        layout = find_layout(module)
    except PipelineError as exc:
        raise ApplyError(str(exc)) from None
    if plan_file:
        try:
            with open(plan_file) as fh:
                plan = PipelinePlan.from_json(fh.read(), source=f"plan file {plan_file!r}")
        except OSError as exc:
            raise PlanError(f"plan file {plan_file!r}: {exc.strerror}") from None
        if plan.model != graph.name:
            raise PlanError(f"plan file {plan_file!r} is a pipeline plan for {plan.model!r}, not {graph.name!r}")
    else:
        # tensor parallelism inside stages runs for Llama blocks (see execute.pipeline); not elsewhere
        r = plan_pipeline(graph, cluster, devices, schedules=("1f1b", "gpipe"),
                          max_tensor_parallel=None if layout.family == "llama" else 1, exact_devices=True)
        plan = PipelinePlan.from_result(r, cluster=cluster.name)
    if plan.devices != devices:
        raise PlanError(f"the pipeline plan is for {plan.devices} devices, not {devices}")
    try:
        spec = PipelineSpec.from_plan(plan)
        check_pipeline(spec, layout.count, devices, batch)
        check_tensor_parallel(module, layout, spec)
    except PipelineError as exc:
        raise ApplyError(str(exc)) from None
    try:
        predicted = price_pipeline(graph, cluster, plan, optimizer=RUN_OPTIMIZER).iteration_seconds
    except ValueError as exc:
        raise PlanError(f"pipeline plan does not match {graph.name!r}: {exc}") from None
    return plan, predicted


def launch_pipeline(model: str, config: str, batch: int, seq: int, plan, steps: int, do_check: bool,
                    timeout_s: float = 600.0, hosts: Hosts = Hosts()) -> dict:
    """:func:`launch` of ``shardplan.execute.pipeline_worker`` for a pipeline plan."""
    return launch(model, config, batch, seq, plan, steps, do_check, timeout_s, "shardplan.execute.pipeline_worker",
                  hosts)
