"""Plans for many ranks, checked in one process (prints a table, not a test).

    python benchmarks/dryrun_scale.py [--devices 8,64,256] [--layers 2] [--mesh free|auto]

For a Llama as wide as Llama-7B (hidden 4096, MLP 11008, 32 heads, vocabulary 32000; ``--layers``
deep), batch ``devices`` x 512 tokens: the searched plan for each device count on the DGX-A100
preset, laid on its mesh (``execute.apply.choose_mesh``) and stepped once as rank 0 of a fake
process group in fake tensors (``execute.dryrun``: no weights in memory, no arithmetic, no
processes). Printed per device count: the search's time, the mesh, the dry run's time and the
collectives rank 0 issued in the step, by kind (count and bytes). What takes the time is DTensor's
sharding propagation on rank 0's shapes, which grows with the mesh's axes. ``--mesh auto`` plans
on every mesh of up to four axes and keeps the fastest (``search.solve.solve_meshes``); the
default plans freely (priced on the primes' mesh) and lets the runtime choose the mesh, which is
marked with ``!`` where it cannot give the blocks the plan was priced on.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import warnings

from shardplan.capture import capture
from shardplan.capture.models import build, parse_config
from shardplan.cluster import get_cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.step import step_seconds
from shardplan.cost.tables import build_tables
from shardplan.cluster.mesh import runtime_mesh
from shardplan.execute.apply import choose_mesh
from shardplan.execute.dryrun import dry_run
from shardplan.execute.launch import RUN_OPTIMIZER
from shardplan.plan import Plan
from shardplan.report.runtime import human_bytes
from shardplan.search.solve import solve, solve_meshes

WIDTH = "hidden_size=4096,intermediate_size=11008,num_attention_heads=32,num_key_value_heads=32,vocab_size=32000"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="8,64,256", help="comma-separated device counts")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--mesh", choices=("free", "auto"), default="free",
                    help="free: the primes' mesh priced, the runtime chooses; auto: every mesh of up to four axes")
    args = ap.parse_args()
    config = f"{WIDTH},num_hidden_layers={args.layers}"
    print(f"Llama 4096 wide, {args.layers} layers, {args.seq} tokens per sequence, batch = devices; "
          f"searched on dgx-a100; one dry-run step as rank 0 of a fake process group\n")
    print("| devices | batch | search s | predicted s/step | mesh | dry run s | collectives per step (rank 0) |")
    print("|---|---|---|---|---|---|---|")
    for devices in (int(d) for d in args.devices.split(",")):
        batch = devices
        module, kwargs = build("llama", batch=batch, seq=args.seq, device="meta", **parse_config(config))
        graph = capture(module, (), kwargs, name="llama")
        model = AnalyticCostModel(get_cluster("dgx-a100", devices=devices), optimizer=RUN_OPTIMIZER)
        t0 = time.perf_counter()
        if args.mesh == "auto":
            tables, sol, _ = solve_meshes(graph, model, devices)
            model = dataclasses.replace(model, mesh=tables.mesh)
        else:
            tables = build_tables(graph, model, devices)
            sol = solve(tables, model=model)
        plan = Plan.from_choice(tables, list(sol.choice))
        search = time.perf_counter() - t0
        predicted = step_seconds(model, tables, list(sol.choice))
        off = plan.mesh is None and runtime_mesh(graph, plan)[1] is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mark in the table says it
            mesh = choose_mesh(graph, plan)
        t0 = time.perf_counter()
        run = dry_run("llama", config, batch, args.seq, plan, graph,
                      all_to_all=not model.cluster.device.all_to_all_by_gather)
        seconds = time.perf_counter() - t0
        comms = ", ".join(f"{v['count']} {k} ({human_bytes(v['bytes'])})" for k, v in run.summary().items())
        assert math.prod(mesh) == devices
        print(f"| {devices} | {batch} | {search:.1f} | {predicted:.4g} | {'x'.join(map(str, mesh))}{' !' if off else ''} | "
              f"{seconds:.1f} | {comms} |", flush=True)


if __name__ == "__main__":
    main()
