"""CLI: JSON output and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from shardplan.report.cli import main


def test_plan_json(capsys):
    assert main(["plan", "--model", "alexnet", "--devices", "4", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("model", "devices", "cost_model", "cost", "search_seconds", "layers", "baselines"):
        assert key in out
    assert out["cost"] == pytest.approx(148215719552, rel=1e-12)
    assert out["cost"] <= out["baselines"]["data_parallel"]


@pytest.mark.parametrize("args,culprit", [
    (["--model", "nope", "--devices", "4"], "nope"),
    (["--model", "alexnet", "--devices", "0"], "--devices"),
    (["--model", "alexnet", "--devices", "-3"], "--devices"),
    (["--model", "alexnet", "--devices", "4", "--batch", "0"], "batch"),
    (["--model", "alexnet", "--devices", "4", "--cost-model", "magic"], "magic"),
])
def test_bad_input(args, culprit):
    proc = subprocess.run([sys.executable, "-m", "shardplan.report.cli", "plan", *args],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and culprit in lines[0]
