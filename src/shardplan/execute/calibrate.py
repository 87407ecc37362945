"""``shardplan calibrate``: measure this machine and write a cluster file in real seconds.

Run as N ranks (torchrun, gloo), so that what is measured is what a run of N ranks gets:

* **compute**: fp32 matmul FLOP/s per rank, all ranks busy at once (``2 n^3`` FLOPs per ``n x n``
  product, the median of several), written as ``peak_flops`` with efficiency 1;
* **memory bandwidth**: bytes read plus written by a 64 MB copy per second;
* **op overhead**: forward + backward of a stack of tiny DTensor linear layers (ReLU between them)
  on the mesh of all ranks, divided by 3 x the layer count (the cost model charges a contraction
  3 passes): the host-side dispatch each op costs however small it is;
* **network**: all-reduce times of a small and a large message, fitted to the ring model the cost
  model uses, ``t = 2 (p-1) alpha + 2 (p-1)/p * n / beta`` (``cluster.model.collective_seconds``):
  alpha from the small message, beta from the large one.

Rank 0 writes the YAML file; ``shardplan plan/run --cluster FILE`` then price plans in this
machine's seconds.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist
import yaml


def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _op_overhead(p: int, reps: int, layers: int = 16) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = init_device_mesh("cpu", (p,))
    weights = [torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Replicate()])) for _ in range(layers)]
    x = distribute_tensor(torch.randn(2 * p, 8), mesh, [Shard(0)])

    def step():
        with implicit_replication():
            h = x
            for w in weights:
                h = torch.relu(torch.nn.functional.linear(h, w))
            h.sum().backward()
        for w in weights:
            w.grad = None

    return _median_time(step, reps) / (3.0 * layers)


def measure(reps: int = 5, n: int = 512) -> dict:
    p = dist.get_world_size()
    a, b = torch.randn(n, n), torch.randn(n, n)
    t_mm = _median_time(lambda: torch.mm(a, b), reps)
    flops = 2.0 * n ** 3 / t_mm
    big = torch.empty(8 * 1024 * 1024)  # 32 MB of fp32
    dst = torch.empty_like(big)
    t_copy = _median_time(lambda: dst.copy_(big), reps)
    mem_bw = 2.0 * big.numel() * 4 / t_copy
    small, large = torch.zeros(256), torch.zeros(4 * 1024 * 1024)
    t_small = _median_time(lambda: dist.all_reduce(small), reps)
    t_large = _median_time(lambda: dist.all_reduce(large), reps)
    if p > 1:
        alpha = t_small / (2.0 * (p - 1))
        nbytes = large.numel() * 4
        beta = 2.0 * (p - 1) / p * nbytes / max(t_large - 2.0 * (p - 1) * alpha, 1e-9)
    else:
        alpha, beta = 0.0, float("inf")
    overhead = _op_overhead(p, reps)
    # the slowest rank decides a step: take the minimum rate over ranks
    rates = torch.tensor([flops, mem_bw])
    dist.all_reduce(rates, op=dist.ReduceOp.MIN)
    return {"world_size": p, "matmul_flops": float(rates[0]), "memory_bandwidth": float(rates[1]),
            "latency": alpha, "bandwidth": beta, "matmul_n": n, "op_overhead": overhead,
            "seconds": {"mm": t_mm, "copy": t_copy, "all_reduce_1KB": t_small, "all_reduce_16MB": t_large}}


def to_cluster(m: dict, memory_bytes: float, name: str = "calibrated") -> dict:
    return {"name": name,
            "device": {"name": "cpu-rank", "peak_flops": m["matmul_flops"], "memory_bytes": memory_bytes,
                       "memory_bandwidth": m["memory_bandwidth"], "efficiency": 1.0,
                       "op_overhead": m["op_overhead"]},
            "levels": [{"name": "process group", "fanout": m["world_size"],
                        "bandwidth": m["bandwidth"] if m["bandwidth"] != float("inf") else 1e12,
                        "latency": m["latency"]}]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    m = measure(args.reps)
    if dist.get_rank() == 0:
        import os

        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / m["world_size"]
        with open(args.out, "w") as fh:
            fh.write("# written by `shardplan calibrate`; raw measurements:\n")
            for line in yaml.safe_dump(m, sort_keys=False).splitlines():
                fh.write(f"#   {line}\n")
            yaml.safe_dump(to_cluster(m, float(mem)), fh, sort_keys=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
