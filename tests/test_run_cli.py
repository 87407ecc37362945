"""``shardplan run``: one real torchrun launch (gloo, 2 ranks) and the refusals made before any launch."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from shardplan.report.cli import main  # noqa: E402


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


def test_plan_of_another_model_is_refused_before_launch(tmp_path, capsys):
    plan = tmp_path / "mlp.json"
    assert main(["plan", "--model", "mlp", "--devices", "2", "--json", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", "--model", "llama", "--devices", "2", "--plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "plan is for model 'mlp'" in err and "'llama'" in err


def test_unknown_or_unrunnable_model_is_refused(capsys):
    assert main(["run", "--model", "lstm_lm", "--devices", "2"]) == 2
    assert "lstm_lm" in capsys.readouterr().err
    assert main(["run", "--devices", "2"]) == 2


def test_calibrate_writes_a_cluster_file(tmp_path):
    from shardplan.cluster import load_cluster

    out = tmp_path / "here.yaml"
    proc = subprocess.run([sys.executable, "-m", "shardplan.report.cli", "calibrate", "--devices", "2",
                           "--reps", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cluster = load_cluster(str(out))
    assert cluster.device.peak_flops > 1e8  # any CPU does more than 0.1 GFLOP/s
    assert cluster.device.memory_bandwidth > 1e8
    assert cluster.levels[0].fanout == 2
    assert cluster.levels[0].bandwidth > 0 and cluster.levels[0].latency >= 0
