"""The pipeline planner on small GPTs: plans fit, beat or equal fixed configurations, errors name the memory."""

import pytest

from shardplan.cluster.presets import get_cluster
from shardplan.search.pipeline import PipelineDoesNotFit, layer_chain, plan_pipeline, price_fixed
from shardplan.search.solve import PlanDoesNotFit
from shardplan.zoo.models import gpt


def small():
    return gpt(layers=4, hidden=256, heads=4, seq=128, batch=16)


def test_layer_chain_of_gpt():
    pre, layers, post = layer_chain(small())
    assert len(layers) == 4 and all(len(ops) == 12 for ops in layers)
    assert len(pre) == 3 and len(post) == 3


def test_plan_fits_and_beats_fixed_configs():
    g, c = small(), get_cluster("dgx-a100", nodes=1)
    plan = plan_pipeline(g, c)
    assert plan.peak_memory_bytes <= c.device.memory_bytes
    assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == 3
    for t, d, p in ((1, 8, 1), (2, 2, 2), (1, 2, 4), (8, 1, 1)):
        fixed = price_fixed(g, c, t, d, p, micro_batch=1, recompute="none")
        assert plan.iteration_seconds <= fixed.iteration_seconds * (1 + 1e-9)


def test_tight_memory_forces_stages_and_nothing_fits_names_memory():
    g, c = small(), get_cluster("dgx-a100", nodes=1)
    with pytest.raises(PlanDoesNotFit, match=r"needs [0-9.]+ GiB per device") as info:
        plan_pipeline(g, c, memory_limit_bytes=1e3)
    assert isinstance(info.value, PipelineDoesNotFit)


def test_chain_without_embeddings():
    from shardplan.zoo.models import mlp

    g = mlp(batch=32)  # fc1..fc3 are layers 0..2, no ops before them
    pre, layers, post = layer_chain(g)
    assert pre == [] and len(layers) == 3 and len(post) == 2
    plan = plan_pipeline(g, get_cluster("dgx-a100", nodes=1))
    assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == 2


def test_pipeline_plan_json_round_trip():
    from shardplan.plan import PipelinePlan, PlanError

    g, c = small(), get_cluster("dgx-a100", nodes=1)
    plan = PipelinePlan.from_result(plan_pipeline(g, c), cluster=c.name, baselines={"megatron": 1.0})
    back = PipelinePlan.from_json(plan.to_json())
    assert back == plan and back.baselines == {"megatron": 1.0}
    raw = plan.to_dict()
    del raw["stages"][0]["zero"]
    with pytest.raises(PlanError, match="'zero'"):
        PipelinePlan.from_dict(raw)
