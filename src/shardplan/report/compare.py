"""Every search method on one graph, judged twice: by the cost model and by the event simulator.

``compare(graph, cluster, devices)`` runs, on the same cost tables:

* ``exact``: the front door (``search.solve``: the exact DP under the device memory),
* ``ilp``: the same objective as an integer program (HiGHS), with its optimality gap,
* ``mcmc``: FlexFlow's Metropolis-Hastings with the simulator in the loop (Jia et al., SysML 2019),
* ``optcnn``: OptCNN's node/edge elimination, where the graph is series-parallel,
* the baselines: ``data_parallel`` and the expert plans that apply (``megatron``, ``owt``),

and reports for each its search seconds, cost-model estimate, simulated iteration seconds, simulated
peak memory and speedup over data parallelism (simulated). The cost model is the objective every
search minimises, so ``exact`` (and ``ilp`` when proven optimal) can never lose under it; the
simulator sees overlap the cost model does not, so another plan may win there, and the table says so.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from shardplan.cluster.model import Cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.tables import CostTables, build_tables
from shardplan.ir.graph import Graph
from shardplan.search.baselines import all_baselines
from shardplan.search.solve import memory_of, solve


@dataclass(frozen=True)
class MethodResult:
    name: str
    choice: tuple[int, ...] | None  # None: the method does not apply (``note`` says why)
    cost: float  # cost-model seconds per iteration
    simulated_seconds: float
    search_seconds: float
    peak_memory_bytes: float  # simulated peak per device
    fits: bool  # cost-model memory within the device memory
    optimal: bool = False
    note: str = ""


@dataclass(frozen=True)
class Comparison:
    model: str
    devices: int
    cluster: str
    build_seconds: float  # cost tables, shared by every method
    methods: tuple[MethodResult, ...]

    def get(self, name: str) -> MethodResult:
        return next(m for m in self.methods if m.name == name)

    def speedup(self, name: str, by: str = "simulated_seconds") -> float | None:
        """Data parallel's time over this method's (``by``: ``simulated_seconds`` or ``cost``)."""
        m, dp = self.get(name), self.get("data_parallel")
        if m.choice is None or dp.choice is None:
            return None
        return getattr(dp, by) / getattr(m, by)

    def to_dict(self) -> dict:
        out = {"model": self.model, "devices": self.devices, "cluster": self.cluster,
               "build_seconds": self.build_seconds, "methods": {}}
        for m in self.methods:
            row = {"cost": m.cost if m.choice is not None else None,
                   "simulated_seconds": m.simulated_seconds if m.choice is not None else None,
                   "search_seconds": m.search_seconds,
                   "peak_memory_bytes": m.peak_memory_bytes if m.choice is not None else None,
                   "fits": m.fits, "optimal": m.optimal, "note": m.note,
                   "speedup_over_data_parallel": self.speedup(m.name)}
            out["methods"][m.name] = row
        return out


def compare(graph: Graph, cluster: Cluster, devices: int, *, memory_limit_bytes: float | None = None,
            mcmc_seconds: float = 5.0, mcmc_iters: int | None = None, ilp_seconds: float = 60.0,
            seed: int = 0, tables: CostTables | None = None) -> Comparison:
    """Run every method on ``graph`` over ``devices`` of ``cluster``; see the module doc.

    ``mcmc_iters`` (with any ``mcmc_seconds``) makes MCMC deterministic for a seed."""
    from shardplan.search.ilp import ilp_search
    from shardplan.search.mcmc import mcmc_search
    from shardplan.search.optcnn import NotReducible, optcnn_search
    from shardplan.simulate import Simulator

    cluster = cluster.with_devices(devices)
    limit = cluster.device.memory_bytes if memory_limit_bytes is None else float(memory_limit_bytes)
    if tables is None:
        tables = build_tables(graph, AnalyticCostModel(cluster), devices)
    sim = Simulator(tables, cluster)
    rows: list[MethodResult] = []

    def add(name, choice, seconds, optimal=False, note=""):
        if choice is None:
            rows.append(MethodResult(name, None, math.nan, math.nan, seconds, math.nan, False, False, note))
            return
        r = sim.run(choice)
        rows.append(MethodResult(name, tuple(int(c) for c in choice), tables.cost_of(choice), r.iteration_seconds,
                                 seconds, r.peak_memory_bytes, memory_of(tables, choice) <= limit, optimal, note))

    t0 = time.perf_counter()
    exact = solve(tables, memory_limit_bytes=limit)
    add("exact", exact.choice, time.perf_counter() - t0, exact.optimal, exact.note)

    t0 = time.perf_counter()
    ilp = ilp_search(tables, memory_limit_bytes=limit, time_limit_s=ilp_seconds)
    add("ilp", ilp.choice, time.perf_counter() - t0, ilp.optimal, ilp.note)

    t0 = time.perf_counter()
    mc = mcmc_search(tables, objective=lambda ch: sim.run(ch).iteration_seconds, time_limit_s=mcmc_seconds,
                     max_iters=mcmc_iters, seed=seed, memory_limit_bytes=limit)
    add("mcmc", mc.choice, time.perf_counter() - t0, False, f"simulator in the loop; {mc.note}".strip("; "))

    t0 = time.perf_counter()
    try:
        oc = optcnn_search(tables)
        ok = memory_of(tables, oc.choice) <= limit
        add("optcnn", oc.choice, time.perf_counter() - t0, ok,
            "" if ok else "ignores the memory limit; its plan does not fit")
    except NotReducible as exc:
        add("optcnn", None, time.perf_counter() - t0, note=str(exc).split(" (")[0] + ": not series-parallel")

    for name, choice in all_baselines(tables).items():
        t0 = time.perf_counter()
        add(name, choice, time.perf_counter() - t0)
    return Comparison(graph.name, devices, cluster.name, tables.build_seconds, tuple(rows))


def print_comparison(cmp: Comparison) -> None:
    """The compare table (rich)."""
    from rich.console import Console
    from rich.table import Table

    gib = 2.0**30
    table = Table(title=f"{cmp.model} on {cmp.devices} devices of {cmp.cluster} "
                        f"(cost tables built in {cmp.build_seconds:.2f} s)")
    for col in ("method", "search s", "cost model s", "simulated s", "peak GiB", "speedup vs DP (sim)", "note"):
        table.add_column(col)
    best_sim = min((m.simulated_seconds for m in cmp.methods if m.choice is not None and m.fits), default=None)
    for m in cmp.methods:
        if m.choice is None:
            table.add_row(m.name, f"{m.search_seconds:.3f}", "-", "-", "-", "-", m.note)
            continue
        sp = cmp.speedup(m.name)
        flag = " (best)" if best_sim is not None and m.fits and m.simulated_seconds <= best_sim * (1 + 1e-12) else ""
        note = ("proven optimal; " if m.optimal else "") + m.note + ("" if m.fits else " DOES NOT FIT")
        table.add_row(m.name, f"{m.search_seconds:.3f}", f"{m.cost:.6g}", f"{m.simulated_seconds:.6g}{flag}",
                      f"{m.peak_memory_bytes / gib:.2f}", f"{sp:.3f}x" if sp else "-", note.strip("; ")[:80])
    Console(width=200).print(table)
