"""Search speed: model x devices -> build/search seconds, peak memory, cost, data-parallel cost.

Run: python benchmarks/search_speed.py [--cost-model pase|analytic] [--devices 4,8,...] [--models a,b]
                                       [--cluster dgx-a100] [--time-limit 60] [--memory]
Prints what it measures on this machine. With the pase cost model (the default) the machine is
PaSE's default (r = 5000) and the graphs are PaSE's, so the costs compare one to one with PaSE's
code. ``--memory`` repeats each case under tracemalloc for the peak Python-level allocation (slower).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

from shardplan.cluster import get_cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.pase import PaseCostModel
from shardplan.cost.tables import build_tables
from shardplan.search.baselines import data_parallel
from shardplan.search.solve import solve
from shardplan.zoo import build_model

PASE_MODELS = "alexnet,inception_v3,resnet101,rnnlm,transformer"


def run(name: str, p: int, args) -> tuple:
    graph = build_model(name)
    model = PaseCostModel() if args.cost_model == "pase" else AnalyticCostModel(get_cluster(args.cluster, devices=p))
    t0 = time.perf_counter()
    tables = build_tables(graph, model, p)
    t1 = time.perf_counter()
    sol = solve(tables, time_limit_s=args.time_limit)
    t2 = time.perf_counter()
    return tables, sol, t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cost-model", default="pase", choices=["pase", "analytic"])
    ap.add_argument("--cluster", default="dgx-a100")
    ap.add_argument("--devices", default="4,8,16,32,64,256,1024")
    ap.add_argument("--models", default=PASE_MODELS)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--memory", action="store_true")
    args = ap.parse_args()
    print(f"cost model {args.cost_model}" + (f" on {args.cluster}" if args.cost_model == "analytic" else ""))
    print("| model | devices | max K | build s | search s | peak MB | cost | data-parallel cost | DP / opt | optimal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for p in (int(x) for x in args.devices.split(",")):
            tables, sol, build_s, search_s = run(name, p, args)
            peak = "-"
            if args.memory:
                tracemalloc.start()
                run(name, p, args)
                peak = f"{tracemalloc.get_traced_memory()[1] / 2**20:.0f}"
                tracemalloc.stop()
            dp = tables.cost_of(data_parallel(tables))
            print(f"| {name} | {p} | {max(tables.num_configs)} | {build_s:.2f} | {search_s:.2f} | {peak} | "
                  f"{sol.cost:.6g} | {dp:.6g} | {dp / sol.cost:.3f} | {'yes' if sol.optimal else 'no: ' + sol.method} |",
                  flush=True)


if __name__ == "__main__":
    main()
