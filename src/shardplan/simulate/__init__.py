"""The event simulator: one training iteration of a plan, task by task (issue 5).

``simulate(graph, cluster, plan)`` builds the task graph of one iteration (forward and backward
compute, collectives, redistribution, optimizer updates; or a pipeline schedule), replays it event
by event on per-device compute and communication streams, and returns a :class:`SimResult`
(iteration time, per-device busy/idle time, peak memory, the executed events, Chrome trace and PNG
timelines). Task durations come from the analytic cost model's itemised formulas
(``AnalyticCostModel.node_cost_items``), so the simulator and the search share one source of truth.
See docs/simulator.md. Imports numpy only (matplotlib lazily, for PNGs), never torch.

The package itself is callable: ``shardplan.simulate(graph, cluster, plan)`` is :func:`simulate`.
"""

from __future__ import annotations

import sys
import types

from shardplan.simulate.engine import Event, Task, TaskGraph
from shardplan.simulate.pipeline import simulate_pipeline
from shardplan.simulate.result import SimResult
from shardplan.simulate.spmd import (Prepared, Simulator, optimizer_seconds, plan_configs, prepare_plan,
                                    prepare_tables, run_spmd)


def simulate(graph, cluster, plan, *, overlap: bool = True, optimizer: bool = True, optimizer_name: str = "adam",
             tables=None, p2p_seconds=0.0, p2p_bytes=None, sync_seconds=None, static_bytes=None,
             activation_bytes=None) -> SimResult:
    """Simulate one training iteration of ``plan`` on ``cluster``.

    * ``plan``: a :class:`shardplan.plan.Plan` (SPMD: per-op configurations from the search), a list
      of configuration indices into ``tables``, or a :class:`shardplan.plan.PipelinePlan`.
    * ``cluster``: a :class:`~shardplan.cluster.model.Cluster` or a preset name (scaled to the plan's
      devices); it must be the cluster the plan was priced on for the numbers to agree.
    * ``overlap``: False puts every task of a device on one serial timeline (nothing overlaps; the
      iteration then equals the cost model's ``tables.cost_of(choice)``, whose tables price the same
      optimizer, or ``cost.step.step_seconds`` when the cluster's device has a ``sync_jitter``:
      its waits at the plan's sync points then replace the per-op stretch, as tasks on the comm
      stream).
    * ``optimizer``: add an update per parameter tile (``optimizer_name``: adam | sgd_momentum | sgd);
      False leaves the updates out (the iteration is then shorter than the tables' cost).
    * ``tables``: cost tables of ``graph`` under ``AnalyticCostModel(cluster)`` (optional for a
      ``Plan``; redistribution then uses their merged edges). For many plans of one graph, build a
      :class:`Simulator` once and call ``run``: it itemises every configuration once.
    * pipeline-only: ``p2p_seconds`` / ``p2p_bytes``, ``sync_seconds``, ``static_bytes``,
      ``activation_bytes`` (see ``shardplan.simulate.pipeline``).

    SPMD plans: every device runs the same tasks with the same durations under the analytic model, so
    device 0 is simulated and reported for every device (``SimResult.representative``). Pipelines:
    the first rank of each stage stands for the stage. Time does not grow with the device count:
    the first call on a graph itemises its ops (about 0.4 ms per op); later calls re-price only ops
    whose configuration changed (cached per graph and cluster) and replay ~1,000 tasks in 5-12 ms.
    """
    from shardplan.cluster.model import Cluster
    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.plan import PipelinePlan, Plan

    if isinstance(cluster, str):
        from shardplan.cluster.presets import get_cluster

        cluster = get_cluster(cluster, devices=plan.devices if hasattr(plan, "devices") else None)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster or a preset name, got {type(cluster).__name__}")
    if isinstance(plan, PipelinePlan):
        return simulate_pipeline(plan, cluster, p2p_seconds=p2p_seconds, p2p_bytes=p2p_bytes,
                                 sync_seconds=sync_seconds, static_bytes=static_bytes,
                                 activation_bytes=activation_bytes, overlap=overlap)
    mesh = plan.mesh if isinstance(plan, Plan) else None  # a plan made for a mesh is priced on it
    model = AnalyticCostModel(cluster, optimizer=optimizer_name, mesh=mesh)
    if tables is not None:
        if graph is not None and tables.graph is not graph and tables.graph.name != graph.name:
            raise ValueError(f"tables are for graph {tables.graph.name!r}, not {graph.name!r}")
        choice = plan.to_choice(tables) if isinstance(plan, Plan) else [int(c) for c in plan]
        return run_spmd(prepare_tables(tables, model), choice, tables.devices, overlap=overlap,
                        optimizer=optimizer)
    if not isinstance(plan, Plan):
        raise TypeError("a list of configuration indices needs tables=; pass a Plan or a PipelinePlan")
    if plan.devices > cluster.num_devices:
        raise ValueError(f"plan is for {plan.devices} devices but cluster {cluster.name!r} has {cluster.num_devices}")
    prep = prepare_plan(graph, model, plan)
    return run_spmd(prep, [0] * len(graph.ops), plan.devices, overlap=overlap, optimizer=optimizer)


class _CallableModule(types.ModuleType):
    """Lets ``shardplan.simulate(...)`` call :func:`simulate` although ``shardplan.simulate`` is a package."""

    def __call__(self, *args, **kwargs):
        return simulate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["simulate", "simulate_pipeline", "SimResult", "Simulator", "TaskGraph", "Task", "Event",
           "optimizer_seconds", "Prepared", "plan_configs", "prepare_plan", "prepare_tables", "run_spmd"]
