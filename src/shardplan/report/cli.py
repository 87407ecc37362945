"""The ``shardplan`` command line: ``plan`` and ``models``."""

from __future__ import annotations

import argparse
import json
import sys
import time

from shardplan.cost.pase import PaseCostModel
from shardplan.cost.tables import build_tables
from shardplan.search.baselines import data_parallel
from shardplan.search.exact import exact_search
from shardplan.zoo import MODELS, build_model

COST_MODELS = {"pase": PaseCostModel}


class UsageError(Exception):
    pass


def _plan(args: argparse.Namespace) -> int:
    if args.devices < 1:
        raise UsageError(f"--devices must be a positive integer, got {args.devices}")
    if args.cost_model not in COST_MODELS:
        raise UsageError(f"unknown cost model {args.cost_model!r}; available: {', '.join(COST_MODELS)}")
    try:
        graph = build_model(args.model, args.batch)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    model = COST_MODELS[args.cost_model]()
    start = time.perf_counter()
    tables = build_tables(graph, model, args.devices)
    result = exact_search(tables)
    seconds = time.perf_counter() - start
    baselines = {"data_parallel": tables.cost_of(data_parallel(tables))}
    layers = []
    for op, cfgs, c in zip(graph.ops, tables.configs, result.choice):
        cfg = cfgs[c]
        layers.append({"name": op.name, "kind": op.kind,
                       "split": {d.name: int(f) for d, f in zip(op.dims, cfg) if f > 1}})
    out = {"model": graph.name, "devices": args.devices, "cost_model": model.name, "unit": model.unit,
           "cost": result.cost, "optimal": True, "search_seconds": seconds, "layers": layers,
           "baselines": baselines, "breakdown": tables.breakdown(list(result.choice))}
    if args.json == "-":
        print(json.dumps(out))
        return 0
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{graph.name} on {args.devices} devices ({model.name} cost model)")
    table.add_column("op")
    table.add_column("kind")
    table.add_column("split")
    for layer in layers:
        split = " ".join(f"{k}={v}" for k, v in layer["split"].items()) or "replicated"
        table.add_row(layer["name"], layer["kind"], split)
    console = Console()
    console.print(table)
    console.print(f"cost: {result.cost:.6g} {model.unit}  (search {seconds:.2f} s, exact)")
    for name, cost in baselines.items():
        console.print(f"speedup over {name}: {cost / result.cost:.3f}x  ({name} cost {cost:.6g})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardplan", description="Plan parallel training of a network.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="find the cheapest per-layer parallelization")
    p.add_argument("--model", required=True, help="built-in model name (see `shardplan models`)")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--cost-model", default="pase")
    p.add_argument("--json", default=None, help="write the plan as JSON to FILE, or - for stdout")
    sub.add_parser("models", help="list built-in models")
    args = parser.parse_args(argv)
    try:
        if args.command == "models":
            for name in sorted(MODELS):
                print(name)
            return 0
        return _plan(args)
    except UsageError as exc:
        print(f"shardplan: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
