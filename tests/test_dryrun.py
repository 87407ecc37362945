"""``shardplan run --dry-run``: a plan's step as rank 0 of a fake process group, in fake tensors.

Oracles: the collectives the runtime issues against those the cost model prices (each activation
all-reduce of tensor parallelism is one priced item), and the data-parallel gradient buckets
against the parameters' bytes counted by hand."""

import json

import pytest

torch = pytest.importorskip("torch")

from shardplan.capture import capture  # noqa: E402
from shardplan.capture.models import build  # noqa: E402
from shardplan.cluster import get_cluster  # noqa: E402
from shardplan.cost.analytic import AnalyticCostModel  # noqa: E402
from shardplan.cost.tables import build_tables  # noqa: E402
from shardplan.execute.dryrun import dry_run  # noqa: E402
from shardplan.execute.plans import tensor_parallel  # noqa: E402
from shardplan.plan import Plan  # noqa: E402
from shardplan.report.cli import main  # noqa: E402
from shardplan.search.baselines import data_parallel  # noqa: E402

LLAMA = "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,vocab_size=128"


def _tables(name, config, devices, batch, seq):
    from shardplan.capture.models import parse_config

    with torch.device("meta"):
        module, kwargs = build(name, batch=batch, seq=seq, **parse_config(config))
    graph = capture(module, (), kwargs, name=name)
    model = AnalyticCostModel(get_cluster("dgx-a100", devices=devices))
    return graph, model, build_tables(graph, model, devices)


def test_tensor_parallel_llama_issues_exactly_the_all_reduces_the_model_prices():
    """Megatron's Llama on 2 ranks: every forward partial sum (o_proj, down_proj) and every input
    gradient of a column-split projection (q, k, v, gate, up: DTensor reduces each on its own) is one
    priced all-reduce of one activation; the runtime issues the same number, of the same bytes."""
    graph, model, tables = _tables("llama", LLAMA, 2, 4, 16)
    choice = tensor_parallel(tables)
    priced = []
    for i, op in enumerate(graph.ops):
        for item in model.node_cost_items(graph, op, tables.configs[i][choice[i]:choice[i] + 1]):
            if item.name in ("output_allreduce", "input_grad_allreduce") and item.seconds[0] > 0:
                priced.append(graph.tensor(item.tensor).nbytes)
    assert len(priced) == 2 * 7  # per layer: 2 forward partial sums, 5 input gradients
    run = dry_run("llama", LLAMA, 4, 16, Plan.from_choice(tables, choice))
    seen = sorted(c.nbytes for c in run.collectives if c.kind == "all_reduce" and c.phase != "gradients")
    assert seen == sorted(priced)
    assert all(c.ranks == 2 for c in run.collectives)
    assert run.to_dict()["by_phase"] == {"forward": 2 * 2 + sum(c.kind == "broadcast" for c in run.collectives),
                                         "backward": 2 * 5, "gradients": 0}


def test_data_parallel_on_64_ranks_reduces_every_parameter_once_without_64_processes():
    """A data-parallel plan for 64 ranks, checked in one process: one mesh axis of 64, the bucketed
    gradient all-reduces carry the parameters' bytes exactly (4 per fp32 parameter, counted from
    the module), over groups of 64, after the backward pass."""
    graph, model, tables = _tables("torch_mlp", "", 64, 64, 1)
    plan = Plan.from_choice(tables, data_parallel(tables))
    run = dry_run("torch_mlp", "", 64, 1, plan)
    assert run.mesh == (64,)
    module, _ = build("torch_mlp", batch=64)
    grads = [c for c in run.collectives if c.phase == "gradients"]
    assert grads and all(c.kind == "all_reduce" and c.ranks == 64 for c in grads)
    assert sum(c.nbytes for c in grads) == 4 * sum(p.numel() for p in module.parameters())


def test_cli_dry_run_json_and_refusals(capsys, tmp_path):
    assert main(["run", "--model", "torch_mlp", "--devices", "4", "--batch", "8", "--dry-run", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["devices"] == 4 and out["predicted_step_seconds"] > 0
    assert out["dry_run"]["mesh"] and out["dry_run"]["collectives"]
    assert main(["run", "--model", "torch_mlp", "--dry-run", "--check"]) == 2
    assert "nothing to --check" in capsys.readouterr().err


def test_mixtral_split_over_its_experts_runs_in_fake_tensors():
    """Expert parallelism in a dry run: transformers' routed experts call a grouped product whose
    fake version refuses fp32 (its library fallback is used), and each rank's expert range is read
    from the weight's placements as plain integers; a random plan with every MoE op split over its
    experts applies and steps on a 2x2 mesh."""
    import numpy as np

    graph, model, tables = _tables("mixtral", "", 4, 8, 16)
    rng = np.random.default_rng(2)
    plan = Plan.from_choice(tables, [int(rng.integers(len(c))) for c in tables.configs])
    moe = [dict(op.split)["experts"] for op in plan.ops if op.kind == "moe"]
    assert moe and all(e > 1 for e in moe)
    run = dry_run("mixtral", "", 8, 16, plan)
    assert run.mesh == (2, 2) and run.collectives
