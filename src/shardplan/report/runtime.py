"""The ``shardplan`` commands that run plans on PyTorch: ``run`` (torchrun, or ``--dry-run`` on a fake
process group), ``calibrate``, and ``plan --verify``. PyTorch is imported inside each command, so the
planner's command line loads without it."""

from __future__ import annotations

import argparse
import dataclasses

from shardplan.cost.analytic import AnalyticCostModel
from shardplan.report.common import UsageError, cost_model as _cost_model, positive as _positive
from shardplan.report.common import write_json as _write_json


def verify(args: argparse.Namespace, graph, plan, cluster=None):
    """``plan --verify``: the plan applied to the --hf/--module model and stepped on a fake process
    group (``execute.dryrun``), with the all-to-alls of ``cluster``'s runtime; a plan the runtime
    cannot run is refused with the runtime's reason."""
    from shardplan.capture.models import load_hf, load_module, parse_config
    from shardplan.execute.apply import ApplyError, check, choose_mesh
    from shardplan.execute.dryrun import dry_run_module

    if args.hf:
        def make():
            return load_hf(args.hf, parse_config(args.hf_config), batch=args.batch or 8, seq=args.seq or 128,
                           meta=False)[:2]
    else:
        def make():
            return load_module(args.module, args.input_shape, batch=args.batch)[:2]
    try:
        check(graph, plan, choose_mesh(graph, plan))
    except ApplyError as exc:
        raise UsageError(f"the plan cannot be applied: {exc}") from None
    return _refused_if_it_fails(lambda: dry_run_module(make, graph, plan, _has_all_to_all(cluster)), "the plan",
                                plan.devices)


def _has_all_to_all(cluster) -> bool:
    """Whether the plan's runtime changes a split dim by all-to-all (so a dry run issues them)."""
    return cluster is not None and not cluster.device.all_to_all_by_gather


def _any_pipeline(files) -> bool:
    """Whether any of the plan files is a pipeline plan; a file that cannot be read is refused."""
    from shardplan.execute.launch import is_pipeline_plan
    from shardplan.plan import PlanError

    try:
        return any(is_pipeline_plan(f) for f in files)
    except PlanError as exc:
        raise UsageError(str(exc)) from None


def _refused_if_it_fails(dry, label: str, devices: int):
    """``dry()``'s result; any error the runtime raises in it becomes a one-line usage error naming
    ``label`` and the runtime's reason, instead of a traceback."""
    try:
        return dry()
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - the runtime's reason, named, instead of a traceback
        text = str(exc).strip()
        raise UsageError(f"{label} does not run on {devices} ranks: {type(exc).__name__}: "
                         f"{text.splitlines()[0] if text else ''}") from None


def run(args: argparse.Namespace) -> int:
    """``shardplan run``: plan (or load a plan), refuse bad ones, torchrun the steps, report."""
    _positive("--steps", args.steps)
    _positive("--batch", args.batch)
    _positive("--seq", args.seq)
    model_name = args.hf or args.model
    if not model_name:
        raise UsageError("give --model NAME or --hf NAME")
    try:
        from shardplan.execute.apply import ApplyError
        from shardplan.execute.launch import RUN_OPTIMIZER, launch, prepare
    except ImportError as exc:
        raise UsageError(f"shardplan run needs PyTorch: pip install 'shardplan[torch]' ({exc})") from None
    from shardplan.plan import PlanError

    from shardplan.execute.launch import is_pipeline_plan, launch_pipeline, prepare_pipeline

    cost_model, cluster, devices = _cost_model(args)
    if isinstance(cost_model, AnalyticCostModel):  # price the update and memory of what the run trains with
        cost_model = dataclasses.replace(cost_model, optimizer=RUN_OPTIMIZER)
    files = args.plan or [None]
    graph = None  # captured once when --mesh auto needs it, and handed on
    if getattr(args, "mesh", None) == "auto":  # search every mesh first, then run on the best one
        if args.plan or not isinstance(cost_model, AnalyticCostModel):
            raise UsageError("--mesh auto searches the plan (under the analytic model); with --plan give the "
                             "plan's own mesh, or none")
        from shardplan.execute.launch import capture_model
        from shardplan.search.solve import PlanDoesNotFit, solve_meshes

        try:
            graph = capture_model(model_name, args.hf_config, args.batch, args.seq, routing=not args.dry_run)
            tables, _, _ = solve_meshes(graph, cost_model, devices)
        except (ApplyError, PlanDoesNotFit, ValueError) as exc:
            raise UsageError(str(exc)) from None
        cost_model = dataclasses.replace(cost_model, mesh=tables.mesh)
    hosts = _hosts(args, devices)
    if args.dry_run:
        if hosts.nnodes > 1:
            raise UsageError("--dry-run plays every rank in this one process: leave out --nnodes")
        return _dry_run(args, model_name, files, cost_model, cluster, devices, graph)
    if len(files) > 1:
        return _run_several(args, model_name, files, cost_model, cluster, devices, hosts)
    try:
        pipeline = args.pipeline or is_pipeline_plan(files[0])
        if pipeline:
            if cluster is None:
                raise UsageError("pipeline plans are priced by the analytic model: give --cost-model analytic")
            plan, predicted = prepare_pipeline(model_name, args.hf_config, args.batch, args.seq, devices, cluster,
                                               files[0])
        else:
            plan, predicted = prepare(model_name, args.hf_config, args.batch, args.seq, devices, cost_model,
                                      files[0], graph)
    except (ApplyError, PlanError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    try:
        go = launch_pipeline if pipeline else launch
        result = go(model_name, args.hf_config, args.batch, args.seq, plan, args.steps, args.check, hosts=hosts)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    if hosts.node_rank:
        return _report_host(args, result, hosts)
    out = _run_record(args, model_name, devices, cluster, cost_model.name, plan, predicted, result, pipeline)
    out["ok"], out["errors"] = result.get("ok"), result.get("rank_errors", [])
    if not _write_json(args, out):
        _print_run(args, out, cost_model.name)
        for e in out["errors"]:
            print(f"  {e}")
    if not result.get("ok") or (args.check and not out["check"].get("passed")):
        return 1
    return 0


def _hosts(args, devices: int):
    """The hosts of a run (``execute.launch.Hosts``) from ``--nnodes``, ``--node-rank``,
    ``--master-addr`` and ``--master-port``, refused with the reason before anything starts."""
    from shardplan.execute.launch import Hosts

    try:
        hosts = Hosts(args.nnodes, args.node_rank, args.master_addr, args.master_port)
        hosts.per_host(devices)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return hosts


def _report_host(args, result: dict, hosts) -> int:
    """What a host other than rank 0's says of a run: which ranks it ran, whether they ended well and
    their errors; the measurements are rank 0's host's to print."""
    out = {"node_rank": hosts.node_rank, "nnodes": hosts.nnodes, "ranks": result.get("ranks"),
           "ok": result.get("ok"), "errors": result.get("rank_errors", [])}
    if not _write_json(args, out):
        ranks = out["ranks"] or []
        print(f"host {hosts.node_rank} of {hosts.nnodes}: ranks {ranks[0]}-{ranks[-1]} "
              f"{'finished' if out['ok'] else 'FAILED'}; rank 0's host ({hosts.master_addr}) prints the run")
        for e in out["errors"]:
            print(f"  {e}")
    return 0 if out["ok"] else 1


def _run_record(args, model_name, devices, cluster, cost_model_name, plan, predicted, result, pipeline=False) -> dict:
    """The JSON record of one plan's run: prediction, measured step times, check, the plan."""
    out = {"model": model_name, "devices": devices, "cluster": cluster.name if cluster else None,
           "cost_model": "analytic" if pipeline else cost_model_name, "predicted_step_seconds": predicted,
           "measured_step_seconds": result.get("measured_step_seconds"),
           "best_step_seconds": result.get("best_step_seconds"), "steps": args.steps,
           "step_seconds": result.get("step_seconds"),
           "plan": plan.to_dict()["stages" if pipeline else "layers"]}
    if pipeline:
        out.update(kind="pipeline", schedule=plan.schedule, num_microbatches=plan.num_microbatches,
                   chunks=plan.chunks)
    if args.check:
        out["check"] = result.get("check", {"passed": False, "max_rel_diff": None})
    return out


def _print_run(args, out: dict, cost_model_name: str, label: str = "") -> None:
    print(f"{label}{out['model']} on {out['devices']} ranks: measured {out['measured_step_seconds']} s/step "
          f"(best {out['best_step_seconds']}), predicted {out['predicted_step_seconds']:.4g} s/step "
          f"({cost_model_name} on {out['cluster']})")
    if args.check:
        c = out["check"]
        print(f"{label}check against single device: {'passed' if c.get('passed') else 'FAILED'} "
              f"(max relative difference {c.get('max_rel_diff')})")


def human_bytes(nbytes: float) -> str:
    """Bytes in words: "14.7 MB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def describe_collectives(dry: dict) -> str:
    """A dry run's collectives (``DryRun.to_dict()``) in words: "28 all_reduce (14.7 MB), ..."."""
    text = ", ".join(f"{c['count']} {k} ({human_bytes(c['bytes'])})" for k, c in dry["collectives"].items()) or \
        "no collectives"
    ex = dry.get("exchanges") or {}
    if ex.get("count"):
        text += (f"; {ex['count']} of its moves of dims split over several mesh axes are one exchange each, "
                 f"{human_bytes(ex['busiest_rank_bytes'])} into the busiest rank")
    return text


def _dry_run(args, model_name: str, files: list, cost_model, cluster, devices: int, graph=None) -> int:
    """``shardplan run --dry-run``: each plan (or the searched one) applied on a fake process group of
    ``--devices`` ranks in this process, one step in fake tensors (``execute.dryrun``); the collectives
    rank 0 issues per step, beside the prediction. Nothing is measured or checked numerically.
    ``graph``: the model's capture when the caller has it already."""
    from shardplan.execute.apply import ApplyError
    from shardplan.execute.dryrun import dry_run
    from shardplan.execute.launch import capture_model, prepare
    from shardplan.plan import PlanError

    if args.check:
        raise UsageError("--dry-run computes no numbers (fake tensors), so there is nothing to --check")
    if args.pipeline or _any_pipeline(files):
        raise UsageError("--dry-run runs SPMD plans; a pipeline plan needs its stages' processes")
    records = []
    try:
        if graph is None:
            graph = capture_model(model_name, args.hf_config, args.batch, args.seq)  # once for every plan
    except (ApplyError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    for f in files:
        label = f or "the searched plan"
        try:
            plan, predicted = prepare(model_name, args.hf_config, args.batch, args.seq, devices, cost_model, f,
                                      graph)
        except (ApplyError, PlanError, ValueError) as exc:
            raise UsageError(f"{label}: {exc}" if f else str(exc)) from None
        dr = _refused_if_it_fails(lambda: dry_run(model_name, args.hf_config, args.batch, args.seq, plan, graph,
                                                  _has_all_to_all(cluster)),
                                  label, plan.devices)
        records.append({"model": model_name, "devices": plan.devices, "plan_file": f,
                        "cluster": cluster.name if cluster else None, "cost_model": cost_model.name,
                        "predicted_step_seconds": predicted, "dry_run": dr.to_dict(),
                        "plan": plan.to_dict()["layers"]})
    out = records[0] if len(records) == 1 else {"model": model_name, "devices": devices, "plans": records}
    if not _write_json(args, out):
        for rec in records:
            d = rec["dry_run"]
            print(f"{rec['plan_file'] or 'searched plan'}: {model_name} on {rec['devices']} ranks (mesh "
                  f"{'x'.join(map(str, d['mesh']))}) runs: one step in {d['seconds']:.3g} s here (fake tensors); "
                  f"per step rank 0 issues {describe_collectives(d)}; predicted "
                  f"{rec['predicted_step_seconds']:.4g} s/step ({cost_model.name} on {rec['cluster']})")
    return 0


def _run_several(args, model_name: str, files: list[str], cost_model, cluster, devices: int, hosts) -> int:
    """``shardplan run --plan A --plan B ...``: one launch, the plans' steps interleaved round-robin
    (each on its own copy of the model), one record per plan under ``"plans"``."""
    from shardplan.execute.apply import ApplyError
    from shardplan.execute.launch import capture_model, launch, prepare
    from shardplan.plan import PlanError

    if args.pipeline or _any_pipeline(files):
        raise UsageError("several --plan files run SPMD plans only; run a pipeline plan on its own")
    try:
        graph = capture_model(model_name, args.hf_config, args.batch, args.seq, routing=True)  # once for every plan
    except (ApplyError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    prepared = []
    for f in files:
        try:
            prepared.append(prepare(model_name, args.hf_config, args.batch, args.seq, devices, cost_model, f,
                                    graph))
        except (ApplyError, PlanError, ValueError) as exc:
            raise UsageError(f"{f}: {exc}") from None
    try:
        result = launch(model_name, args.hf_config, args.batch, args.seq, [p for p, _ in prepared], args.steps,
                        args.check, hosts=hosts)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None
    if hosts.node_rank:
        return _report_host(args, result, hosts)
    per_plan = result.get("plans") or [{} for _ in files]
    records = []
    for f, (plan, predicted), r in zip(files, prepared, per_plan):
        rec = _run_record(args, model_name, devices, cluster, cost_model.name, plan, predicted, r)
        rec["plan_file"] = f
        records.append(rec)
    out = {"model": model_name, "devices": devices, "interleaved": True, "ok": result.get("ok"),
           "errors": result.get("rank_errors", []), "plans": records}
    if not _write_json(args, out):
        for f, rec in zip(files, records):
            _print_run(args, rec, cost_model.name, label=f"{f}: ")
        for e in out["errors"]:
            print(f"  {e}")
    if not result.get("ok") or (args.check and not all(r["check"].get("passed") for r in records)):
        return 1
    return 0


def calibrate(args: argparse.Namespace) -> int:
    """``shardplan calibrate``: torchrun the measurements on N ranks and write a cluster file."""
    _positive("--devices", args.devices)
    import os

    from shardplan.cluster import load_cluster

    try:
        from shardplan.execute.launch import last_lines, torchrun
    except ImportError as exc:
        raise UsageError(f"shardplan calibrate needs PyTorch: pip install 'shardplan[torch]' ({exc})") from None
    proc = torchrun(args.devices, "shardplan.execute.calibrate", ["--out", args.out, "--reps", str(args.reps)])
    if proc.returncode != 0 or not os.path.exists(args.out):
        raise UsageError(f"calibration failed (torchrun exit {proc.returncode}):\n{last_lines(proc)}")
    c = load_cluster(args.out)
    lv = c.levels[0]
    print(f"wrote {args.out}: {c.device.peak_flops / 1e9:.3g} GFLOP/s matmul per rank (x {c.device.efficiency:.2f} "
          f"in a step), {c.device.memory_bandwidth / 1e9:.3g} GB/s memory ({c.device.kernel_bandwidth / 1e9:.3g} "
          f"in a step's kernels), {lv.fanout} ranks: all-reduce {lv.bandwidth / 1e9:.3g} GB/s, latency "
          f"{lv.latency * 1e6:.3g} us; all-gather {lv.move_bandwidth / 1e9:.3g} GB/s, latency "
          f"{lv.move_latency * 1e6:.3g} us; redistribution {c.device.redistribute_overhead * 1e6:.3g} us")
    return 0
