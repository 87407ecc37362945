"""One rank of a pipeline check (started by torchrun): run each case of a JSON list and save this rank's
loss and gradients (``torch.save``) for the caller to compare with the single-device model.

A case is ``{"model", "ranges", "microbatches", "schedule", "dp", "batch", "seq", "config"}``.
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

from shardplan.capture.models import build
from shardplan.execute.pipeline import PipelineSpec, apply_pipeline


def _loss(out):
    return getattr(out, "logits", out).float().pow(2).mean()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
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
                                            data_parallel=case.get("dp", 1))
            mesh = init_device_mesh("cpu", (world // spec.data_parallel, spec.data_parallel),
                                    mesh_dim_names=("pp", "dp"))
            runner = apply_pipeline(module, spec, mesh, x, _loss)
            result["loss"] = runner.step(x)
            result["grads"] = {n: p.grad.clone() for n, p in runner.named_parameters() if p.grad is not None}
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
