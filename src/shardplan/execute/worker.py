"""One rank of ``shardplan run`` (started by torchrun): train K steps of a plan on synthetic data.

Every rank builds the same model from the same seed, captures it, applies the plan, and runs SGD
steps on a fixed synthetic batch, timing each step after a warm-up (from a common barrier to the end
of the slowest rank's step). Several ``--plan`` files run in one launch, each on its own copy of the
model, their steps interleaved round-robin so that they are measured under the same conditions (on a
shared machine the speed drifts by tens of percent within minutes). With ``--check`` each rank also
runs the single-device model on the same batch and compares the first step's loss and every
gradient. All ranks reach the same collectives (an all-reduce of the verdict) even when one fails,
so gloo never hangs; rank 0 writes the result as JSON.

Each rank runs on its local GPU with NCCL when torch sees GPUs (``rank_device``), else on one pinned
CPU core with gloo. The GPU branch (NCCL, the model built on the rank's GPU, each timed step closed by a
device synchronisation) has not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
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


def rank_device() -> torch.device:
    """This rank's device: its local GPU (torchrun's ``LOCAL_RANK``) when torch sees GPUs, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _synchronize() -> None:
    """Wait for this rank's queued GPU work (nothing to wait for on the CPU), so a step's time is its work's."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _loss(out):
    logits = getattr(out, "logits", out)
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return full.float().pow(2).mean()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _sgd_step(forward_backward, named_parameters, context, keep: bool):
    """One SGD step timed from a common barrier to the end of the slowest rank's step: (seconds,
    (loss, gradients gathered whole) when ``keep``, else None)."""
    _synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    first = None
    with context():
        loss = forward_backward()
        if keep:
            first = (loss, {n: _full(p.grad).clone() for n, p in named_parameters() if p.grad is not None})
        with torch.no_grad():
            for _, p in named_parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-1e-3)
                    p.grad = None
    _synchronize()
    took = torch.tensor([time.perf_counter() - t0], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took), first


def interleaved_sgd_steps(runs, steps: int, keep_first: bool = False) -> list:
    """``steps`` timed SGD steps of every run in ``runs`` (``(forward_backward, named_parameters,
    context)``: ``forward_backward()`` returns the loss as a float, then ``p -= 1e-3 grad`` for every
    parameter, both inside ``context()``), after one warm-up step each, taken round-robin: step k of
    every run before step k + 1 of any, so a machine that slows down for a while slows every run
    alike. Round k starts at run ``(k - 1) mod len(runs)`` (the warm-up round at run 0), so no run
    always follows the same one (caches and allocator state left by its predecessor). Returns, per
    run, (seconds per timed step, (first loss, first gradients gathered whole) or None)."""
    times: list[list[float]] = [[] for _ in runs]
    firsts: list = [None] * len(runs)
    n = len(runs)
    for step in range(steps + 1):  # step 0 is the warm-up
        for i in [(max(step - 1, 0) + j) % n for j in range(n)]:
            forward_backward, named_parameters, context = runs[i]
            took, first = _sgd_step(forward_backward, named_parameters, context, step == 0 and keep_first)
            if step:
                times[i].append(took)
            else:
                firsts[i] = first
    return list(zip(times, firsts))


def timed_sgd_steps(forward_backward, named_parameters, steps: int, context=contextlib.nullcontext,
                    keep_first: bool = False):
    """:func:`interleaved_sgd_steps` of one run: (seconds per timed step, (first loss, first
    gradients) or None)."""
    return interleaved_sgd_steps([(forward_backward, named_parameters, context)], steps, keep_first)[0]


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
    ap.add_argument("--plan", required=True, action="append",
                    help="a plan file; several: their steps are interleaved round-robin in one launch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=120))
    if device.type == "cpu":
        pin_to_core()
    rank = dist.get_rank()
    result: dict = {"rank_errors": []}
    ok = torch.ones(1, device=device)
    try:
        runs, modules, reference = [], [], None
        for path in args.plan:
            torch.manual_seed(0)  # every plan starts from the same weights as the reference
            module, kwargs = build(args.model, batch=args.batch, seq=args.seq, device=device,
                                   **parse_config(args.config))
            module.eval()  # no dropout: runs are deterministic
            graph = capture(module, (), kwargs, name=args.model)
            plan = Plan.load(path)
            if args.check and reference is None:
                reference = copy.deepcopy(module)
            mesh = init_device_mesh(device.type, choose_mesh(graph, plan))
            pm = apply(module, graph, plan, mesh)

            def forward_backward(pm=pm, kwargs=kwargs):
                loss = _loss(pm(**kwargs))
                loss.backward()
                pm.reduce_gradients()  # the pending data-parallel sums, bucketed as DDP does
                return loss.item()

            runs.append((forward_backward, module.named_parameters, pm.context))
            modules.append(module)
        measured = interleaved_sgd_steps(runs, args.steps, keep_first=args.check)
        if args.check:
            loss_ref = _loss(reference(**kwargs))
            loss_ref.backward()
        per_plan = []
        for times, first in measured:
            r = {"measured_step_seconds": sorted(times)[len(times) // 2], "best_step_seconds": min(times),
                 "step_seconds": times}
            if args.check:
                worst = rel_diff(first[1], reference, first[0], loss_ref.item())
                r["check"] = {"passed": worst <= 1e-5, "max_rel_diff": worst}
            per_plan.append(r)
        if len(per_plan) == 1:
            result.update(per_plan[0])
        else:
            result["plans"] = per_plan
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
