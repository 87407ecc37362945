"""Search speed on PaSE's graphs: model x devices -> build/search seconds, peak memory, cost, DP cost.

Run: python benchmarks/search_speed.py [--devices 4,8,16,32,64] [--models alexnet,...]
Prints what it measures on this machine (pase cost model, PaSE's default machine r = 5000).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

from shardplan.cost.pase import PaseCostModel
from shardplan.cost.tables import build_tables
from shardplan.search.baselines import data_parallel
from shardplan.search.exact import exact_search
from shardplan.zoo import MODELS, build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="4,8,16,32,64")
    ap.add_argument("--models", default=",".join(sorted(MODELS)))
    args = ap.parse_args()
    print(f"| model | devices | max K | build s | search s | peak MB | cost | data-parallel cost | DP / opt |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        graph = build_model(name)
        for p in (int(x) for x in args.devices.split(",")):
            tracemalloc.start()
            t0 = time.perf_counter()
            tables = build_tables(graph, PaseCostModel(), p)
            t1 = time.perf_counter()
            result = exact_search(tables)
            t2 = time.perf_counter()
            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
            dp = tables.cost_of(data_parallel(tables))
            print(f"| {name} | {p} | {max(tables.num_configs)} | {t1 - t0:.2f} | {t2 - t1:.2f} | {peak:.0f} | "
                  f"{result.cost:.0f} | {dp:.0f} | {dp / result.cost:.3f} |", flush=True)


if __name__ == "__main__":
    main()
