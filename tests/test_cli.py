"""CLI: JSON output, plan files, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from shardplan.plan import Plan
from shardplan.report.cli import main


def run_json(capsys, *args):
    assert main(["plan", *args, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_pase(capsys):
    out = run_json(capsys, "--model", "alexnet", "--devices", "4", "--cost-model", "pase")
    for key in ("model", "devices", "cost_model", "cost", "search_seconds", "layers", "baselines"):
        assert key in out
    assert out["cost"] == pytest.approx(148215719552, rel=1e-12)  # PaSE's reference optimum
    assert out["optimal"] is True
    assert all(out["cost"] <= cost for cost in out["baselines"].values())
    assert set(out["baselines"]) == {"data_parallel", "owt"}


def test_plan_json_analytic_default(capsys):
    out = run_json(capsys, "--model", "transformer", "--devices", "8")
    assert out["cost_model"] == "analytic" and out["unit"] == "seconds" and out["cluster"] == "dgx-a100"
    assert 0 < out["cost"] < 1.0
    assert set(out["baselines"]) == {"data_parallel", "megatron"}
    assert all(out["cost"] <= cost * (1 + 1e-12) for cost in out["baselines"].values())
    assert out["peak_memory_bytes"] <= out["memory_limit_bytes"]


def test_plan_with_a_jittery_cluster_prints_the_predicted_step(capsys, tmp_path):
    """A cluster file with ``sync_jitter`` adds ``predicted_step_seconds`` (``cost.step.step_seconds``:
    the cost with the plan's jitter waits in place of the per-op stretch) to ``plan``'s output; one
    without it does not. With it the plan is also polished on that prediction (``search.polish``):
    its per-op cost may rise above the exact optimum's, its predicted step may not."""
    import yaml

    from shardplan.cluster import get_cluster
    from shardplan.cluster.presets import cluster_to_dict

    raw = cluster_to_dict(get_cluster("dgx-a100", devices=8))
    plain = run_json(capsys, "--model", "mlp", "--devices", "8", "--batch", "64")
    assert "predicted_step_seconds" not in plain
    raw["device"]["sync_jitter"] = 0.01
    path = tmp_path / "jittery.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = run_json(capsys, "--model", "mlp", "--devices", "8", "--batch", "64", "--cluster", str(path))
    # the search is polished on the predicted step: never below the per-op sum's exact optimum, and
    # never predicted slower than that optimum's plan
    from shardplan.cluster import load_cluster
    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.step import step_seconds
    from shardplan.cost.tables import build_tables
    from shardplan.zoo import build_model

    model = AnalyticCostModel(load_cluster(str(path)))
    tables = build_tables(build_model("mlp", batch=64), model, 8)
    exact_step = step_seconds(model, tables, Plan.from_dict(plain).to_choice(tables))
    assert out["cost"] >= plain["cost"] * (1 - 1e-12)
    assert out["predicted_step_seconds"] <= exact_step * (1 + 1e-12)
    assert out["predicted_step_seconds"] == pytest.approx(
        step_seconds(model, tables, Plan.from_dict(out).to_choice(tables)), rel=1e-12)
    if out["cost"] > plain["cost"] * (1 + 1e-12):
        assert out["method"] == "exact + polish" and f"{exact_step:.6g} s" in out["note"]


def test_nodes_scale_the_cluster(capsys):
    out = run_json(capsys, "--model", "mlp", "--cluster", "dgx-h100", "--nodes", "2")
    assert out["devices"] == 16 and out["cluster"] == "dgx-h100"


def test_size(capsys):
    out = run_json(capsys, "--model", "gpt", "--size", "125m", "--devices", "8", "--batch", "8")
    assert out["model"].startswith("gpt")


def test_plan_file_round_trip(tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "alexnet", "--devices", "4", "--json", str(path)]) == 0
    plan = Plan.load(str(path))
    assert plan.model == "alexnet" and plan.devices == 4 and len(plan.ops) == 14


def test_time_limit_returns_a_plan(capsys):
    out = run_json(capsys, "--model", "transformer", "--devices", "64", "--time-limit", "0.01")
    assert out["optimal"] is False and "not proven optimal" in out["note"]
    assert out["cost"] <= min(out["baselines"].values()) * (1 + 1e-12)


def test_clusters_and_models(capsys):
    assert main(["clusters"]) == 0
    text = capsys.readouterr().out
    for name in ("pase-1080ti", "pase-2080ti", "dgx-a100", "dgx-h100"):
        assert name in text
    assert main(["models"]) == 0
    assert "gpt" in capsys.readouterr().out


@pytest.mark.parametrize("args,culprit", [
    (["--model", "nope", "--devices", "4"], "nope"),
    (["--model", "alexnet", "--devices", "0"], "--devices"),
    (["--model", "alexnet", "--devices", "-3"], "--devices"),
    (["--model", "alexnet", "--devices", "4", "--batch", "0"], "batch"),
    (["--model", "alexnet", "--devices", "4", "--cost-model", "magic"], "magic"),
    (["--model", "alexnet", "--devices", "4", "--cluster", "dgx-z100"], "dgx-z100"),
    (["--model", "alexnet", "--devices", "4", "--cluster", "missing.yaml"], "missing.yaml"),
    (["--model", "alexnet", "--devices", "4", "--nodes", "0"], "--nodes"),
    (["--model", "alexnet", "--devices", "64", "--cluster", "dgx-a100", "--nodes", "2"], "64 devices"),
    (["--model", "alexnet", "--devices", "4", "--size", "7b"], "alexnet"),
    (["--model", "gpt", "--size", "7b", "--devices", "4"], "7b"),
    (["--model", "gpt", "--size", "1.3b", "--devices", "8", "--memory-limit", "1"], "short by"),
])
def test_bad_input(args, culprit):
    proc = subprocess.run([sys.executable, "-m", "shardplan.report.cli", "plan", *args],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and culprit in lines[0], lines


@pytest.mark.parametrize("command,flag", [(["calibrate", "--devices", "2"], "--out"),
                                          (["plan", "--model", "mlp", "--devices", "2"], "--json"),
                                          (["simulate", "--plan", "p.json"], "--trace")])
def test_an_output_file_in_a_missing_folder_is_refused_before_any_work(tmp_path, capsys, command, flag):
    """``calibrate`` measures for a minute before it writes: a folder that does not exist (or a folder
    given as the file) is refused up front, naming the flag, not after the work with torchrun's
    traceback (this refusal comes back at once, so calibrate never launched)."""
    import time

    missing = tmp_path / "no" / "such" / "file.out"
    t0 = time.perf_counter()
    assert main([*command, flag, str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "does not exist" in err[0], err
    assert main([*command, flag, str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a directory" in err[0], err
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("text,culprit", [
    ("device: {peak_flops: 1e12, memory_bytes: 8e9}\nlevels: [{fanout: 4, bandwidth: 1e10}]", "memory_bandwidth"),
    ("device: {peak_flops: 1e12, memory_bytes: 8e9, memory_bandwidth: 1e11}\nlevels: [{fanout: 4, bandwith: 1e10}]",
     "bandwith"),
    ("device: {peak_flops: fast, memory_bytes: 8e9, memory_bandwidth: 1e11}\nlevels: [{fanout: 4, bandwidth: 1e10}]",
     "peak_flops"),
    ("device: {peak_flops: 1e12, memory_bytes: 8e9, memory_bandwidth: 1e11}\nlevels: [{fanout: 2.5, bandwidth: 1e10}]",
     "fanout"),
    ("device: [1, 2", "not valid YAML"),
])
def test_bad_cluster_file(tmp_path, text, culprit):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "shardplan.report.cli", "plan", "--model", "mlp", "--devices",
                           "4", "--cluster", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and culprit in lines[0], lines


def test_pipeline_flag_json(capsys):
    out = run_json(capsys, "--model", "gpt", "--size", "125m", "--batch", "16", "--nodes", "1", "--pipeline")
    assert out["method"] == "pipeline" and out["devices"] == 8
    for key in ("stages", "num_microbatches", "schedule", "peak_memory_bytes", "bubble_fraction", "baselines"):
        assert key in out
    assert out["peak_memory_bytes"] <= 80e9
    assert out["stages"][0]["layers"][0] == 0 and out["stages"][-1]["layers"][1] == 11
    assert all("mesh_shape" in s and "data_parallel" in s for s in out["stages"])


def test_pipeline_too_small_memory_names_it(capsys):
    assert main(["plan", "--model", "gpt", "--size", "125m", "--batch", "16", "--nodes", "1", "--pipeline",
                 "--memory-limit", "0.001"]) == 2
    assert "GiB per device" in capsys.readouterr().err


def test_pipeline_baselines_include_fsdp_and_never_beat_the_search(capsys):
    """Plain FSDP (ZeRO-3 over all 8 devices) is priced by the same model; the searched plan, whose
    space contains that configuration, is never slower."""
    out = run_json(capsys, "--model", "gpt", "--size", "125m", "--batch", "16", "--nodes", "1", "--pipeline")
    assert "fsdp" in out["baselines"]
    assert out["cost"] <= out["baselines"]["fsdp"] * (1 + 1e-9)
