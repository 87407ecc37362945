"""Predicted vs measured step time of several plans on this machine (prints a table, not a test).

    python benchmarks/fidelity.py [--devices 2] [--steps 5] [--repeats 3] [--measure-seconds S] [--cluster FILE]
                                  [--models llama,torch_cnn] [--out DIR]

Without ``--cluster`` it runs ``shardplan calibrate`` on the same number of ranks right before each
model's launches (the shared machine's speed drifts within minutes). For one
transformer (HF Llama, small config) and one CNN, nine plans each (data parallel, tensor parallel,
the searched plan, an odd split, fully replicated, tensor parallel only in the MLP, data parallel
for the first half of the ops only, and two plans drawn op by op at random from the search space,
seeds 0 and 1, which no one would pick but the model must still rank) are written as plan files and
run with ``shardplan run --check``, all nine in one launch with their steps interleaved round-robin
(``shardplan run --plan A --plan B ...``), so a slow spell of the shared machine slows every plan
alike instead of whichever plan happened to be running. Tau is printed over all nine and over the
seven hand-made plans alone (the set of sessions 12-13).

What is compared, three ways:

* **best**: a plan's fastest step (``best_step_seconds``) over all steps and repeats. The rates come
  from the fastest calibration repetitions, and noise on a shared machine is mostly one-sided (a
  neighbour only slows a step down); but the fastest of 60 steps is also one whose ranks happened to
  stay in step, so it waits less at sync points than the prediction's expected waits.
* **paired**: the ranking from paired steps. Round k of a launch runs step k of every plan back to
  back (each round starting one plan further on), so the plans of one round share the machine's state
  of the moment. Each step is divided by its round's geometric mean, and a plan's figure is the
  median of those ratios over all rounds and repeats: drift between rounds cancels, and one slow step
  moves a median little. Printed relative to the fastest plan's.
* **median**: the median step, as ``shardplan run`` reports it (``measured_step_seconds``).

The prediction is ``shardplan run``'s ``predicted_step_seconds`` (``cost.step.step_seconds``): the
expected step, waits at sync points included (``sync_jitter``), so it is set against both the best and
the median step ("within 20%" is counted for each).

Kendall's tau (tau-b: a pair predicted equal, two identical plans, counts as neither agreeing nor
disagreeing) is given between the predicted ranking and each measured one. The **noise ceiling** is
tau between the paired rankings of the even and the odd rounds: how well the measurement agrees with
itself, so a bound on the agreement any prediction can show. The rounds are also drawn again with
replacement (500 draws, seeded) for a 90% interval of the paired and the best-step tau: how far
another sample of the same machine could move them. Plans that are the same plan (the
searched plan may be data parallel) are marked ``= other``. With ``--repeats R`` the launch runs R
times; the numerics are checked (``--check``) on the first. With ``--measure-seconds S`` a model whose
steps are short runs more of them: at least ``S`` seconds per plan and launch by the predictions
(``max(--steps, ceil(S / mean predicted step))``), so that the CNN's 25 ms steps are sampled as long
as Llama's 0.2 s ones and near-tied plans are told apart by more rounds, not by fewer. The plan files,
the calibrated cluster files and every launch's records (``<model>-runs.json.gz``: each plan's steps,
prediction and check) stay in the folder printed last (``--out DIR`` names it), so that
``benchmarks/reprice.py`` can set a changed cost model against the same measurements offline.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from shardplan.capture import capture
from shardplan.capture.models import build, parse_config
from shardplan.cluster import load_cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.step import step_seconds
from shardplan.cost.tables import build_tables
from shardplan.execute.launch import RUN_OPTIMIZER
from shardplan.execute.plans import half_data_parallel, mixed, odd, random_plan, replicated, tensor_parallel
from shardplan.plan import Plan
from shardplan.search.baselines import data_parallel
from shardplan.search.solve import solve

MODELS = {  # name -> (config, batch, seq)
    "llama": ("hidden_size=256,intermediate_size=1024,num_hidden_layers=4,num_attention_heads=16,"
              "num_key_value_heads=16,vocab_size=2048", 8, 64),
    "torch_cnn": ("channels=64,hidden=1024", 32, 1),
}


def launch(model: str, config: str, devices: int, steps: int, batch: int, seq: int, cluster_file: str,
           plan_files: list[str], check: bool = False) -> tuple[list | None, str]:
    """One ``shardplan run`` launch of every plan in ``plan_files``, their steps interleaved:
    (one record per plan, as ``shardplan run --json`` gives them, ""), or (None, the failure's last
    line of stderr). ``check``: also compare each plan with single-device training."""
    cmd = [sys.executable, "-m", "shardplan.report.cli", "run", "--model", model, "--hf-config", config,
           "--devices", str(devices), "--steps", str(steps), "--batch", str(batch), "--seq", str(seq),
           "--cluster", cluster_file, "--json", "-"]
    for path in plan_files:
        cmd += ["--plan", path]
    cmd += ["--check"] if check else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])["plans"], ""
    except (IndexError, KeyError, json.JSONDecodeError):
        return None, " ".join(proc.stderr.strip().splitlines()[-1:])


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b between two rankings: (agreeing - disagreeing pairs) / sqrt((pairs - pairs tied
    in a) x (pairs - pairs tied in b))."""
    n, s, tie_a, tie_b = len(a), 0, 0, 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = (a[i] > a[j]) - (a[i] < a[j]), (b[i] > b[j]) - (b[i] < b[j])
            s += x * y
            tie_a += x == 0
            tie_b += y == 0
    pairs = n * (n - 1) / 2
    denom = math.sqrt((pairs - tie_a) * (pairs - tie_b))
    return s / denom if denom else float("nan")


def discordant(names: list[str], pred: list[float], meas: list[float]) -> list[tuple[str, str, float, float]]:
    """The pairs the two rankings order oppositely: (plan a, plan b, measured a / b, predicted a / b), the
    pairs the measurement ranks furthest apart first. How far apart a discordant pair measures says
    whether the model misses a real difference or breaks a near tie."""
    out = [(names[i], names[j], meas[i] / meas[j], pred[i] / pred[j])
           for i in range(len(names)) for j in range(i + 1, len(names))
           if (pred[i] - pred[j]) * (meas[i] - meas[j]) < 0]
    return sorted(out, key=lambda d: -abs(math.log(d[2])))


def measured(records: dict, plans: list[str]) -> tuple[list, list, list]:
    """(best steps, paired figures, median steps) per plan from every launch's records (``records``:
    plan -> one record per launch, as ``shardplan run --json`` gives them): each plan's fastest step
    over its launches, :func:`paired` over all rounds, and its launches' lowest median."""
    rounds = [[t for rec in records[p] for t in rec["step_seconds"]] for p in plans]
    best = [min(rec["best_step_seconds"] for rec in records[p]) for p in plans]
    median = [min(rec["measured_step_seconds"] for rec in records[p]) for p in plans]
    return best, paired(rounds), median


def scores(pred: list[float], meas: tuple) -> tuple:
    """(tau best, tau paired, tau medians, within 20% of best, within 20% of median) of the predictions
    ``pred`` against ``meas``, :func:`measured`'s three figures."""
    best, rel, median = meas
    return (kendall_tau(pred, best), kendall_tau(pred, rel), kendall_tau(pred, median),
            sum(abs(m / p - 1) <= 0.2 for p, m in zip(pred, best)),
            sum(abs(m / p - 1) <= 0.2 for p, m in zip(pred, median)))


def paired(steps: list[list[float]]) -> list[float]:
    """Per plan, the median over rounds of its step's time over the round's geometric mean (``steps``:
    per plan, its step times in round order; every plan has the same rounds)."""
    logs = np.log(np.array(steps, dtype=np.float64))  # (plans, rounds)
    return np.exp(np.median(logs - logs.mean(axis=0), axis=1)).tolist()


def bootstrap_tau(pred: list[float], rounds: list[list[float]], draws: int = 500, seed: int = 0) -> tuple:
    """90% intervals (5th, 95th percentile) of tau against ``pred`` when the rounds are drawn again with
    replacement ``draws`` times: (paired, best). How much a ranking measured on these rounds could move
    on another sample of the same machine's behaviour; ``rounds``: per plan, its step times in round
    order."""
    rng = np.random.default_rng(seed)
    steps = np.array(rounds, dtype=np.float64)  # (plans, rounds)
    pairs, bests = [], []
    for _ in range(draws):
        pick = steps[:, rng.integers(0, steps.shape[1], steps.shape[1])]
        pairs.append(kendall_tau(pred, paired(pick.tolist())))
        bests.append(kendall_tau(pred, pick.min(axis=1).tolist()))
    return tuple(tuple(float(q) for q in np.nanpercentile(v, [5, 95])) for v in (pairs, bests))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--measure-seconds", type=float, default=0.0,
                    help="run at least this many seconds of steps per plan and launch (by the predictions): "
                         "more rounds for a model with short steps")
    ap.add_argument("--cluster", default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="launch the interleaved run this many times and keep each plan's fastest step "
                         "(the shared 2-core machine moves a plan's step by up to 40%% between runs)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--out", default=None,
                    help="keep the plan files, calibrated clusters and every launch's records in this folder "
                         "(default: a new temporary one); benchmarks/reprice.py reprices them under changed code")
    args = ap.parse_args()
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}; expected some of {', '.join(MODELS)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    tmp = args.out or tempfile.mkdtemp(prefix="fidelity-")
    print("| model | plan | predicted s | best s | best / predicted | median s | median / predicted "
          "| paired (x fastest) | check | spread of best |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary, calibrations = [], []
    for name in names:
        config, batch, seq = MODELS[name]
        # calibrate right before each model's launches: the shared machine's speed drifts within minutes
        # the cluster the predictions price on, kept under this name in the run's folder either way
        # (``--cluster`` copied in), so that ``reprice.py`` finds it
        cluster_file = os.path.join(tmp, f"calibrated-{name}.yaml")
        if args.cluster:
            shutil.copyfile(args.cluster, cluster_file)
        else:
            cal = subprocess.run([sys.executable, "-m", "shardplan.report.cli", "calibrate", "--devices",
                                  str(args.devices), "--out", cluster_file], capture_output=True, text=True)
            if cal.returncode:
                sys.exit(f"shardplan calibrate failed: {cal.stderr.strip()[-500:]}")
            calibrations.append(f"{name}: {cal.stdout.strip().splitlines()[-1]}")
        model = AnalyticCostModel(load_cluster(cluster_file), optimizer=RUN_OPTIMIZER)
        kw = parse_config(config)
        module, kwargs = build(name, batch=batch, seq=seq, **kw)
        graph = capture(module, (), kwargs, name=name)
        tables = build_tables(graph, model, args.devices)
        plans = {"data_parallel": data_parallel(tables), "tensor_parallel": tensor_parallel(tables),
                 "searched": solve(tables, model=model).choice, "odd": odd(tables), "replicated": replicated(tables),
                 "mlp_tensor_parallel": mixed(tables),
                 "half_data_parallel": half_data_parallel(tables),
                 "random_0": random_plan(tables, 0), "random_1": random_plan(tables, 1)}
        runs: dict[str, list] = {p: [] for p in plans}
        paths = {}
        for pname, choice in plans.items():
            paths[pname] = os.path.join(tmp, f"{name}-{pname}.json")
            with open(paths[pname], "w") as fh:
                fh.write(Plan.from_choice(tables, list(choice)).to_json())
        steps = args.steps
        if args.measure_seconds > 0:  # short steps: more of them, by the predictions
            mean_step = float(np.mean([step_seconds(model, tables, list(c)) for c in plans.values()]))
            steps = max(steps, math.ceil(args.measure_seconds / mean_step))
        for rep in range(args.repeats):  # one launch per repeat, every plan's steps interleaved in it
            records, failure = launch(name, config, args.devices, steps, batch, seq, cluster_file,
                                      [paths[p] for p in plans], check=rep == 0)
            if records is None:
                print(f"| {name} | (all) | - | - | - | failed: {failure} |")
                continue
            for pname, rec in zip(plans, records):
                runs[pname].append(rec)
        done = [p for p in plans if runs[p]]
        if not done:
            continue
        with gzip.open(os.path.join(tmp, f"{name}-runs.json.gz"), "wt") as fh:  # every launch's records
            json.dump({p: runs[p] for p in done}, fh)
        same = {p: next((q for q in done[:i] if list(plans[q]) == list(plans[p])), None) for i, p in enumerate(done)}
        rounds = [[t for o in runs[p] for t in o["step_seconds"]] for p in done]
        meas, rel, medians = measured(runs, done)
        pred = [runs[p][0]["predicted_step_seconds"] for p in done]
        halves = [paired([r[h::2] for r in rounds]) for h in (0, 1)]
        for i, pname in enumerate(done):
            outs = runs[pname]
            p, m, med = pred[i], meas[i], medians[i]
            ok = outs[0].get("check", {}).get("passed")
            spread = max(o["best_step_seconds"] for o in outs) / m - 1
            label = pname + (f" (= {same[pname]})" if same[pname] else "")
            print(f"| {name} | {label} | {p:.4g} | {m:.4g} | {m / p:.2f} | {med:.4g} | {med / p:.2f} | "
                  f"{rel[i] / min(rel):.3f} | {'passed' if ok else 'FAILED'} | {100 * spread:.0f}% |", flush=True)
        tau, tau_pair, tau_med, within, within_med = scores(pred, (meas, rel, medians))
        hand = [i for i, p in enumerate(done) if not p.startswith("random")]
        summary.append((name, tau, tau_pair, tau_med, kendall_tau(*halves), within, within_med, len(pred), len(rounds[0]),
                        bootstrap_tau(pred, rounds),
                        (len(hand), kendall_tau([pred[i] for i in hand], [meas[i] for i in hand]),
                         kendall_tau([pred[i] for i in hand], [rel[i] for i in hand]),
                         kendall_tau(*[[h[i] for i in hand] for h in halves])),
                        discordant(done, pred, rel)))
    for line in calibrations:
        print(line)
    print(f"plan files, calibrated clusters and every launch's records (<model>-runs.json.gz): {tmp}")
    for name, tau, tau_pair, tau_med, ceiling, within, within_med, n, k, (ci_pair, ci_best), hand, pairs in summary:
        print(f"{name}: Kendall tau over {n} plans = {tau:.2f} on best steps (rounds resampled: 90% in "
              f"{ci_best[0]:.2f}-{ci_best[1]:.2f}), {tau_pair:.2f} paired over {k} rounds ({ci_pair[0]:.2f}-"
              f"{ci_pair[1]:.2f}), {tau_med:.2f} on medians; noise ceiling (even vs odd rounds) {ceiling:.2f}; "
              f"{within} of {n} predictions within 20% of the best step, {within_med} of {n} of the median")
        print(f"{name}, the {hand[0]} hand-made plans alone (no random plan): tau {hand[1]:.2f} on best steps, "
              f"{hand[2]:.2f} paired; noise ceiling {hand[3]:.2f}")
        print(f"{name}, pairs ranked apart on the paired figure: " + ("; ".join(
            f"{a} / {b} measured {m:.3f}, predicted {p:.3f}" for a, b, m, p in pairs) or "none"))


if __name__ == "__main__":
    main()
