"""One rank of ``shardplan run`` (started by torchrun): train K steps of a plan on synthetic data.

Every rank builds the same model from the same seed, captures it, applies the plan, and runs SGD
steps on a fixed synthetic batch, timing each step after a warm-up (from a common barrier to the end
of the slowest rank's step). With ``--check`` each rank also
runs the single-device model on the same batch and compares the first step's loss and every
gradient. All ranks reach the same collectives (an all-reduce of the verdict) even when one fails,
so gloo never hangs; rank 0 writes the result as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardplan.capture import capture
from shardplan.capture.models import build, parse_config
from shardplan.execute.apply import apply, choose_mesh
from shardplan.execute.launch import pin_to_core
from shardplan.plan import Plan


def _loss(out):
    logits = getattr(out, "logits", out)
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return full.float().pow(2).mean()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def timed_sgd_steps(forward_backward, named_parameters, steps: int, context=contextlib.nullcontext,
                    keep_first: bool = False):
    """``steps`` timed SGD steps after one warm-up: ``forward_backward()`` (returns the loss as a
    float), then ``p -= 1e-3 grad`` for every parameter, both inside ``context()``. A step is timed from
    a common barrier to the end of the slowest rank's step (no trailing barrier inside the timing).
    Returns (seconds per timed step, (first loss, first gradients gathered whole) or None)."""
    times, first = [], None
    for step in range(steps + 1):  # step 0 is the warm-up
        dist.barrier()
        t0 = time.perf_counter()
        with context():
            loss = forward_backward()
            if step == 0 and keep_first:
                first = (loss, {n: _full(p.grad).clone() for n, p in named_parameters() if p.grad is not None})
            with torch.no_grad():
                for _, p in named_parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-1e-3)
                        p.grad = None
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if step:
            times.append(float(took))
    return times, first


def rel_diff(grads: dict, reference: torch.nn.Module, loss: float, loss_ref: float, every: bool = True) -> float:
    """Largest relative difference of ``loss`` and ``grads`` from the reference module's (whose backward
    has run): entries within 1e-6 of the largest reference gradient count as equal. ``every``: a
    reference gradient missing from ``grads`` is an infinite difference (False: compare only the
    gradients given, as a pipeline rank holds only its stages')."""
    worst = abs(loss - loss_ref) / max(abs(loss_ref), 1e-30)
    scale = max(float(p.grad.abs().max()) for p in reference.parameters() if p.grad is not None)
    for n, p in reference.named_parameters():
        if p.grad is None or (not every and n not in grads):
            continue
        g = grads.get(n)
        if g is None:
            worst = float("inf")
            continue
        diff = (g - p.grad).abs() - 1e-6 * scale
        worst = max(worst, float((diff.clamp_min(0) / p.grad.abs().clamp_min(1e-6 * scale)).max()))
    return worst


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default="")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    pin_to_core()
    rank = dist.get_rank()
    result: dict = {"rank_errors": []}
    ok = torch.ones(1)
    try:
        torch.manual_seed(0)
        module, kwargs = build(args.model, batch=args.batch, seq=args.seq, **parse_config(args.config))
        module.eval()  # no dropout: runs are deterministic
        graph = capture(module, (), kwargs, name=args.model)
        plan = Plan.load(args.plan)
        reference = copy.deepcopy(module) if args.check else None
        mesh = init_device_mesh("cpu", choose_mesh(graph, plan))
        pm = apply(module, graph, plan, mesh)

        def forward_backward():
            loss = _loss(pm(**kwargs))
            loss.backward()
            return loss.item()

        times, first = timed_sgd_steps(forward_backward, module.named_parameters, args.steps, pm.context,
                                       keep_first=args.check)
        result["measured_step_seconds"] = sorted(times)[len(times) // 2]
        result["best_step_seconds"] = min(times)
        result["step_seconds"] = times
        if args.check:
            loss_ref = _loss(reference(**kwargs))
            loss_ref.backward()
            worst = rel_diff(first[1], reference, first[0], loss_ref.item())
            result["check"] = {"passed": worst <= 1e-5, "max_rel_diff": worst}
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, after the collective below
        ok.zero_()
        result["rank_errors"].append(f"rank {rank}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    result["ok"] = bool(ok.item())
    if rank == 0 or not ok.item():
        with open(args.out if rank == 0 else f"{args.out}.rank{rank}", "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
