"""Pipeline plans for large GPTs next to Megatron-LM's published configuration, same cost model.

    python benchmarks/large_models.py --models 175b --clusters dgx-a100 --gpus 1024

Columns: search seconds (measured), plan (d, t, p, microbatches, schedule), predicted per-GPU TFLOP/s
(6 N tokens model FLOPs / iteration / GPUs) and MFU against the device's peak, peak memory per device;
then the same for Megatron-LM's configuration (t = 8, p = 16, micro-batch 1, full recomputation, 1F1B
for 175B: NVIDIA/Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh, global batch 1536).
175B and 530B have Megatron rows (530B: MT-NLG's t = 8, p = 35, ZeRO-1, on 2240 GPUs, which the
benchmark adds to the GPU counts). The last column is DAPPLE's rule (pipeline x data parallel, 1F1B, no
tensor parallelism, ZeRO or recomputation; `search.pipeline.dapple`), searched by the same DP.
"""

from __future__ import annotations

import argparse

from shardplan.cluster.presets import get_cluster
from shardplan.search.pipeline import MEGATRON, PipelineDoesNotFit, dapple, plan_pipeline, price_fixed
from shardplan.zoo.models import gpt

BATCH = {"1.3b": 512, "13b": 1024, "175b": 1536,  # GPT-3 batch sizes (Brown et al. 2020, Table 2.1), sequences
         "530b": 1920,  # MT-NLG's batch (Smith et al. 2022)
         "llama70b": 1024}  # Llama 2: 4M tokens per batch = 1024 sequences of 4096 (Touvron et al. 2023)
SEQ = {"llama70b": 4096}


def model(size: str):
    """A GPT-3 size, or ``llama70b``: Llama-2-70B's shape (80 layers, hidden 8192, 64 heads, context
    4096) as a GPT block. Its 2-matrix MLP is 43008 wide so the MLP has SwiGLU's 3 x 8192 x 28672
    parameters and FLOPs; attention has no GQA, so 77.5B parameters instead of 69B."""
    if size == "llama70b":
        return gpt(layers=80, hidden=8192, heads=64, seq=4096, vocab=32000, batch=BATCH[size], ffn=43008)
    return gpt(size=size, batch=BATCH[size])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="1.3b,13b,175b,530b,llama70b")
    ap.add_argument("--clusters", default="dgx-a100,dgx-h100")
    ap.add_argument("--gpus", default="8,64,1024")
    args = ap.parse_args()
    print("| model | cluster | GPUs | search s | d | t | p | m | schedule | TFLOP/s/GPU | MFU | peak GiB | "
          "Megatron TFLOP/s/GPU | Megatron peak GiB | DAPPLE rule TFLOP/s/GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.models.split(","):
        g = model(size)
        flops = 6.0 * g.num_params * BATCH[size] * SEQ.get(size, 2048)
        for name in args.clusters.split(","):
            counts = list(map(int, args.gpus.split(",")))
            if size in MEGATRON:  # also the GPU count of the published run's replicas (530B: 8 x 280)
                unit = MEGATRON[size]["t"] * MEGATRON[size]["p"]
                counts += [] if any(n % unit == 0 for n in counts) else [unit * 8]
            for n in counts:
                c = get_cluster(name, devices=n)
                try:
                    r = plan_pipeline(g, c, devices=n)
                except PipelineDoesNotFit as exc:
                    print(f"| {size} | {name} | {n} | - | does not fit: {exc} |")
                    continue
                s0 = r.stages[0]
                tf = flops / r.iteration_seconds / n / 1e12
                meg = "-", "-"
                if size in MEGATRON and n % (MEGATRON[size]["t"] * MEGATRON[size]["p"]) == 0:
                    cfg = MEGATRON[size]
                    mr = price_fixed(g, c, cfg["t"], n // (cfg["t"] * cfg["p"]), cfg["p"], cfg["micro_batch"],
                                     recompute=cfg["recompute"], zero=cfg["zero"])
                    meg = f"{flops / mr.iteration_seconds / n / 1e12:.0f}", f"{mr.peak_memory_bytes / 2**30:.1f}"
                try:
                    dp = f"{flops / dapple(g, c, devices=n).iteration_seconds / n / 1e12:.0f}"
                except PipelineDoesNotFit:
                    dp = "does not fit"
                sched = r.schedule if r.chunks == 1 else f"{r.schedule} v={r.chunks}"
                print(f"| {size} | {name} | {n} | {r.search_seconds:.1f} | {s0.data_parallel} | {s0.tensor_parallel} | "
                      f"{len(r.stages) // r.chunks} | {r.num_microbatches} | {sched} | {tf:.0f} | "
                      f"{tf * 1e12 / c.device.peak_flops:.2f} | {r.peak_memory_bytes / 2**30:.1f} | {meg[0]} | {meg[1]} | "
                      f"{dp} |")


if __name__ == "__main__":
    main()
