"""The ``shardplan`` command line: ``plan``, ``run``, ``calibrate``, ``compare``, ``simulate``, ``models``
and ``clusters``. The commands that run plans on PyTorch (``run``, ``calibrate``, ``plan --verify``)
live in ``report.runtime``; what all commands share in ``report.common``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from shardplan.cluster import PRESETS, ClusterError, get_cluster
from shardplan.cluster.presets import DESCRIPTIONS
from shardplan.cost.tables import build_tables
from shardplan.plan import Plan
from shardplan.report import runtime
from shardplan.report.common import DEFAULT_CLUSTER, UsageError
from shardplan.report.common import cost_model as _cost_model
from shardplan.report.common import positive as _positive
from shardplan.report.common import write_json as _write_json
from shardplan.search.baselines import all_baselines
from shardplan.search.solve import GIB, PlanDoesNotFit, memory_of, solve, solve_meshes
from shardplan.zoo import MODELS, build_model, model_sizes

OUTPUT_FLAGS = ("json", "out", "trace", "png")
"""The flags that name a file a command writes (``-`` for stdout where the flag allows it)."""


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, an output file whose folder does not exist or that names a folder:
    a calibration or a search should not run for minutes and then fail to write its result."""
    import os

    for flag in OUTPUT_FLAGS:
        path = getattr(args, flag, None)
        if not path or path == "-":
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise UsageError(f"--{flag} {path}: is a directory, not a file")
        if not os.path.isdir(folder):
            raise UsageError(f"--{flag} {path}: directory {folder} does not exist")


def _plan(args: argparse.Namespace) -> int:
    _positive("--time-limit", args.time_limit)
    _positive("--memory-limit", args.memory_limit)
    model, cluster, devices = _cost_model(args)
    if args.verify and not (args.hf or args.module):
        raise UsageError("--verify runs the plan on the PyTorch model: give --hf or --module")
    graph = _graph(args)
    if model.name == "analytic" and (args.pipeline or _needs_pipeline(graph, cluster)):
        if args.mesh:
            raise UsageError("--mesh lays an SPMD plan on a mesh; a pipeline plan makes its own (pp, dp, tp) mesh")
        if args.verify:
            raise UsageError("--verify runs SPMD plans; a pipeline plan needs its stages' processes")
        return _plan_pipeline(args, graph, cluster, devices)
    limit = None
    if args.memory_limit is not None:
        limit = args.memory_limit * GIB
    elif cluster is not None and model.name == "analytic":
        limit = cluster.device.memory_bytes
    quiet = args.json == "-" or not sys.stderr.isatty()
    start = time.perf_counter()
    tried = None
    try:
        if args.mesh == "auto":
            if model.name != "analytic":
                raise UsageError("--mesh auto compares meshes under the analytic model")
            tables, solution, tried = _search_meshes(graph, model, devices, limit, args.time_limit, quiet)
            model = dataclasses.replace(model, mesh=tables.mesh)
        else:
            tables = _build(graph, model, devices, quiet)
            solution = _search(tables, limit, args.time_limit, quiet, model)
    except PlanDoesNotFit as exc:
        raise UsageError(str(exc)) from None
    seconds = time.perf_counter() - start
    baselines = {}
    details = {}
    for name, choice in all_baselines(tables).items():
        cost, mem = tables.cost_of(choice), memory_of(tables, choice)
        baselines[name] = cost
        details[name] = {"cost": cost, "memory_bytes": mem, "fits": limit is None or mem <= limit,
                         "speedup": cost / solution.cost if solution.cost > 0 else None}
    plan = Plan.from_choice(tables, solution.choice, cluster=cluster.name if cluster else None,
                            method=solution.method, optimal=solution.optimal, lower_bound=solution.lower_bound,
                            baselines=baselines, search_seconds=seconds, note=solution.note)
    out = plan.to_dict()
    out.update(baseline_details=details, build_seconds=tables.build_seconds,
               memory_limit_bytes=limit, peak_memory_bytes=solution.memory_bytes)
    off_mesh = None
    if model.name == "analytic" and plan.mesh is None and getattr(model, "exact_tiles", False):
        from shardplan.cluster.mesh import runtime_mesh

        found = runtime_mesh(graph, plan)
        if found is not None:
            out["runtime_mesh"] = list(found[0])
            if found[1] is not None:
                off_mesh = found
                out["runtime_mesh_note"] = (f"priced on the {len(found[1])}-axis mesh {'x'.join(map(str, found[1]))}; "
                                            f"runs on {'x'.join(map(str, found[0]))}, where some moves bring more "
                                            f"bytes than priced")
    if tried is not None:
        out["meshes_tried"] = [{"mesh": list(t.mesh), "predicted": t.cost if math.isfinite(t.cost) else None,
                                "memory_bytes": None if math.isnan(t.memory_bytes) else t.memory_bytes}
                               for t in tried]
    step = None
    if cluster is not None and cluster.device.sync_jitter and model.name == "analytic":
        from shardplan.cost.step import step_seconds

        step = out["predicted_step_seconds"] = step_seconds(model, tables, solution.choice)
    if args.verify:
        out["verified"] = runtime.verify(args, graph, plan, cluster).to_dict()
    if _write_json(args, out):
        return 0
    _print(plan, graph, details, solution, limit, tables)
    if off_mesh is not None:
        print(f"note: this plan's moves are priced by the blocks ranks hold on the {len(off_mesh[1])}-axis mesh "
              f"{'x'.join(map(str, off_mesh[1]))}; the runtime runs it on {'x'.join(map(str, off_mesh[0]))} "
              f"(DTensor plans slowly on more than four axes), where some moves bring more bytes than priced. "
              f"--mesh auto plans for meshes the runtime runs as priced.")
    if tried is not None:
        ranked = sorted(tried, key=lambda t: t.cost)
        shown = ", ".join(f"{'x'.join(map(str, t.mesh))} {t.cost:.4g}" for t in ranked[:5] if math.isfinite(t.cost))
        print(f"--mesh auto: {len(tried)} meshes searched, the best first: {shown} {plan.unit}")
    if step is not None:
        print(f"predicted step: {step:.6g} s (the cost with the cluster's sync_jitter waits at this plan's "
              f"sync points in place of the per-op stretch; what shardplan run predicts)")
    if args.verify:
        v = out["verified"]
        print(f"verified: the plan applies and steps on {v['devices']} ranks (mesh "
              f"{'x'.join(map(str, v['mesh']))}; fake process group and tensors, {v['seconds']:.3g} s); per step "
              f"rank 0 issues {runtime.describe_collectives(v)}")
    return 0


GPT3_BATCH = {"125m": 256, "350m": 256, "760m": 256, "1.3b": 512, "2.7b": 512, "6.7b": 1024, "13b": 1024,
              "175b": 1536, "530b": 1920}
"""GPT-3's batch sizes in sequences of 2048 (Brown et al. 2020, Table 2.1: 0.5M ... 3.2M tokens);
530B: MT-NLG's final batch of 1920 sequences (Smith et al. 2022)."""


def _needs_pipeline(graph, cluster) -> bool:
    """Model states (16 bytes/param, mixed-precision Adam) do not fit one node's devices: pipeline."""
    if cluster is None or not any(op.layer is not None for op in graph.ops):
        return False
    return 16.0 * graph.num_params / cluster.devices_per_node > cluster.device.memory_bytes


def _plan_pipeline(args, graph, cluster, devices) -> int:
    from shardplan.search.pipeline import PipelineDoesNotFit, dapple, plan_pipeline, price_fixed

    if args.batch is None and args.model == "gpt" and args.size in GPT3_BATCH:
        graph = build_model("gpt", GPT3_BATCH[args.size], args.size)
    limit = args.memory_limit * GIB if args.memory_limit is not None else None
    try:
        r = plan_pipeline(graph, cluster, devices=devices, memory_limit_bytes=limit)
    except PipelineDoesNotFit as exc:
        raise UsageError(str(exc)) from None
    baselines = {}
    from shardplan.search.pipeline import MEGATRON

    meg = MEGATRON.get(args.size) if args.model == "gpt" else None
    if meg and devices % (meg["t"] * meg["p"]) == 0:
        try:  # the published Megatron-LM layout of this size
            r_meg = price_fixed(graph, cluster, meg["t"], devices // (meg["t"] * meg["p"]), meg["p"],
                                meg["micro_batch"], recompute=meg["recompute"], zero=meg["zero"])
            baselines["megatron"] = r_meg.iteration_seconds
        except ValueError:
            pass
    try:
        baselines["dapple"] = dapple(graph, cluster, devices=devices, memory_limit_bytes=limit).iteration_seconds
    except PipelineDoesNotFit:
        pass  # DAPPLE's space (no tensor parallelism, ZeRO or recomputation) has no plan that fits
    if r.batch % devices == 0:
        # plain FSDP: ZeRO-3 over every device, no tensor or pipeline split, full recomputation, one
        # micro-batch per step; a baseline only where it fits the device memory
        fsdp = price_fixed(graph, cluster, 1, devices, 1, r.batch // devices, recompute="full", zero=3)
        if fsdp.peak_memory_bytes <= (limit or cluster.device.memory_bytes):
            baselines["fsdp"] = fsdp.iteration_seconds
    from shardplan.plan import PipelinePlan

    out = PipelinePlan.from_result(r, cluster=cluster.name, baselines=baselines).to_dict()
    out.update(cost_model="analytic", method="pipeline")
    if _write_json(args, out):
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{graph.name} on {devices} devices of {cluster.name}: pipeline, batch {r.batch}")
    ranks = len(r.stages) // r.chunks
    for col in ("stage", "rank", "layers", "mesh d x t", "recompute", "ZeRO", "s / microbatch", "GiB per device"):
        table.add_column(col)
    for i, s in enumerate(r.stages):
        table.add_row(str(i), str(i % ranks), f"{s.layers[0]}-{s.layers[1]}", f"{s.data_parallel} x {s.tensor_parallel}",
                      s.recompute, str(s.zero), f"{s.seconds_per_microbatch:.4g}", f"{s.memory_bytes / GIB:.2f}")
    console = Console()
    console.print(table)
    sched = r.schedule if r.chunks == 1 else f"{r.schedule} 1F1B, {r.chunks} chunks per rank"
    console.print(f"iteration: {r.iteration_seconds:.4g} s  ({sched}, {r.num_microbatches} microbatches, "
                  f"bubble {100 * r.bubble_fraction:.1f}%; search {r.search_seconds:.1f} s); peak memory "
                  f"{r.peak_memory_bytes / GIB:.2f} GiB per device")
    for name, cost in baselines.items():
        console.print(f"speedup over {name}: {cost / r.iteration_seconds:.3f}x  ({name} {cost:.4g} s)")
    return 0


def _graph(args: argparse.Namespace):
    """The graph to plan: a zoo model, a Hugging Face model or a user module (both captured)."""
    given = [f for f, v in (("--model", args.model), ("--hf", args.hf), ("--module", args.module)) if v]
    if len(given) != 1:
        raise UsageError("give exactly one of --model, --hf or --module" + (f" (got {', '.join(given)})"
                                                                            if given else ""))
    _positive("--batch", args.batch)
    _positive("--seq", args.seq)
    if args.model:
        try:
            return build_model(args.model, args.batch, args.size)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        from shardplan.capture import CaptureError, capture
        from shardplan.capture.models import load_hf, load_module, parse_config
    except ImportError as exc:
        raise UsageError(f"--hf and --module need PyTorch: pip install 'shardplan[torch]' ({exc})") from None
    try:
        if args.hf:
            module, kwargs, name = load_hf(args.hf, parse_config(args.hf_config), batch=args.batch or 8,
                                           seq=args.seq or 128)
        else:
            module, kwargs, name = load_module(args.module, args.input_shape, batch=args.batch)
        return capture(module, (), kwargs, name=name)
    except (ValueError, CaptureError) as exc:
        raise UsageError(str(exc)) from None


def _build(graph, model, devices, quiet):
    if quiet:
        return build_tables(graph, model, devices)
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task("pricing configurations", total=len(graph.ops))
        return build_tables(graph, model, devices, progress=lambda i, n: progress.update(task, completed=i))


def _search_meshes(graph, model, devices, limit, time_limit, quiet):
    if quiet:
        return solve_meshes(graph, model, devices, memory_limit_bytes=limit, time_limit_s=time_limit)
    from rich.progress import Progress

    with Progress(transient=True) as progress:
        task = progress.add_task("searching every mesh (Ctrl-C keeps the best so far)", total=None)

        def step(i, n, mesh):
            progress.update(task, total=n, completed=i, description=f"searching mesh {'x'.join(map(str, mesh))}")
        return solve_meshes(graph, model, devices, memory_limit_bytes=limit, time_limit_s=time_limit,
                            progress=step)


def _search(tables, limit, time_limit, quiet, model=None):
    if quiet:
        return solve(tables, memory_limit_bytes=limit, time_limit_s=time_limit, model=model)
    from rich.console import Console

    with Console(stderr=True).status("searching (Ctrl-C returns the best plan so far)"):
        return solve(tables, memory_limit_bytes=limit, time_limit_s=time_limit, model=model)


def _print(plan: Plan, graph, details, solution, limit, tables) -> None:
    from rich.console import Console
    from rich.table import Table

    where = f"{plan.devices} devices" + (f" of {plan.cluster}" if plan.cluster else "")
    table = Table(title=f"{graph.name} on {where} ({plan.cost_model} cost model)")
    for col in ("op", "kind", "split"):
        table.add_column(col)
    for op in plan.ops:
        table.add_row(op.name, op.kind, op.describe())
    console = Console()
    console.print(table)
    status = "proven optimal" if plan.optimal else "NOT proven optimal"
    on_mesh = f" on mesh {'x'.join(map(str, plan.mesh))}" if plan.mesh else ""
    console.print(f"cost: {plan.cost:.6g} {plan.unit}{on_mesh}  ({plan.method}, {status}; "
                  f"search {plan.search_seconds:.2f} s)")
    b = plan.breakdown
    console.print(f"  compute {b['compute']:.4g}, intra-op communication {b['comm']:.4g}, "
                  f"redistribution {b['redistribution']:.4g} {plan.unit}; "
                  f"memory {solution.memory_bytes / GIB:.3f} GiB per device"
                  + (f" (limit {limit / GIB:.1f} GiB)" if limit else ""))
    if plan.note:
        console.print(f"  note: {plan.note}")
    for name, d in details.items():
        fits = "" if d["fits"] else ", does not fit in memory"
        console.print(f"speedup over {name}: {d['speedup']:.3f}x  ({name} cost {d['cost']:.6g}{fits})")


def _compare(args: argparse.Namespace) -> int:
    """``shardplan compare``: every search method on one model, by cost model and simulator."""
    from shardplan.report.compare import compare, print_comparison

    _positive("--devices", args.devices)
    try:
        cluster = get_cluster(args.cluster or DEFAULT_CLUSTER, nodes=args.nodes, devices=args.devices)
        graph = build_model(args.model, args.batch)
    except (ClusterError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    devices = args.devices or cluster.num_devices
    limit = args.memory_limit * GIB if args.memory_limit is not None else None
    try:
        cmp = compare(graph, cluster, devices, memory_limit_bytes=limit, mcmc_seconds=args.mcmc_seconds,
                      mcmc_iters=args.mcmc_iters, ilp_seconds=args.ilp_seconds, seed=args.seed)
    except PlanDoesNotFit as exc:
        raise UsageError(str(exc)) from None
    if not _write_json(args, cmp.to_dict()):
        print_comparison(cmp)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    """``shardplan simulate``: replay a plan file event by event; trace JSON and timeline PNG."""
    from shardplan.plan import PipelinePlan, PlanError, _parse_json
    from shardplan.simulate import simulate

    try:
        with open(args.plan) as fh:
            raw = _parse_json(fh.read(), f"plan file {args.plan!r}")
    except OSError as exc:
        raise UsageError(f"plan file {args.plan!r}: {exc.strerror}") from None
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    try:
        if isinstance(raw, dict) and raw.get("kind") == "pipeline":
            plan = PipelinePlan.from_dict(raw, f"plan file {args.plan!r}")
            graph = None
        else:
            plan = Plan.from_dict(raw, f"plan file {args.plan!r}")
            name = args.model or plan.model
            if name not in MODELS:
                raise UsageError(f"plan is for model {plan.model!r}, which is not built in; give --model NAME "
                                 f"(built-in: {', '.join(sorted(MODELS))})")
            graph = build_model(name, args.batch)
        cluster = get_cluster(args.cluster or plan.cluster or DEFAULT_CLUSTER, devices=plan.devices)
        result = simulate(graph, cluster, plan)
    except (PlanError, ClusterError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if args.trace:
        with open(args.trace, "w") as fh:
            json.dump(result.to_chrome_trace(), fh)
    if args.png:
        result.save_timeline_png(args.png)
    d0 = min(result.compute_seconds)
    out = {"iteration_seconds": result.iteration_seconds, "peak_memory_bytes": result.peak_memory_bytes,
           "compute_seconds": result.compute_seconds[d0], "comm_seconds": result.comm_seconds[d0],
           "idle_seconds": result.idle_seconds[d0], "bubble_fraction": result.bubble_fraction,
           "plan_cost": plan.cost, "trace": args.trace, "png": args.png}
    if not _write_json(args, out):
        print(f"simulated iteration: {result.iteration_seconds:.6g} s (the plan's cost-model estimate: "
              f"{plan.cost:.6g} s); device {d0}: compute {out['compute_seconds']:.4g} s, communication "
              f"{out['comm_seconds']:.4g} s, idle {out['idle_seconds']:.4g} s; peak memory "
              f"{result.peak_memory_bytes / GIB:.3f} GiB per device")
        for what, path in (("trace (open in ui.perfetto.dev)", args.trace), ("timeline", args.png)):
            if path:
                print(f"{what}: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardplan", description="Plan parallel training of a network.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="find the cheapest per-layer parallelization")
    p.add_argument("--model", default=None, help="built-in model name (see `shardplan models`)")
    p.add_argument("--hf", default=None, help="a Hugging Face model family: gpt2, llama, bert, mixtral "
                   "(full-size default config on the meta device; needs torch)")
    p.add_argument("--hf-config", default=None, help="config overrides, e.g. hidden_size=4096,num_hidden_layers=32")
    p.add_argument("--module", default=None, help="pkg.module:function returning an nn.Module (needs torch)")
    p.add_argument("--input-shape", default=None, help="input shape for --module, e.g. 8,3,224,224")
    p.add_argument("--seq", type=int, default=None, help="sequence length for --hf (default 128)")
    p.add_argument("--size", default=None, help="named size of the model, e.g. --model gpt --size 1.3b")
    p.add_argument("--devices", type=int, default=None, help="devices to plan for")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--cluster", default=None, help=f"preset name or YAML/JSON file (default {DEFAULT_CLUSTER})")
    p.add_argument("--nodes", type=int, default=None, help="scale a multi-node cluster preset to N nodes")
    p.add_argument("--cost-model", default="analytic", help="analytic (seconds, default) or pase (PaSE's units)")
    p.add_argument("--memory-limit", type=float, default=None,
                   help="GiB per device (default: the cluster's device memory; none for pase)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds; past it the best plan so far is returned, flagged not optimal")
    p.add_argument("--json", default=None, help="write the plan as JSON to FILE, or - for stdout")
    p.add_argument("--mesh", default=None,
                   help="plan for this device mesh, e.g. 8x8 (8 nodes of 8): only splits that lay on it are "
                        "searched, moves are priced on it and `run` uses it; `auto` searches every mesh of up "
                        "to four axes and keeps the fastest (default: the runtime chooses)")
    p.add_argument("--pipeline", action="store_true",
                   help="use the pipeline planner (chosen anyway when the model states do not fit one node)")
    p.add_argument("--verify", action="store_true",
                   help="--hf/--module: apply the plan and run one step on a fake process group of --devices "
                        "ranks in fake tensors (no processes, no weight memory); lists its collectives")
    r = sub.add_parser("run", help="train K steps of a plan with torchrun and compare with the prediction")
    r.add_argument("--model", default=None, help="torch_mlp, torch_cnn, gpt2, llama or bert (small configs)")
    r.add_argument("--hf", default=None, help="a Hugging Face family (small default config; see --hf-config)")
    r.add_argument("--hf-config", default="", help="config overrides, e.g. hidden_size=128,num_hidden_layers=4")
    r.add_argument("--devices", type=int, default=2)
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--batch", type=int, default=4)
    r.add_argument("--seq", type=int, default=16)
    r.add_argument("--plan", default=None, action="append",
                   help="plan JSON from `shardplan plan --json FILE` (default: search); repeat it to run several "
                        "plans in one launch, their steps interleaved so all see the same machine")
    r.add_argument("--check", action="store_true", help="compare loss and gradients with a single-device run")
    r.add_argument("--dry-run", action="store_true",
                   help="no torchrun: play rank 0 of a fake process group in this process, with fake tensors "
                        "(any --devices, no weight memory), run one step of the plan and list its collectives")
    r.add_argument("--pipeline", action="store_true",
                   help="plan and run pipeline stages (torch.distributed.pipelining; a pipeline --plan implies it)")
    r.add_argument("--cluster", default=None, help=f"cluster to predict on (default {DEFAULT_CLUSTER})")
    r.add_argument("--nodes", type=int, default=None)
    r.add_argument("--cost-model", default="analytic")
    r.add_argument("--mesh", default=None, help="search the plan for this device mesh, e.g. 2x2, or `auto` "
                   "(as `plan --mesh`); with --plan, run the plan file on this mesh")
    r.add_argument("--json", default=None, help="write the result as JSON to FILE, or - for stdout")
    r.add_argument("--nnodes", type=int, default=1,
                   help="hosts the ranks run on: give every host the same command with its own --node-rank; "
                        "each starts --devices / --nnodes ranks, rank 0's host reports the run")
    r.add_argument("--node-rank", type=int, default=0, help="this host's index, 0 .. --nnodes - 1")
    r.add_argument("--master-addr", default="127.0.0.1", help="rank 0's host, where the ranks meet (several hosts)")
    r.add_argument("--master-port", type=int, default=None, help="a free port on rank 0's host (several hosts)")
    c = sub.add_parser("calibrate", help="measure this machine and the process group; write a cluster file")
    c.add_argument("--devices", type=int, default=2, help="ranks to measure with (default 2)")
    c.add_argument("--out", default="calibrated.yaml", help="cluster file to write")
    c.add_argument("--reps", type=int, default=10, help="repetitions per measurement; the fastest is kept")
    k = sub.add_parser("compare", help="every search method on one model: cost model and simulator side by side")
    k.add_argument("--model", required=True, help="a built-in model (see `shardplan models`)")
    k.add_argument("--devices", type=int, default=None)
    k.add_argument("--batch", type=int, default=None)
    k.add_argument("--cluster", default=None, help=f"preset or cluster file (default {DEFAULT_CLUSTER})")
    k.add_argument("--nodes", type=int, default=None)
    k.add_argument("--memory-limit", type=float, default=None, help="GiB per device (default: the device's)")
    k.add_argument("--mcmc-seconds", type=float, default=5.0, help="MCMC time budget (default 5)")
    k.add_argument("--mcmc-iters", type=int, default=None, help="MCMC proposal budget (deterministic with --seed)")
    k.add_argument("--ilp-seconds", type=float, default=60.0, help="ILP time limit (default 60)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--json", default=None, help="write the comparison as JSON to FILE, or - for stdout")
    m = sub.add_parser("simulate", help="replay a plan file event by event: trace JSON and timeline PNG")
    m.add_argument("--plan", required=True, help="plan JSON from `shardplan plan --json FILE`")
    m.add_argument("--model", default=None, help="built-in model to simulate (default: the plan's)")
    m.add_argument("--batch", type=int, default=None)
    m.add_argument("--cluster", default=None, help="preset or cluster file (default: the plan's)")
    m.add_argument("--trace", default=None, help="write a Chrome trace (Perfetto) JSON here")
    m.add_argument("--png", default=None, help="write a timeline picture here")
    m.add_argument("--json", default=None, help="write the summary as JSON to FILE, or - for stdout")
    sub.add_parser("models", help="list built-in models")
    sub.add_parser("clusters", help="list built-in clusters")
    args = parser.parse_args(argv)
    try:
        _check_outputs(args)
        if args.command == "models":
            for name in sorted(MODELS):
                sizes = model_sizes(name)
                print(name + (f"  (sizes: {', '.join(sizes)})" if sizes else ""))
            return 0
        if args.command == "clusters":
            for name, c in PRESETS.items():
                lv = ", ".join(f"{x.name} {x.bandwidth / 1e9:g} GB/s" for x in c.levels)
                print(f"{name}: {DESCRIPTIONS[name]} ({c.device.peak_flops / 1e12:g} TFLOP/s, "
                      f"{c.device.memory_bytes / 1e9:g} GB; {lv})")
            return 0
        if args.command == "calibrate":
            return runtime.calibrate(args)
        if args.command == "run":
            return runtime.run(args)
        if args.command == "compare":
            return _compare(args)
        if args.command == "simulate":
            return _simulate(args)
        return _plan(args)
    except UsageError as exc:
        print(f"shardplan: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardplan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
