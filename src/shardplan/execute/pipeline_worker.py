"""One rank of a pipeline run (started by torchrun).

* ``--cases FILE``: run each case of a JSON list and save this rank's loss and gradients
  (``torch.save``) for the caller to compare with the single-device model. A case is
  ``{"model", "ranges", "microbatches", "schedule", "dp", "batch", "seq", "config"}``.
* ``--plan FILE`` (``shardplan run`` of a pipeline plan): train ``--steps`` SGD steps on a fixed
  synthetic batch, time each after a warm-up, and with ``--check`` compare the first step's loss and
  this rank's gradients with the single-device model; rank 0 writes the JSON result to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardplan.capture.models import build, parse_config
from shardplan.execute.launch import pin_to_core
from shardplan.execute.pipeline import PipelineSpec, apply_pipeline


def _loss(out):
    return getattr(out, "logits", out).float().pow(2).mean()


def run_plan(args) -> None:
    import copy

    from shardplan.execute.worker import rel_diff, timed_sgd_steps
    from shardplan.plan import PipelinePlan

    rank = dist.get_rank()
    result: dict = {"rank_errors": []}
    ok = torch.ones(1)
    worst = torch.zeros(1)
    try:
        with open(args.plan) as fh:
            plan = PipelinePlan.from_json(fh.read(), source=args.plan)
        torch.manual_seed(0)
        module, kwargs = build(args.model, batch=args.batch, seq=args.seq, **parse_config(args.config))
        module.eval()
        reference = copy.deepcopy(module) if args.check else None
        x = next(iter(kwargs.values()))
        spec = PipelineSpec.from_plan(plan)
        mesh = init_device_mesh("cpu", spec.mesh_shape(), mesh_dim_names=("pp", "dp", "tp"))
        runner = apply_pipeline(module, spec, mesh, x, _loss)
        times, first = timed_sgd_steps(lambda: runner.step(x), runner.named_parameters, args.steps,
                                       keep_first=args.check)
        result["measured_step_seconds"] = sorted(times)[len(times) // 2]
        result["best_step_seconds"] = min(times)
        result["step_seconds"] = times
        if args.check:
            loss_ref = _loss(reference(**kwargs))
            loss_ref.backward()
            worst[0] = rel_diff(first[1], reference, first[0], loss_ref.item(), every=False)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, after the collective below
        ok.zero_()
        result["rank_errors"].append(f"rank {rank}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    result["ok"] = bool(ok.item())
    if args.check:
        result["check"] = {"passed": bool(ok.item()) and float(worst) <= 1e-5, "max_rel_diff": float(worst)}
    if rank == 0 or not ok.item():
        with open(args.out if rank == 0 else f"{args.out}.rank{rank}", "w") as fh:
            json.dump(result, fh)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=None)
    ap.add_argument("--plan", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default="")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    pin_to_core()
    if args.plan:
        run_plan(args)
        dist.destroy_process_group()
        return
    rank = dist.get_rank()
    with open(args.cases) as fh:
        cases = json.load(fh)
    for k, case in enumerate(cases):
        result: dict = {"error": None}
        ok = torch.ones(1)
        try:
            torch.manual_seed(0)
            module, kwargs = build(case["model"], batch=case["batch"], seq=case.get("seq", 16), **case.get("config", {}))
            module.eval()
            x = next(iter(kwargs.values()))
            spec = PipelineSpec.from_stages(case["ranges"], case["microbatches"], case["schedule"],
                                            data_parallel=case.get("dp", 1), tensor_parallel=case.get("tp", 1))
            mesh = init_device_mesh("cpu", spec.mesh_shape(), mesh_dim_names=("pp", "dp", "tp"))
            runner = apply_pipeline(module, spec, mesh, x, _loss)
            result["loss"] = runner.step(x)
            result["grads"] = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                              for n, p in runner.named_parameters() if p.grad is not None}
        except Exception as exc:  # noqa: BLE001 - reported, after the collective below
            ok.zero_()
            result["error"] = f"rank {rank}: {type(exc).__name__}: {exc}"
            traceback.print_exc()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        torch.save(result, os.path.join(args.out, f"case{k}.rank{rank}.pt"))
        if not ok.item():
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
