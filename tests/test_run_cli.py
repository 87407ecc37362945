"""``shardplan run``: one real torchrun launch (gloo, 2 ranks) and the refusals made before any launch."""

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("transformers")

from shardplan.report.cli import main  # noqa: E402


def test_the_model_is_captured_on_the_meta_device(monkeypatch):
    """``capture_model`` allocates no weight: a Mixtral-8x7B-shaped model (7 GB of fp32 weights in
    two layers) took 55 s here when ``build``'s own CPU device overrode the caller's meta device."""
    import shardplan.execute.launch as launch

    seen = []
    real = launch.capture

    def spy(module, *args, **kwargs):
        seen.extend({p.device.type for p in module.parameters()})
        return real(module, *args, **kwargs)
    monkeypatch.setattr(launch, "capture", spy)
    launch.capture_model("llama", "", 2, 8)
    assert seen == ["meta"]


def test_run_with_check_on_two_ranks():
    proc = subprocess.run([sys.executable, "-m", "shardplan.report.cli", "run", "--model", "torch_mlp",
                           "--devices", "2", "--steps", "2", "--check", "--json", "-"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["check"]["passed"] is True
    assert out["check"]["max_rel_diff"] <= 1e-5
    assert out["measured_step_seconds"] > 0
    assert out["predicted_step_seconds"] > 0
    assert len(out["step_seconds"]) == 2


def test_ranks_take_a_gpu_each_where_torch_sees_gpus(monkeypatch):
    """A rank's device is its local GPU (torchrun's LOCAL_RANK) where torch sees GPUs, else the CPU; a
    launch asking for more ranks on a host than it has GPUs is refused before torchrun starts."""
    import types

    import torch

    from shardplan.execute import launch, worker

    assert worker.rank_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert worker.rank_device() == torch.device("cuda", 3)
    with pytest.raises(RuntimeError, match="asks for 2 ranks on this host, but it has 1 GPU"):
        launch.launch("torch_mlp", "", 4, 16, types.SimpleNamespace(devices=2), 1, False)
    # on two hosts each starts half the ranks: 4 ranks need 2 GPUs on each
    with pytest.raises(RuntimeError, match="asks for 2 ranks on this host, but it has 1 GPU"):
        launch.launch("torch_mlp", "", 4, 16, types.SimpleNamespace(devices=4), 1, False,
                      hosts=launch.Hosts(nnodes=2, node_rank=1, master_port=29555))


def test_example_plans_and_trains_llama_on_two_ranks():
    """``examples/train_llama.py`` under torchrun: the plan it finds runs, its first loss is the
    single-device one, and three SGD steps lower it."""
    import re

    from shardplan.execute.launch import _free_port

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "train_llama.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), example],
                          capture_output=True, text=True, timeout=300)
    # a rank's own error comes before the launcher's traceback, which fills the end of stderr
    clues = [ln for ln in proc.stderr.splitlines() if re.search(r"Error|error:|terminate|Abort|signal", ln)]
    assert proc.returncode == 0, "\n".join(clues[:20]) + "\n...\n" + proc.stderr[-1500:]
    losses = [float(x) for x in re.findall(r"step \d: loss ([0-9.e-]+)", proc.stdout)]
    single = float(re.search(r"one device: ([0-9.e-]+)", proc.stdout).group(1))
    assert len(losses) == 3
    assert losses[0] == pytest.approx(single, rel=1e-5)
    assert losses[2] < losses[1] < losses[0]


def test_several_plans_run_interleaved_in_one_launch(tmp_path):
    """Two plan files, one launch: a record per plan (in the order given) with its own prediction,
    its timed steps and its own check against single device."""
    from shardplan.capture import capture
    from shardplan.capture.models import build
    from shardplan.cluster import get_cluster
    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.tables import build_tables
    from shardplan.execute.plans import tensor_parallel
    from shardplan.plan import Plan
    from shardplan.search.baselines import data_parallel

    module, kwargs = build("torch_mlp")
    graph = capture(module, (), kwargs, name="torch_mlp")
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=2)), 2)
    files = []
    for name, choice in (("dp", data_parallel(tables)), ("tp", tensor_parallel(tables))):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(Plan.from_choice(tables, list(choice)).to_json())
    proc = subprocess.run([sys.executable, "-m", "shardplan.report.cli", "run", "--model", "torch_mlp",
                           "--devices", "2", "--steps", "2", "--check", "--json", "-",
                           "--plan", str(files[0]), "--plan", str(files[1])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["interleaved"]
    assert [r["plan_file"] for r in out["plans"]] == [str(f) for f in files]
    preds = [r["predicted_step_seconds"] for r in out["plans"]]
    assert preds[0] != preds[1]  # each plan priced on its own
    for r in out["plans"]:
        assert r["check"]["passed"] is True and r["check"]["max_rel_diff"] <= 1e-5
        assert len(r["step_seconds"]) == 2 and r["best_step_seconds"] == min(r["step_seconds"])


def test_two_hosts_run_one_data_parallel_world(tmp_path):
    """``--nnodes 2``: two ``shardplan run`` processes, each one host's share of the ranks (here both
    on this machine, meeting at a port on localhost as two hosts would at rank 0's). The data-parallel
    plan's gradients are all-reduced across the two; rank 0's host reports the measured steps and the
    check against single device, the other host its rank and that it finished."""
    import socket

    from shardplan.capture import capture
    from shardplan.capture.models import build
    from shardplan.cluster import get_cluster
    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.tables import build_tables
    from shardplan.plan import Plan
    from shardplan.search.baselines import data_parallel

    module, kwargs = build("torch_mlp")
    graph = capture(module, (), kwargs, name="torch_mlp")
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=2)), 2)
    plan = tmp_path / "dp.json"
    plan.write_text(Plan.from_choice(tables, data_parallel(tables)).to_json())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def host(rank):
        return [sys.executable, "-m", "shardplan.report.cli", "run", "--model", "torch_mlp", "--devices", "2",
                "--steps", "2", "--check", "--plan", str(plan), "--json", "-", "--nnodes", "2", "--node-rank",
                str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    other = subprocess.Popen(host(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = subprocess.run(host(0), capture_output=True, text=True, timeout=300)
    out1, err1 = other.communicate(timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert other.returncode == 0, err1[-2000:]
    out = json.loads(first.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2 and out["check"]["passed"] is True and out["check"]["max_rel_diff"] <= 1e-5
    assert len(out["step_seconds"]) == 2 and out["measured_step_seconds"] > 0
    assert all(dict(layer["split"]).get("batch") == 2 for layer in out["plan"])
    assert json.loads(out1.strip().splitlines()[-1]) == {"node_rank": 1, "nnodes": 2, "ranks": [1], "ok": True,
                                                           "errors": []}


@pytest.mark.parametrize("extra, says", [
    (["--devices", "3", "--nnodes", "2", "--master-port", "29555"], "do not split evenly over 2 hosts"),
    (["--devices", "2", "--nnodes", "2", "--node-rank", "2", "--master-port", "29555"], "--node-rank must lie in 0..1"),
    (["--devices", "2", "--nnodes", "2", "--node-rank", "1"], "needs --master-addr"),
    (["--devices", "2", "--nnodes", "2", "--master-port", "29555", "--dry-run"], "leave out --nnodes")])
def test_a_run_on_several_hosts_is_refused_before_launch_when_they_cannot_agree(extra, says, capsys):
    assert main(["run", "--model", "torch_mlp", *extra]) == 2
    assert says in capsys.readouterr().err


def test_plan_of_another_model_is_refused_before_launch(tmp_path, capsys):
    plan = tmp_path / "mlp.json"
    assert main(["plan", "--model", "mlp", "--devices", "2", "--json", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", "--model", "llama", "--devices", "2", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "plan is for model 'mlp'" in err and "'llama'" in err
    # among several plans, the culprit is named by its file
    assert main(["run", "--model", "llama", "--devices", "2", "--plan", str(plan), "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert str(plan) in err and "plan is for model 'mlp'" in err


def test_unknown_or_unrunnable_model_is_refused(capsys):
    assert main(["run", "--model", "nosuch", "--devices", "2"]) == 2
    assert "nosuch" in capsys.readouterr().err
    assert main(["run", "--devices", "2"]) == 2


def test_calibrate_writes_a_cluster_file(tmp_path):
    from shardplan.cluster import load_cluster
    from shardplan.execute.probes import JITTER_HORIZONS

    out = tmp_path / "here.yaml"
    proc = subprocess.run([sys.executable, "-m", "shardplan.report.cli", "calibrate", "--devices", "2",
                           "--reps", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cluster = load_cluster(str(out))
    assert cluster.device.peak_flops > 1e8  # any CPU does more than 0.1 GFLOP/s
    assert cluster.device.memory_bandwidth > 1e8
    assert cluster.levels[0].fanout == 2
    assert cluster.levels[0].bandwidth > 0 and cluster.levels[0].latency >= 0
    assert cluster.device.sync_stretch >= 0 and cluster.device.sync_jitter >= 0
    # sharded ops' dispatch: op_overhead times the paired ratio of the probes' residuals
    assert cluster.device.split_op_overhead is not None and cluster.device.split_op_overhead > 0
    assert cluster.device.pool_bandwidth > 0
    assert 0 < cluster.device.redistribute_overhead < 0.1  # a DTensor Replicate -> Shard: host work only
    assert cluster.device.all_to_all_by_gather  # a CPU mesh: DTensor's all-to-all is a gather and a cut
    assert 0.2 <= cluster.device.efficiency <= 1.0  # the profiled products' efficiency, clamped to the grid
    # the probe's memory-bound kernels, profiled in its step, never beat a copy
    assert 0 < cluster.device.elementwise_bandwidth <= cluster.device.memory_bandwidth
    # the runtime's all-gather, fitted apart from its all-reduce
    assert cluster.levels[0].gather_bandwidth > 0 and cluster.levels[0].gather_latency > 0
    # and the all-to-all the runtime issues itself (execute.experts' token dispatch)
    assert cluster.levels[0].all_to_all_bandwidth > 0 and cluster.levels[0].all_to_all_latency > 0
    # the convolution curves: the reference point (K = 576, M = 2048) is 1 by definition
    assert [k for k, _ in cluster.device.conv_reduction_efficiency] == [27.0, 144.0, 576.0]
    assert [m for m, _ in cluster.device.conv_rows_efficiency] == [128.0, 512.0, 2048.0, 8192.0]
    assert dict(cluster.device.conv_reduction_efficiency)[576.0] == 1.0 == dict(cluster.device.conv_rows_efficiency)[2048.0]
    # the raw measurements in the file's comments keep every round of the typical-step probes
    raw = yaml.safe_load("\n".join(line[4:] for line in out.read_text().splitlines() if line.startswith("#   ")))
    for probe in ("tensor_parallel_probe_step_seconds", "replicated_probe_step_seconds"):
        assert len(raw[probe]["rounds_ms"]) == 24  # three blocks of 4 x --reps rounds
        assert min(raw[probe]["rounds_ms"]) == pytest.approx(1e3 * raw[probe]["best"], abs=1e-3)
    # the replicated probe's wait at its step's end, and the horizon it implies (None: beyond the step)
    end = raw["replicated_probe_end_wait"]
    assert 0 <= end["seconds"] < end["step_seconds"]
    # the horizon is the one of probes.JITTER_HORIZONS that prices that wait; the microbenchmark's is kept
    assert cluster.device.sync_jitter_horizon in JITTER_HORIZONS
    assert raw["sync_jitter_horizon_microbenchmark"] in JITTER_HORIZONS
    assert cluster.device.sync_jitter_exponent == 0.5  # the square root
    # the exponent law with no horizon, kept in the comments: it prices the same end wait unless that
    # lies outside what exponents 0 to 1 allow
    fit = raw["sync_jitter_exponent_fit"]
    assert 0 <= fit["exponent"] <= 1 and fit["sync_jitter"] >= 0
    if 0 < fit["exponent"] < 1:
        assert fit["sync_jitter"] * end["step_seconds"] ** fit["exponent"] == pytest.approx(end["seconds"], rel=1e-3)


def test_product_efficiency_by_hand():
    """A probe modelled as ``G / e + R`` (products G = 0.3 s at the microbenchmarks' rates, the rest
    R = 0.05 s) whose products were profiled at 0.5 s runs them at efficiency 0.6; the result stays
    within the fit's 0.2-1 grid, and with the efficiency given only the dispatch cost is fitted."""
    from shardplan.execute.probes import fit_efficiency, product_efficiency

    def modelled(e):
        return 0.3 / e + 0.05

    assert product_efficiency(0.5, modelled) == pytest.approx(0.6)
    assert product_efficiency(0.1, modelled) == 1.0 and product_efficiency(10.0, modelled) == 0.2
    # two probes: 1000 and 100 dispatch units at 1e-4 s each on top of their modelled seconds at e = 0.6
    probes = [(0.3 / 0.6 + 0.05 + 0.1, 1000), (0.03 / 0.6 + 0.005 + 0.01, 100)]
    e, overhead = fit_efficiency(probes, lambda e: [0.3 / e + 0.05, 0.03 / e + 0.005], grid=[0.6])
    assert e == 0.6 and overhead == pytest.approx(1e-4)


def test_step_bandwidth_by_hand():
    """A probe modelled as 0.01 s plus 2 MB at the bandwidth ``b`` whose memory-bound kernels were
    profiled at 1 ms moves those bytes at 2 GB/s; a copy's rate caps it, and no profiled time or no
    modelled bytes leave the copy's rate."""
    from shardplan.execute.probes import step_bandwidth

    def modelled(b):
        return 0.01 + 2e6 / b

    assert step_bandwidth(1e-3, modelled, 40e9) == pytest.approx(2e9)
    assert step_bandwidth(1e-6, modelled, 40e9) == 40e9
    assert step_bandwidth(0.0, modelled, 40e9) == 40e9
    assert step_bandwidth(1e-3, lambda b: 0.01, 40e9) == 40e9


def test_probe_kernel_seconds_splits_products_from_memory_kernels():
    """Under the profiler a step of one large product and a few elementwise ops on small tensors
    spends most of its kernel time in the product; a step of views only has no memory-bound
    kernel time, and a step of elementwise ops on a large tensor has no product time."""
    import torch

    from shardplan.execute.probes import probe_kernel_seconds

    a, b = torch.randn(384, 384), torch.randn(384, 384)
    small = torch.randn(64)
    big = torch.randn(1 << 20)

    def products():
        torch.mm(a, b)
        (small * 2 + 1).relu()

    gemm, memory = probe_kernel_seconds(products, rounds=2, steps=2)
    assert gemm > 0 and memory > 0 and gemm > memory
    gemm, memory = probe_kernel_seconds(lambda: a.view(-1).t().reshape(384, 384).transpose(0, 1), rounds=1)
    assert gemm == 0 and memory == 0
    gemm, memory = probe_kernel_seconds(lambda: (big * 2).add_(1), rounds=1)
    assert gemm == 0 and memory > 0


def test_fit_sync_jitter_recovers_the_jitter_a_step_was_priced_at():
    """A two-layer MLP, tensor parallel on 4 devices of a toy cluster: a step priced at a jitter of
    0.013 s^0.5 fits back to 0.013 from a cluster with any other jitter; a step faster than the plan
    without waits fits to 0."""
    import dataclasses

    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.step import step_seconds
    from shardplan.cost.tables import build_tables
    from shardplan.execute.launch import RUN_OPTIMIZER
    from shardplan.execute.plans import tensor_parallel
    from shardplan.cluster import get_cluster
    from shardplan.execute.probes import fit_sync_jitter
    from shardplan.ir.builder import GraphBuilder

    b = GraphBuilder("mlp")
    x = b.input("x", (64, 512), ("batch", "features"))
    b.linear(b.linear(x, 2048, name="mlp.up_proj"), 512, name="mlp.down_proj")
    graph = b.build()
    base = get_cluster("dgx-a100", devices=4)
    priced = dataclasses.replace(base, device=dataclasses.replace(base.device, sync_jitter=0.013, sync_stretch=0.2))
    model = AnalyticCostModel(priced, optimizer=RUN_OPTIMIZER)
    tables = build_tables(graph, model, 4)
    seconds = step_seconds(model, tables, tensor_parallel(tables))
    other = dataclasses.replace(priced, device=dataclasses.replace(priced.device, sync_jitter=0.5))
    assert fit_sync_jitter(seconds, graph, other, 4, tensor_parallel) == pytest.approx(0.013, rel=1e-9)
    assert fit_sync_jitter(seconds / 10, graph, other, 4, tensor_parallel) == 0.0


def test_paired_times_and_the_typical_step():
    """Two steps of 2 and 6 ms taken round-robin on 2 threaded ranks: each one's best and median come
    back in order; the typical step is the mean of the rounds' ratios times the replicated step the
    rates were fitted to, by hand (a slow round slows both of its steps and cancels)."""
    import statistics
    import time

    from shardplan.execute.probes import paired_times, round_times, typical_step
    from shardplan.execute.threaded import run_threaded

    per_rank = run_threaded(2, lambda rank: paired_times([lambda: time.sleep(0.002), lambda: time.sleep(0.006)],
                                                         rounds=5))
    for (short_best, short_median), (long_best, long_median) in per_rank:
        assert 0.002 <= short_best <= short_median < long_best <= long_median
    assert per_rank[0] == per_rank[1]  # the slowest rank's time, the same on every rank
    tp, rep = [0.100, 0.250, 0.130, 0.120], [0.080, 0.200, 0.090, 0.100]  # round 2: both steps slowed
    # ratios 1.25 1.25 1.44 1.2 (round 2's 2.5x slowdown cancelled), anchored at the replicated step the
    # rates were fitted to (0.085 s)
    assert typical_step(tp, rep, 0.085) == pytest.approx((1.25 + 1.25 + 0.13 / 0.09 + 1.2) / 4 * 0.085)
    assert statistics.median(tp) / statistics.median(rep) * 0.085 > 1.3 * 0.085  # session 19's ratio of medians
    with pytest.raises(ValueError, match="3 tensor-parallel and 4 replicated rounds"):
        typical_step(tp[:3], rep, 0.085)
    rounds = run_threaded(2, lambda rank: round_times([lambda: time.sleep(0.002), lambda: time.sleep(0.006)],
                                                      rounds=3))[0]
    assert [len(t) for t in rounds] == [3, 3]
    assert max(rounds[0]) < min(rounds[1])  # per step, in round order


def test_jitter_law_finds_the_horizon_the_waits_stop_growing_at():
    """Waits of 0.01 sqrt(T) up to 16 ms and flat beyond fit a horizon of 16 ms; waits that keep
    growing as the square root fit none; the horizon caps the walk's waits (``jitter_waits``)."""
    from shardplan.cost.step import jitter_waits
    from shardplan.execute.probes import jitter_law

    ts = (1e-3, 4e-3, 16e-3, 64e-3)
    capped = [(t, 0.01 * math.sqrt(min(t, 16e-3))) for t in ts]
    j, horizon = jitter_law(capped)
    assert j == pytest.approx(0.01) and horizon == 16e-3
    j, horizon = jitter_law([(t, 0.01 * math.sqrt(t)) for t in ts])
    assert j == pytest.approx(0.01) and horizon is None
    # one op of 100 ms forward and 100 ms backward, no collective: only the end of the step waits
    args = dict(fwd=[0.1], bwd=[0.1], fwd_sync=[False], bwd_sync=[False], moved=[False], reduces=False,
                after_backward=0.0)
    assert jitter_waits(0.01, **args)[("end", -1)] == pytest.approx(0.01 * math.sqrt(0.2))
    assert jitter_waits(0.01, **args, horizon=0.016)[("end", -1)] == pytest.approx(0.01 * math.sqrt(0.016))


def test_network_fit_recovers_the_rates_that_made_the_times():
    """Collective times made from known rates on 4 ranks (all-reduce, all-gather and all-to-all of
    1 KB and 16 MB, as ``calibrate`` measures them) give those rates back from ``_network_fit``: the
    latency from the small message (its time made of latency alone here, as the fit reads it) and
    the bandwidth from the large one."""
    from shardplan.execute.calibrate import LARGE_MESSAGE, _network_fit

    p, large = 4, LARGE_MESSAGE * 4.0
    rates = {"reduce": (2e-4, 1.5e9), "gather": (4e-4, 1e9), "a2a": (1e-4, 2e9)}

    def reduce(n):
        a, b = rates["reduce"]
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n / b

    def one_way(kind, n):
        a, b = rates[kind]
        return (p - 1) * a + (p - 1) / p * n / b
    times = [0.0, 0.0, 2 * (p - 1) * rates["reduce"][0], reduce(large), (p - 1) * rates["gather"][0],
             one_way("gather", large), (p - 1) * rates["a2a"][0], one_way("a2a", large)]
    got = _network_fit(times, p)
    want = rates["reduce"] + rates["gather"] + rates["a2a"]
    assert got == pytest.approx(want, rel=1e-9)


def test_conv_curves_by_hand():
    """Rates of the calibrated convolutions (FLOP/s by in channels, batch, map side, input gradient)
    give the reference rate and each curve as rates over its own reference point: by im2col
    K = in channels x 9 without input gradients, by M = batch x side^2 with them."""
    from shardplan.execute.calibrate import CONV_SHAPES, conv_curves

    rates = dict(zip(CONV_SHAPES, [2e9, 6e9, 8e9, 10e9, 11e9, 8e9, 6e9]))
    ref, reduction, rows = conv_curves(rates)
    assert ref == 10e9
    assert reduction == [[27.0, 0.25], [144.0, 0.75], [576.0, 1.0]]  # over the first-layer reference (8e9)
    assert rows == [[128.0, 0.6], [512.0, 0.8], [2048.0, 1.0], [8192.0, 1.1]]


@pytest.mark.parametrize("efficiency, overhead", [(0.64, 2e-5), (1.0, 5e-6), (0.35, 0.0)])
def test_fit_efficiency_recovers_the_rates_that_made_the_steps(efficiency, overhead):
    """Two probes, one dispatch-bound and one compute-bound, timed as the model says a device of
    the given compute efficiency and dispatch cost would run them: the fit gives both back. Each
    probe's model: GEMM seconds at full rate over the efficiency, or its memory traffic when that is
    longer (the roofline), plus fixed traffic."""
    from shardplan.execute.probes import fit_efficiency

    probes = [(4e-3, 1e-3, 1.5e-3, 700.0), (40e-3, 2e-3, 4e-3, 900.0)]  # gemm s, roofline floor s, fixed s, units

    def modelled(e):
        return [max(g / e, floor) + fixed for g, floor, fixed, _ in probes]

    steps = [(m + u * overhead, u) for m, (_, _, _, u) in zip(modelled(efficiency), probes)]
    e, o = fit_efficiency(steps, modelled)
    assert e == pytest.approx(efficiency, abs=1e-9)
    assert o == pytest.approx(overhead, rel=1e-6, abs=1e-12)


def _pipeline_plan(tmp_path, model, config, p, chunks, schedule, t=1, batch=4):
    from shardplan.capture import capture
    from shardplan.capture.models import build
    from shardplan.cluster.presets import get_cluster
    from shardplan.plan import PipelinePlan
    from shardplan.search.pipeline import price_fixed

    module, kwargs = build(model, batch=batch, seq=16, **config)
    graph = capture(module, (), kwargs, name=model)
    c = get_cluster("dgx-a100", nodes=1)
    r = price_fixed(graph, c, t, 1, p, micro_batch=1, recompute="none", schedule=schedule, chunks=chunks)
    path = tmp_path / f"{model}-pipeline.json"
    path.write_text(PipelinePlan.from_result(r, cluster=c.name).to_json())
    return path


def test_run_interleaved_pipeline_plan_file_matches_single_device(tmp_path):
    """A pipeline plan file (2 ranks x 2 chunks, interleaved 1F1B, 4 microbatches) runs under torchrun
    and equals the single-device loss and gradients."""
    path = _pipeline_plan(tmp_path, "llama", {"num_hidden_layers": 4}, p=2, chunks=2, schedule="interleaved")
    proc = subprocess.run([sys.executable, "-m", "shardplan.report.cli", "run", "--model", "llama", "--hf-config",
                           "num_hidden_layers=4", "--devices", "2", "--steps", "2", "--plan", str(path), "--check",
                           "--json", "-"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kind"] == "pipeline" and out["chunks"] == 2 and out["schedule"] == "interleaved"
    assert [s["layers"] for s in out["plan"]] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert out["check"]["passed"] is True and out["check"]["max_rel_diff"] <= 1e-5
    assert out["measured_step_seconds"] > 0 and out["predicted_step_seconds"] > 0


def test_pipeline_plan_refusals_before_launch(tmp_path, capsys):
    path = _pipeline_plan(tmp_path, "gpt2", {}, p=2, chunks=1, schedule="1f1b")
    assert main(["run", "--model", "gpt2", "--devices", "4", "--plan", str(path)]) == 2
    assert "for 2 devices, not 4" in capsys.readouterr().err
    assert main(["run", "--model", "llama", "--devices", "2", "--plan", str(path)]) == 2
    assert "pipeline plan for 'gpt2', not 'llama'" in capsys.readouterr().err
    tp = _pipeline_plan(tmp_path, "gpt2", {}, p=2, chunks=1, schedule="1f1b", t=2)
    assert main(["run", "--model", "gpt2", "--devices", "4", "--plan", str(tp)]) == 2
    assert "not supported for gpt2 blocks" in capsys.readouterr().err


CHURN = """
import resource, numpy as np
def churn():  # a training step's worth of large buffers, allocated and freed 20 times
    for _ in range(20):
        keep = [np.ones(n) for n in (300_000, 2_000_000, 700_000, 1_500_000, 50_000, 3_000_000)]
        del keep
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tunables")
def test_ranks_keep_freed_memory_instead_of_faulting_it_in_every_step():
    """The ranks' environment keeps freed buffers in the heap: re-allocating a step's buffers faults no
    pages in, where glibc's defaults fault thousands; a user's own settings win."""
    from shardplan.execute.launch import MALLOC_TUNABLES, worker_env

    env = worker_env({"PATH": "/usr/bin"})
    assert env["GLIBC_TUNABLES"] == MALLOC_TUNABLES and env["OMP_NUM_THREADS"] == "1"
    mine = worker_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1", "OMP_NUM_THREADS": "2"})
    assert mine["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=1" and mine["OMP_NUM_THREADS"] == "2"

    def faults(env):
        out = subprocess.run([sys.executable, "-c", CHURN], env=env, capture_output=True, text=True, check=True)
        return int(out.stdout)

    plain = faults({**os.environ, "GLIBC_TUNABLES": ""})
    kept = faults(worker_env({k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}))
    assert plain > 1000 and kept < plain / 100, (plain, kept)


def test_the_check_sees_a_wrong_gradient_a_wrong_loss_and_a_missing_one():
    """``--check``'s measure (``execute.worker.rel_diff``): 0 for the reference's own gradients (and
    for differences under 1e-6 of the largest), the relative error of one entry changed by 1%, of a
    loss off by 1e-3, and infinity for a gradient the run did not produce."""
    import torch

    from shardplan.execute.worker import rel_diff

    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    ref(torch.randn(5, 4)).pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    assert rel_diff(grads, ref, 2.0, 2.0) == 0.0
    scale = float(ref.weight.grad.abs().max())
    tiny = dict(grads, weight=grads["weight"] + 1e-7 * scale)
    assert rel_diff(tiny, ref, 2.0, 2.0) == 0.0
    wrong = dict(grads, weight=grads["weight"].clone())
    i = int(ref.weight.grad.abs().argmax())
    wrong["weight"].view(-1)[i] *= 1.01
    assert rel_diff(wrong, ref, 2.0, 2.0) == pytest.approx(0.01 - 1e-6, rel=1e-3)
    assert rel_diff(grads, ref, 2.002, 2.0) == pytest.approx(1e-3)
    assert rel_diff({"weight": grads["weight"]}, ref, 2.0, 2.0) == float("inf")
    assert rel_diff({"weight": grads["weight"]}, ref, 2.0, 2.0, every=False) == 0.0


def test_every_rank_s_time_and_the_wait_at_a_step_s_end():
    """Rank 1 sleeps 6 ms longer than rank 0 in each of 3 rounds: every rank's time comes back in rank
    order, the slowest is ``slowest_rank_seconds``'s, and the wait at the step's end (max - mean over
    the ranks) is half the difference, by hand."""
    import statistics
    import time

    from shardplan.execute.probes import end_wait, round_rank_times, round_times, slowest_rank_seconds
    from shardplan.execute.threaded import run_threaded

    def steps(rank):
        import torch.distributed as dist

        return [lambda: time.sleep(0.002 + 0.006 * dist.get_rank())]

    per_rank = run_threaded(2, lambda rank: (round_rank_times(steps(rank), rounds=3), round_times(steps(rank), 2),
                                             slowest_rank_seconds(steps(rank)[0])))
    ranks, slowest, one = per_rank[0]
    assert per_rank[1][0] == ranks  # every rank gets every rank's times
    assert len(ranks[0]) == 3 and all(len(r) == 2 for r in ranks[0])
    assert all(0.002 <= r[0] < r[1] and r[1] >= 0.008 for r in ranks[0])
    assert all(t >= 0.008 for t in slowest[0]) and one >= 0.008
    assert end_wait(ranks[0]) == pytest.approx(statistics.mean((r[1] - r[0]) / 2 for r in ranks[0]))
    assert 0.002 <= end_wait(ranks[0]) <= 0.006


def test_the_exponent_prices_the_probe_and_a_whole_step_s_end_wait():
    """A probe with 15 sync points after 2 to 6 ms of compute each, priced at a law of 0.004 s^0.9 x
    T^0.1 (its typical step 20 ms over the rest of the model's price, about what the calibration's
    tensor-parallel probe shows): ``fit(a)`` is the jitter that prices the probe's excess at exponent
    ``a``, and the end wait of an 80 ms step priced at the same law brings back exponent 0.1 and
    jitter 0.004. An end wait under what exponent 0 prices gives 0 (a wait per sync point), one over
    what 1 prices gives 1; a probe with nothing to fit gives the default exponent and no jitter."""
    from shardplan.execute.probes import exponent_from_end_wait

    segments = [0.002 + 0.004 * i / 14 for i in range(15)]
    excess = 0.004 * sum(t ** 0.1 for t in segments)
    fit = lambda a: excess / sum(t ** a for t in segments)
    a, j = exponent_from_end_wait(0.004 * 0.08 ** 0.1, 0.08, fit)
    assert a == pytest.approx(0.1, abs=1e-5) and j == pytest.approx(0.004, rel=1e-4)
    assert exponent_from_end_wait(1e-5, 0.08, fit) == (0.0, pytest.approx(excess / 15))
    assert exponent_from_end_wait(1.0, 0.08, fit) == (1.0, fit(1.0))
    assert exponent_from_end_wait(0.001, 0.08, lambda a: 0.0) == (0.5, 0.0)


def test_the_horizon_prices_a_whole_step_s_end_wait():
    """A jitter of 0.02 s^0.5 at every horizon: a wait of 0.02 sqrt(8 ms) after a 100 ms step picks the
    8 ms horizon, a wait as long as the square root of the whole step picks none, a tiny one the
    shortest; where the refitted jitter grows as the horizon shrinks (the probe's segments capped),
    the pair that prices the wait is returned, by hand."""
    import math

    from shardplan.execute.probes import JITTER_HORIZONS, horizon_from_end_wait

    assert horizon_from_end_wait(0.02 * math.sqrt(0.008), 0.1, lambda h: 0.02) == (0.008, 0.02)
    assert horizon_from_end_wait(0.02 * math.sqrt(0.1), 0.1, lambda h: 0.02) == (None, 0.02)
    assert horizon_from_end_wait(1e-6, 0.1, lambda h: 0.02) == (min(h for h in JITTER_HORIZONS if h), 0.02)
    # j(h) = 0.001 / sqrt(h) below 16 ms: every short horizon prices 1 ms; a 1 ms wait takes the earliest
    growing = lambda h: 0.001 / math.sqrt(h) if h is not None and h < 0.016 else 0.001 / math.sqrt(0.016)
    h, j = horizon_from_end_wait(0.001, 0.1, growing)
    assert h == 0.004 and j * math.sqrt(h) == pytest.approx(0.001)
