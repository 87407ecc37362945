"""Every search method on every zoo model, judged by the cost model and by the event simulator.

    python benchmarks/compare.py                          # all zoo models at 8 and 64 GPUs (dgx-a100)
    python benchmarks/compare.py --models alexnet --devices 8 --mcmc-seconds 2

For each model and device count: per method (exact, ilp, mcmc with the simulator in the loop, optcnn,
data parallel, the expert plans) the measured search seconds, the cost-model estimate, the simulated
iteration, the simulated peak memory and the speedup over data parallel (simulated); then the search
time of each rival over the exact search's. Everything printed is measured on this run.
"""

from __future__ import annotations

import argparse
import math

from shardplan.cluster.presets import get_cluster
from shardplan.report.compare import compare
from shardplan.zoo import MODELS, build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(sorted(MODELS)))
    ap.add_argument("--devices", default="8,64")
    ap.add_argument("--cluster", default="dgx-a100")
    ap.add_argument("--mcmc-seconds", type=float, default=10.0)
    ap.add_argument("--ilp-seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print("| model | GPUs | method | search s | x exact search | cost model ms | simulated ms | "
          "peak GiB | speedup vs DP (sim) | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for n in map(int, args.devices.split(",")):
            cmp = compare(build_model(name), get_cluster(args.cluster, devices=n), n,
                          mcmc_seconds=args.mcmc_seconds, ilp_seconds=args.ilp_seconds, seed=args.seed)
            base = max(cmp.get("exact").search_seconds, 1e-9)
            for m in cmp.methods:
                if m.choice is None:
                    print(f"| {name} | {n} | {m.name} | {m.search_seconds:.3f} | - | - | - | - | - | {m.note} |")
                    continue
                sp = cmp.speedup(m.name)
                note = ("optimal" if m.optimal else "") + ("" if m.fits else " does not fit")
                ratio = m.search_seconds / base if m.name in ("ilp", "mcmc", "optcnn") else math.nan
                print(f"| {name} | {n} | {m.name} | {m.search_seconds:.3f} | "
                      f"{'-' if math.isnan(ratio) else f'{ratio:.1f}'} | {1e3 * m.cost:.4g} | "
                      f"{1e3 * m.simulated_seconds:.4g} | {m.peak_memory_bytes / 2**30:.2f} | "
                      f"{sp:.2f}x | {note.strip()} |", flush=True)


if __name__ == "__main__":
    main()
