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


def test_interleaved_formula_by_hand_and_search_never_worse():
    """Interleaved 1F1B on p ranks x v chunks: T = m max_i D_i + (p - 1) max_j C_j + max_i S_i, checked
    against the chunk times the plan reports; the search (all schedules) is never worse than it."""
    # a small vocabulary, so the layers (not the head) dominate, as in large models
    g, c = gpt(layers=8, hidden=1024, heads=8, seq=512, vocab=512, batch=16), get_cluster("dgx-a100", nodes=1)
    p, v, d = 2, 2, 2
    fixed = price_fixed(g, c, 1, d, p, micro_batch=2, recompute="none", schedule="interleaved", chunks=v)
    m = 16 // (d * 2)
    assert fixed.chunks == v and len(fixed.stages) == p * v and fixed.num_microbatches == m
    assert [s.layers for s in fixed.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    chunk = [s.seconds_per_microbatch for s in fixed.stages]
    per_rank = [chunk[0] + chunk[2], chunk[1] + chunk[3]]
    no_sync = m * max(per_rank) + (p - 1) * max(chunk)
    assert fixed.iteration_seconds >= no_sync * (1 - 1e-12)
    assert fixed.iteration_seconds - no_sync < 0.5 * fixed.iteration_seconds  # the sync term is a small part
    # one chunk per rank with the same layers is plain 1F1B: (m - 1) max T + sum T, never better here
    plain = price_fixed(g, c, 1, d, p, micro_batch=2, recompute="none")
    assert fixed.bubble_fraction < plain.bubble_fraction
    best = plan_pipeline(g, c)
    assert best.iteration_seconds <= min(fixed.iteration_seconds, plain.iteration_seconds) * (1 + 1e-9)
    with pytest.raises(ValueError, match="chunks"):
        price_fixed(g, c, 1, d, p, micro_batch=2, schedule="interleaved", chunks=3)


def test_interleaved_plan_json_keeps_chunks():
    from shardplan.plan import PipelinePlan

    g, c = gpt(layers=8, hidden=256, heads=4, seq=128, batch=16), get_cluster("dgx-a100", nodes=1)
    r = price_fixed(g, c, 1, 2, 2, micro_batch=2, recompute="none", schedule="interleaved", chunks=2)
    plan = PipelinePlan.from_result(r, cluster=c.name)
    back = PipelinePlan.from_json(plan.to_json())
    assert back.chunks == 2 and back.pipeline_ranks == 2 and back == plan


def test_dapple_rule_is_a_restriction_of_the_search():
    from shardplan.search.pipeline import dapple

    g, c = small(), get_cluster("dgx-a100", nodes=1)
    full, rule = plan_pipeline(g, c), dapple(g, c)
    assert all(s.tensor_parallel == 1 and s.zero == 0 and s.recompute == "none" for s in rule.stages)
    assert rule.schedule == "1f1b" and rule.chunks == 1
    assert full.iteration_seconds <= rule.iteration_seconds * (1 + 1e-12)
    with pytest.raises(ValueError, match="unknown schedule"):
        plan_pipeline(g, c, schedules=("zb",))


@pytest.mark.parametrize("micro_batch", [16, 4, 1])
def test_the_optimizer_steps_once_per_iteration_not_per_microbatch(micro_batch):
    """One stage, no data parallelism: the iteration is m x T + S, and the optimizer step is in S
    once. So Adam's price over plain SGD's is, whatever the number m of microbatches, the two moments
    read and written once more per parameter: 4 x the 16-bit parameter bytes at the memory bandwidth
    (both pay the same dispatch per tensor). Each part of the chain (embeddings, layers, head) holds
    the weights it reads: GPT's tied embedding is stepped in the embeddings and in the head, as
    Megatron-LM keeps a copy in the first and the last stage."""
    g, c = small(), get_cluster("dgx-a100", nodes=1)
    adam = price_fixed(g, c, 1, 1, 1, micro_batch=micro_batch, recompute="none")
    sgd = price_fixed(g, c, 1, 1, 1, micro_batch=micro_batch, recompute="none", optimizer="sgd")
    pre, layers, post = layer_chain(g)
    params = sum(g.tensor(name).numel for part in [pre, *layers, post]
                 for name in {o.tensor for i in part for o in g.ops[i].inputs if g.tensor(o.tensor).is_param})
    assert params > sum(t.numel for t in g.tensors if t.is_param)  # the tied embedding, twice
    assert adam.iteration_seconds - sgd.iteration_seconds == pytest.approx(
        4 * 2 * params / c.device.memory_bandwidth, rel=1e-9)


def test_price_pipeline_reprices_a_plan_exactly():
    """Repricing a searched plan (and a fixed interleaved one) on the same cluster gives its own figures."""
    from shardplan.plan import PipelinePlan
    from shardplan.search.pipeline import price_pipeline

    g, c = gpt(layers=8, hidden=1024, heads=8, seq=512, vocab=512, batch=16), get_cluster("dgx-a100", nodes=1)
    for r in (plan_pipeline(g, c, memory_limit_bytes=2e9),
              price_fixed(g, c, 1, 2, 2, micro_batch=2, recompute="none", schedule="interleaved", chunks=2)):
        plan = PipelinePlan.from_result(r, cluster=c.name)
        again = price_pipeline(g, c, plan)
        assert again.iteration_seconds == pytest.approx(r.iteration_seconds, rel=1e-9)
        assert again.peak_memory_bytes == pytest.approx(r.peak_memory_bytes, rel=1e-9)
    bad = PipelinePlan.from_result(r, cluster=c.name)
    bad = PipelinePlan(bad.model, bad.devices, bad.cluster, bad.batch, bad.stages[:-1], bad.num_microbatches,
                       bad.schedule, bad.cost, bad.bubble_fraction, bad.peak_memory_bytes, chunks=bad.chunks)
    with pytest.raises(ValueError, match="do not cover the 8 layers"):
        price_pipeline(g, c, bad)


def test_sub_node_stages_across_nodes_pay_the_inter_node_link():
    """4 stages of 2 GPUs: inside one 8-GPU node every boundary is on NVLink; on 2 nodes of 4 GPUs the
    middle boundary is on InfiniBand, and every boundary is priced there (an upper bound)."""
    import dataclasses

    from shardplan.cluster.model import Level

    g = gpt(layers=8, hidden=1024, heads=8, seq=512, vocab=512, batch=16)
    one = get_cluster("dgx-a100", nodes=1)
    node, ib = one.levels[0], one.levels[-1]
    two = dataclasses.replace(one, levels=(Level(node.name, 4, node.bandwidth, node.latency),
                                           Level(ib.name, 2, ib.bandwidth, ib.latency)))
    fast = price_fixed(g, one, 1, 2, 4, micro_batch=2, recompute="none")
    slow = price_fixed(g, two, 1, 2, 4, micro_batch=2, recompute="none")
    assert slow.iteration_seconds > fast.iteration_seconds
    # the difference is the boundary transfers at IB instead of NVLink speed, nothing else
    assert slow.stages[0].seconds_per_microbatch > fast.stages[0].seconds_per_microbatch
