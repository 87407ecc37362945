"""Reprice saved fidelity runs under the code at hand (prints a table, not a test).

    python benchmarks/reprice.py DIR [DIR ...] [--set FIELD=VALUE ...] [--refit horizon|exponent]
                                 [--models llama,torch_cnn] [--pairs]

Each ``DIR`` is a folder that ``benchmarks/fidelity.py --out DIR`` wrote: per model its calibrated
cluster file, its nine plan files and every launch's records (``<model>-runs.json.gz``; the
``benchmarks/fidelity_runs/`` folders are the runs recorded in the README and ``docs/fidelity.md``).
For every run and model the plans are priced again by ``cost.step.step_seconds`` from the run's own
calibration (``--set`` overrides a field of its device, e.g. ``--set sync_jitter_horizon=0.004``, or
``none``; with ``--refit`` the waits' law is then fitted again from the calibration's own rounds, as
``shardplan calibrate`` fits it, so that a change to the law or its fit is weighed as it would have
been calibrated), and set against the same measurements, three ways as ``fidelity.py`` sets them: Kendall's
tau against each plan's best step, its paired figure and its median step, and how many predictions
lie within 20% of the best step and of the median. A change to the cost model can so be weighed on
every recorded run, not only on the next one, whose calibration and measurement are new draws of a
noisy machine. With ``--pairs`` a second table lists, per run and model, the pairs of plans the
repriced predictions and the paired figures rank apart, with both ratios: a near tie broken the
wrong way reads differently from a real difference the model misses.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import sys

import numpy as np
import yaml

from fidelity import MODELS, discordant, measured, scores
from shardplan.capture import capture
from shardplan.capture.models import build, parse_config
from shardplan.cluster import load_cluster
from shardplan.cluster.model import Device
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.step import step_seconds
from shardplan.cost.tables import build_tables
from shardplan.execute.launch import RUN_OPTIMIZER
from shardplan.execute.plans import tensor_parallel
from shardplan.execute.probes import COMPUTE_PROBE, probe_model, typical_step, wait_laws
from shardplan.plan import Plan


def load_records(folder: str, name: str) -> dict | None:
    """``{plan: [one record per launch]}`` of ``name`` in a fidelity run's folder, or None."""
    for path, opener in ((f"{name}-runs.json.gz", gzip.open), (f"{name}-runs.json", open)):
        if os.path.exists(os.path.join(folder, path)):
            with opener(os.path.join(folder, path), "rt") as fh:
                return json.load(fh)
    return None


def overrides(pairs: list[str]) -> dict:
    """``["sync_jitter=0.02", "sync_jitter_horizon=none"]`` -> device fields, checked by name."""
    fields = {f.name for f in dataclasses.fields(Device)}
    out = {}
    for item in pairs:
        key, _, value = item.partition("=")
        if not value:
            sys.exit(f"--set {item!r}: expected FIELD=VALUE")
        if key not in fields:
            sys.exit(f"--set {item!r}: the device has no field {key!r}")
        out[key] = None if value.lower() == "none" else float(value)
    return out


_PROBE: dict = {}
"""The probe Llama's captured graph, once per process (``refit`` needs it for every run)."""


def raw_measurements(path: str) -> dict:
    """The raw measurements ``shardplan calibrate`` keeps in a cluster file's comments."""
    with open(path) as fh:
        return yaml.safe_load("\n".join(line[4:] for line in fh.read().splitlines() if line.startswith("#   ")))


def refit(cluster, raw: dict, law: str):
    """``cluster`` with its waits' law fitted again, by the code at hand, from the calibration's own
    rounds (``raw``: its comments): the tensor-parallel probe's typical step and the replicated
    probe's end wait (``probes.wait_laws``; ``law``: "horizon", what ``calibrate`` prices by, or
    "exponent"); every other field as given (``--set`` included)."""
    tp, rep = (raw[f"{k}_probe_step_seconds"]["rounds_ms"] for k in ("tensor_parallel", "replicated"))
    step = raw["probe_step_seconds"][1]
    typical = typical_step([t / 1e3 for t in tp], [t / 1e3 for t in rep], step)
    graph = _PROBE.setdefault("graph", probe_model(COMPUTE_PROBE)[2])
    value, jitter = wait_laws(typical, raw["replicated_probe_end_wait"]["seconds"], step, graph, cluster,
                              raw["world_size"], tensor_parallel, laws=(law,))[law]
    field = "sync_jitter_horizon" if law == "horizon" else "sync_jitter_exponent"
    device = dataclasses.replace(cluster.device, sync_jitter=jitter, **{field: value},
                                 **({"sync_jitter_horizon": None} if law == "exponent" else {}))
    return dataclasses.replace(cluster, device=device)


def reprice(folder: str, name: str, device: dict, law: str | None = None) -> list[float]:
    """Each recorded plan's predicted step under the code at hand, from the run's calibration (its
    waits' law fitted again when ``law`` is given: see :func:`refit`)."""
    records = load_records(folder, name)
    path = os.path.join(folder, f"calibrated-{name}.yaml")
    cluster = load_cluster(path)
    if device:
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **device))
    if law:
        cluster = refit(cluster, raw_measurements(path), law)
    model = AnalyticCostModel(cluster, optimizer=RUN_OPTIMIZER)
    config, batch, seq = MODELS[name]
    module, kwargs = build(name, batch=batch, seq=seq, **parse_config(config))
    tables = build_tables(capture(module, (), kwargs, name=name), model, records[next(iter(records))][0]["devices"])
    out = []
    for plan in records:
        with open(os.path.join(folder, f"{name}-{plan}.json")) as fh:
            choice = Plan.from_json(fh.read(), source=f"{folder}/{name}-{plan}.json").to_choice(tables)
        out.append(float(step_seconds(model, tables, choice)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="folders written by benchmarks/fidelity.py --out")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a field of each run's calibrated device (repeatable; 'none' for None)")
    ap.add_argument("--refit", choices=("horizon", "exponent"), default=None,
                    help="fit the waits' law again from each calibration's own rounds, after --set: the square "
                         "root capped at a horizon (what calibrate prices by) or a power with no horizon")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--pairs", action="store_true",
                    help="also list the pairs of plans ranked apart (paired figure against the repriced step)")
    args = ap.parse_args()
    device = overrides(args.set)
    names = [m for m in args.models.split(",") if m]
    print("| run | model | tau as run (best / paired / medians) | within 20% as run | tau repriced "
          "| within 20% repriced |")
    print("|---|---|---|---|---|---|")
    totals: dict[str, list] = {n: [] for n in names}
    apart: list[tuple] = []  # (run, model, plan a, plan b, measured a / b, predicted a / b)
    for folder in args.runs:
        for name in names:
            records = load_records(folder, name)
            if records is None:
                continue
            plans = list(records)
            meas = measured(records, plans)
            as_run = scores([records[p][0]["predicted_step_seconds"] for p in plans], meas)
            pred = reprice(folder, name, device, args.refit)
            now = scores(pred, meas)
            totals[name].append((as_run, now))
            run = os.path.basename(os.path.normpath(folder))
            apart += [(run, name, *d) for d in discordant(plans, pred, meas[1])]
            print(f"| {run} | {name} | "
                  f"{as_run[0]:.2f} / {as_run[1]:.2f} / {as_run[2]:.2f} | {as_run[3]} / {as_run[4]} | "
                  f"{now[0]:.2f} / {now[1]:.2f} / {now[2]:.2f} | {now[3]} / {now[4]} |", flush=True)
    for name, rows in totals.items():
        if rows:
            a, b = (np.mean([r[k][:3] for r in rows], axis=0) for k in (0, 1))
            print(f"| mean of {len(rows)} | {name} | {a[0]:.2f} / {a[1]:.2f} / {a[2]:.2f} | | "
                  f"{b[0]:.2f} / {b[1]:.2f} / {b[2]:.2f} | |")
    if args.pairs:
        print("\n| run | model | plans ranked apart (a / b) | measured a / b (paired) | repriced a / b |")
        print("|---|---|---|---|---|")
        for run, name, a, b, m, p in apart:
            print(f"| {run} | {name} | {a} / {b} | {m:.3f} | {p:.3f} |")


if __name__ == "__main__":
    main()
