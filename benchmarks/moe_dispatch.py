"""Expert parallelism measured: a Mixtral-style model's experts split over the ranks with the tokens
gathered (``experts``) or sent by all-to-all (``experts_a2a``), beside data parallel, replicated and
tensor parallel plans and the searched one, each run with ``shardplan run`` on this machine and
priced on its calibrated cluster.

    python benchmarks/moe_dispatch.py [--devices 2] [--steps 20] [--repeats 3] [--cluster FILE]
                                      [--config k=v,...] [--batch 8] [--seq 64]

Without ``--cluster`` the machine is calibrated first (``shardplan calibrate``, about a minute). All
plans' steps are interleaved in each launch (``shardplan run --plan A --plan B ...``), ``--repeats``
launches; the first launch also checks every plan against single-device training (``--check``).
Prints per plan the predicted step, the best and median measured steps and the paired figure (as
``benchmarks/fidelity.py``), then the two expert-parallel plans' ratio predicted and measured and
Kendall's tau of the predictions against the measurements. The plans are priced with the routing
the ranks run (``capture.moe.measure_routing``: the busiest expert group's rows, ``cost.routing``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from fidelity import launch, measured, scores

import torch

from shardplan.capture import capture
from shardplan.capture.models import build, parse_config
from shardplan.capture.moe import measure_routing
from shardplan.cluster import load_cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.tables import build_tables
from shardplan.execute.launch import RUN_OPTIMIZER
from shardplan.execute.plans import expert_parallel, replicated, tensor_parallel
from shardplan.plan import Plan
from shardplan.search.baselines import data_parallel
from shardplan.search.solve import solve

CONFIG = ("hidden_size=256,intermediate_size=512,num_hidden_layers=2,num_attention_heads=8,num_key_value_heads=8,"
          "vocab_size=1024,num_local_experts=8,num_experts_per_tok=2")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", default=None, help="a calibrated cluster file (default: calibrate first)")
    ap.add_argument("--config", default=CONFIG, help="Mixtral config overrides")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", default=None, help="keep plan files, the cluster and the records here")
    args = ap.parse_args()
    tmp = args.out or tempfile.mkdtemp(prefix="moe-dispatch-")
    os.makedirs(tmp, exist_ok=True)
    cluster_file = args.cluster
    if cluster_file is None:
        cluster_file = os.path.join(tmp, "calibrated.yaml")
        cal = subprocess.run([sys.executable, "-m", "shardplan.report.cli", "calibrate", "--devices", str(args.devices),
                              "--out", cluster_file], capture_output=True, text=True)
        if cal.returncode:
            sys.exit(f"shardplan calibrate failed: {cal.stderr.strip()[-500:]}")
    model = AnalyticCostModel(load_cluster(cluster_file), optimizer=RUN_OPTIMIZER)
    torch.manual_seed(0)  # the weights and batch the ranks build (shardplan run measures the same routing)
    module, kwargs = build("mixtral", batch=args.batch, seq=args.seq, **parse_config(args.config))
    module.eval()
    graph = measure_routing(capture(module, (), kwargs, name="mixtral"), module, kwargs)
    tables = build_tables(graph, model, args.devices)
    plans = {"data_parallel": data_parallel(tables), "experts_gathered": expert_parallel(tables, "gather"),
             "experts_all_to_all": expert_parallel(tables), "replicated": replicated(tables),
             "tensor_parallel": tensor_parallel(tables), "searched": solve(tables, model=model).choice}
    paths = {}
    for name, choice in plans.items():
        paths[name] = os.path.join(tmp, f"mixtral-{name}.json")
        with open(paths[name], "w") as fh:
            fh.write(Plan.from_choice(tables, list(choice)).to_json())
    runs: dict[str, list] = {p: [] for p in plans}
    for rep in range(args.repeats):
        records, failure = launch("mixtral", args.config, args.devices, args.steps, args.batch, args.seq,
                                  cluster_file, [paths[p] for p in plans], check=rep == 0)
        if records is None:
            sys.exit(f"shardplan run failed: {failure}")
        for name, rec in zip(plans, records):
            runs[name].append(rec)
    names = list(plans)
    best, rel, median = measured(runs, names)
    pred = [runs[p][0]["predicted_step_seconds"] for p in names]
    print(f"Mixtral ({args.config}), batch {args.batch} x seq {args.seq}, {args.devices} gloo ranks, "
          f"{args.repeats} launches of {args.steps} steps per plan; cluster {cluster_file}")
    print("| plan | moe split | predicted ms | best ms | best / predicted | median ms | paired (x fastest) | check |")
    print("|---|---|---|---|---|---|---|---|")
    moe = next(i for i, op in enumerate(graph.ops) if op.kind == "moe")
    for i, name in enumerate(names):
        split = dict(zip(graph.ops[moe].dim_names, tables.configs[moe][plans[name][moe]]))
        split = ", ".join(f"{d} {f}" for d, f in split.items() if f > 1) or "none"
        ok = runs[name][0].get("check", {}).get("passed")
        print(f"| {name} | {split} | {1e3 * pred[i]:.2f} | {1e3 * best[i]:.2f} | {best[i] / pred[i]:.2f} | "
              f"{1e3 * median[i]:.2f} | {rel[i] / min(rel):.3f} | {'passed' if ok else 'FAILED'} |")
    g, a = names.index("experts_gathered"), names.index("experts_all_to_all")
    print(f"all-to-all / gathered: predicted {pred[a] / pred[g]:.3f}, best {best[a] / best[g]:.3f}, "
          f"paired {rel[a] / rel[g]:.3f}, median {median[a] / median[g]:.3f}")
    tau, tau_pair, tau_med, within, within_med = scores(pred, (best, rel, median))
    print(f"Kendall tau over {len(names)} plans: {tau:.2f} on best steps, {tau_pair:.2f} paired, {tau_med:.2f} on "
          f"medians; {within} of {len(names)} predictions within 20% of the best step, {within_med} of the median")
    print(f"plan files and cluster: {tmp}")


if __name__ == "__main__":
    main()
