"""Moves of a dim split over several mesh axes, made DTensor's way (one mesh axis at a time) and by
one exchange of what each rank lacks (``execute.exchange``), in a dry run of a searched plan.

    python benchmarks/nested_moves.py [--model mixtral] [--config k=v,...] [--devices 8]
                                      [--batch 8] [--seq 2048] [--cluster dgx-a100]

The plan is searched for ``--cluster`` and applied on its mesh in fake tensors, on a fake process
group (``execute.dryrun``, DTensor's all-to-alls issued as on a GPU runtime), once with every move
left to DTensor and once with the exchange. For each, the collectives of the step's redistributions
(DTensor's, partial sums reduced included, and the exchanges; the loss's gathers of the logits left
out, the same in both), priced at the cluster's rates (``cluster.model.collective_seconds``; an exchange at the bytes its busiest
rank receives, one all-to-all latency per peer), beside what the plan's edges are priced at
(the search's ``redistribution``). Nothing is measured on hardware: this counts bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

from shardplan.cluster import get_cluster
from shardplan.cluster.model import collective_seconds
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.tables import build_tables
from shardplan.execute import exchange
from shardplan.execute.dryrun import dry_run
from shardplan.execute.launch import capture_model
from shardplan.plan import Plan
from shardplan.search.solve import solve

MIXTRAL_8X7B = ("hidden_size=4096,intermediate_size=14336,num_hidden_layers=2,num_attention_heads=32,"
                "num_key_value_heads=8,vocab_size=32000,num_local_experts=8,num_experts_per_tok=2,"
                "max_position_embeddings=4096")


def price(run, cluster, loss_bytes: int) -> tuple[int, float, float]:
    """(collectives, bytes into the busiest rank or rank 0, seconds) of the step's moves."""
    count, nbytes, seconds = 0, 0.0, 0.0
    for c in run.collectives:
        if c.source != "redistribution" or c.nbytes >= loss_bytes // 4:  # not a move, or the logits' gathers
            continue
        count += 1
        q = cluster.per_level(c.ranks, 1)  # members per network level of consecutive ranks
        nbytes += c.nbytes * (q.prod() - 1) / q.prod()
        seconds += float(collective_seconds(cluster, c.kind, c.nbytes, q))
    for m in run.exchanges:
        count += 1
        lv = cluster.levels[int(cluster.level_of_span(m.group))]
        nbytes += m.busiest_bytes
        seconds += (m.group - 1) * lv.a2a_latency + m.busiest_bytes / lv.a2a_bandwidth
    return count, nbytes, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral")
    ap.add_argument("--config", default=MIXTRAL_8X7B)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cluster", default="dgx-a100")
    args = ap.parse_args(argv)

    cluster = get_cluster(args.cluster)
    graph = capture_model(args.model, args.config, args.batch, args.seq)
    model = AnalyticCostModel(cluster)
    tables = build_tables(graph, model, args.devices)
    sol = solve(tables)
    plan = Plan.from_choice(tables, sol.choice, cluster=cluster.name)
    edges = plan.breakdown.get("redistribution", float("nan"))
    vocab = max(t.shape[-1] for t in graph.tensors)
    loss_bytes = args.batch * args.seq * vocab * 4
    print(f"{args.model} on {args.devices} ranks of {cluster.name}: searched plan {plan.cost * 1e3:.2f} ms, "
          f"its edges priced {edges * 1e3:.3f} ms")
    print("| moves made by | collectives | bytes in | priced ms | dry run s |")
    print("|---|---|---|---|---|")
    for label, ctx in (("DTensor, axis by axis", mock.patch.object(exchange, "applies", lambda s, d: False)),
                       ("one exchange (execute.exchange)", contextlib.nullcontext())):
        t0 = time.perf_counter()
        with ctx:
            run = dry_run(args.model, args.config, args.batch, args.seq, plan, graph, all_to_all=True)
        count, nbytes, seconds = price(run, cluster, loss_bytes)
        print(f"| {label} | {count} | {nbytes / 1e6:.1f} MB | {seconds * 1e3:.3f} | "
              f"{time.perf_counter() - t0:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
