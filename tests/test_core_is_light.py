"""The planner core imports numpy and no torch: only capture and execute do."""

import subprocess
import sys


def test_core_does_not_import_torch():
    code = ("import sys, shardplan.ir.builder, shardplan.zoo, shardplan.cluster, shardplan.cost.analytic, "
            "shardplan.cost.pase, shardplan.search.solve, shardplan.plan, shardplan.report.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
