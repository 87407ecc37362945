"""Capture of real PyTorch models into the IR: op counts, FLOPs against torch's FlopCounterMode,
parameter counts against the module, error messages, and that the search plans the result."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from shardplan.capture import CaptureError, capture  # noqa: E402
from shardplan.capture.models import build, load_hf, parse_config  # noqa: E402
from shardplan.cluster import get_cluster  # noqa: E402
from shardplan.cost.analytic import AnalyticCostModel  # noqa: E402
from shardplan.cost.tables import build_tables  # noqa: E402
from shardplan.search.baselines import data_parallel  # noqa: E402
from shardplan.search.solve import solve  # noqa: E402

# model -> {IR kind: count} for the tiny configs of shardplan.capture.models
EXPECTED = {
    "torch_mlp": {"fc": 3},
    "torch_cnn": {"conv": 3, "fc": 2, "elementwise": 1},
    "lstm_lm": {"embedding": 1, "lstm": 1, "fc": 1},
    # wte, wpe; per layer c_attn, 2 attention matmuls, c_proj, c_fc, c_proj; lm_head
    "gpt2": {"embedding": 2, "fc": 2 * 4 + 1, "einsum": 2 * 2},
    # per layer q, k, v, o, gate, up, down; lm_head
    "llama": {"embedding": 1, "fc": 2 * 7 + 1, "einsum": 2 * 2},
    "bert": {"embedding": 3, "fc": 2 * 6 + 2, "einsum": 2 * 2},
}


def _captured(name):
    module, kwargs = build(name)
    module.eval()
    return module, kwargs, capture(module, (), kwargs, name=name)


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    return {name: _captured(name) for name in [*EXPECTED, "mixtral"]}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_op_counts(captured, name):
    graph = captured[name][2]
    counts = {}
    for op in graph.ops:
        counts[op.kind] = counts.get(op.kind, 0) + 1
    for kind, n in EXPECTED[name].items():
        assert counts.get(kind, 0) == n, (name, kind, counts)


@pytest.mark.parametrize("name", [*EXPECTED, "mixtral"])
def test_params_and_flops_match_torch(captured, name):
    module, kwargs, graph = captured[name]
    assert graph.num_params == sum(p.numel() for p in module.parameters())
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        module(**kwargs)
    reference = counter.get_total_flops()
    # torch's counter skips the fused LSTM kernel, elementwise ops and transformers' grouped-GEMM
    # custom op (Mixtral's experts, fused into one moe op per block and checked by hand below);
    # compare like with like
    moe = [op for op in graph.ops if op.kind == "moe"]
    experts = sum(op.attr("grouped_flops") for op in moe)
    pointwise = sum(op.attr("pointwise_flops") for op in moe)
    heavy = sum(op.flops for op in graph.ops if op.kind not in ("elementwise", "lstm")) - experts - pointwise
    assert heavy == pytest.approx(reference, rel=0.01)
    assert graph.forward_flops - experts == pytest.approx(reference, rel=0.05) or name == "lstm_lm"


def test_mixtral_experts_are_contractions_by_hand(captured):
    """Small Mixtral: 4 sequences x 16 tokens, top-2 of 4 experts, hidden 64, expert width 128. Each
    layer's routed-experts block is one moe op; inside it two grouped GEMMs over the 128 routed rows:
    gate+up (64 -> 256) and down (128 -> 64), and the router (64 -> 4) over the 64 tokens."""
    graph = captured["mixtral"][2]
    blocks = [op for op in graph.ops if op.kind == "moe"]
    assert [op.name for op in blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    rows = 4 * 16 * 2
    for op in blocks:
        assert op.attr("grouped_flops") == 2.0 * rows * 64 * 256 + 2.0 * rows * 128 * 64
        assert op.attr("top_k") == 2 and op.attr("ffn") == 128
        assert op.flops >= op.attr("grouped_flops") + 2.0 * 64 * 64 * 4  # plus the router
        assert op.dims[op.dim_index("experts")].splittable and op.dim("experts").size == 4
        # the experts split two ways: tokens gathered (experts) or sent by all-to-all (experts_a2a)
        assert [d.name for d in op.dims if d.splittable] == ["batch", "experts", "experts_a2a"]
        experts = [o for o in op.inputs if o.axes and o.axes[0] == ("experts", "experts_a2a")]
        assert sorted(o.tensor.rsplit(".", 1)[1] for o in experts) == ["down_proj", "gate_up_proj"]
        # both splits together keep whole experts on a device
        assert all(graph.tensor(o.tensor).shape[0] == 4 == graph.tensor(o.tensor).limit(0) for o in experts)
        (x,) = [o for o in op.inputs if not graph.tensor(o.tensor).is_param]
        (out,) = op.outputs
        # each device of an all-to-all group holds its own tokens, whole sequences of them
        assert x.axes[0] == ("batch", "experts_a2a") and graph.tensor(x.tensor).limit(0) == 4
        assert graph.tensor(out.tensor).shape == (4 * 16, 64)
        assert set(out.axes[0]) == {"batch", "experts_a2a", "seq"} and graph.tensor(out.tensor).limit(0) == 4
        # nothing inside the block is left as its own op
        assert not [o for o in graph.ops if o is not op and (o.module or "").startswith(op.name + ".")]


def test_lstm_flops_by_hand(captured):
    graph = captured["lstm_lm"][2]
    op = next(op for op in graph.ops if op.kind == "lstm")
    b, s, h, layers = 4, 16, 64, 2
    assert op.flops == 2.0 * b * s * 4 * h * (h + h) * layers
    assert [d.name for d in op.dims if d.splittable] == ["batch"]


def test_ops_keep_module_names(captured):
    graph = captured["llama"][2]
    assert graph.op("model.layers.0.self_attn.q_proj").module == "model.layers.0.self_attn.q_proj"
    q = graph.op("model.layers.0.self_attn.q_proj")
    assert [o.tensor for o in q.inputs][1] == "model.layers.0.self_attn.q_proj.weight"


def test_heads_link_projection_to_attention(captured):
    """The view (b, l, h*k) -> (b, h, l, k) ties attention heads to q_proj's output features."""
    graph = captured["llama"][2]
    attn = graph.op("model.layers.0.self_attn")
    q_in = attn.inputs[0]
    assert q_in.tensor == "model.layers.0.self_attn.q_proj:out"
    assert q_in.axes[-1][0] == "heads"


def test_residual_adds_are_joins(captured):
    graph = captured["llama"][2]
    joins = [op for op in graph.ops if op.kind == "elementwise"]
    assert len(joins) == 2 * 3  # two residual adds and SwiGLU's product per layer
    assert all(len({i.tensor for i in op.inputs}) >= 2 for op in joins)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_captured_graph_plans(captured, name):
    graph = captured[name][2]
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=4)), 4)
    sol = solve(tables)
    assert sol.optimal
    assert sol.cost <= tables.cost_of(data_parallel(tables)) * (1 + 1e-9)


def test_meta_device_capture_allocates_nothing():
    model, kwargs, _ = load_hf("llama", parse_config("hidden_size=512,num_hidden_layers=2,intermediate_size=1024,"
                                                     "vocab_size=1000"), batch=2, seq=8)
    assert all(p.is_meta for p in model.parameters())
    graph = capture(model, (), kwargs, name="llama")
    assert graph.num_params == sum(p.numel() for p in model.parameters())


def test_unsupported_op_names_module():
    class Volume(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Conv3d(2, 4, 3)

        def forward(self, x):
            return self.body(x)

    with pytest.raises(CaptureError, match="body"):
        capture(Volume(), (torch.randn(1, 2, 5, 5, 5),))


def test_bad_hf_config_names_field():
    with pytest.raises(ValueError, match="hidden_sise"):
        load_hf("llama", {"hidden_sise": 8})
    with pytest.raises(ValueError, match="key=value"):
        parse_config("hidden_size")


def test_view_limits_keep_splits_on_whole_heads():
    """(b, l, h*k) viewed as (b, l, h, k): the features axis may only be split into divisors of h;
    a merge, or a view of an axis that is not a single source axis, sets no limit."""
    from shardplan.capture.axes import view_limits

    ident = ((0,), (1,), (2,))
    assert view_limits("view", ident, (4, 16, 64), (4, 16, 4, 16)) == {2: 4}
    assert view_limits("view", ident, (4, 16, 64), (64, 64)) == {}
    assert view_limits("view", ((0,), (1,)), (64, 192), (4, 16, 192)) == {0: 4}
    assert view_limits("view", ((0,), (0,), ()), (4, 16, 64), (4, 16, 4, 16)) == {}
    assert view_limits("add", ident, (4, 16, 64), (4, 16, 64)) == {}


def test_gpt2_fused_qkv_is_not_tied_to_heads():
    """GPT-2 splits c_attn's output into q, k, v (split(x, n, dim=2)); the part's heads are not c_attn's
    feature blocks, so c_attn's features carry no head limit (only the flattened rows do)."""
    m, kw = build("gpt2")
    g = capture(m, (), kw, name="gpt2")
    spec = g.tensor("transformer.h.0.attn.c_attn:out")
    assert spec.split_limits == (4, 0)


def test_folded_cheap_ops_counted_once_by_hand():
    """torch_cnn, batch 4, 16 channels, 16x16 fp32 images: each folded kernel (relu, pools) is charged
    once, to the first op that reads it; the flatten is a view and is not counted."""
    m, kw = build("torch_cnn")
    g = capture(m, (), kw, name="torch_cnn")
    got = {op.name: (op.attr("folded_ops", 0), op.attr("folded_bytes", 0)) for op in g.ops}
    assert got == {
        "conv1": (0, 0),
        "conv2": (2, 4 * (4 * 16 * 16 * 16) + 4 * (4 * 16 * 8 * 8)),  # relu, max pool
        "conv3": (2, 4 * (4 * 32 * 8 * 8) + 4 * (4 * 32 * 4 * 4)),  # relu, max pool (the skip reads it too)
        "add": (1, 4 * (4 * 32 * 4 * 4)),  # relu of conv3
        "fc1": (1, 4 * (4 * 32 * 4 * 4)),  # adaptive average pool
        "fc2": (1, 4 * (4 * 64)),  # relu
    }


def test_pools_are_priced_at_the_pool_rate_by_hand():
    """torch_cnn's folded pools record their input and output bytes (the same shapes as above), and
    with a ``pool_bandwidth`` the analytic model charges an op ``pool input / P / pool_bandwidth`` for
    them in place of their share of the memory-bound traffic (``6 x output / P / memory_bandwidth``)."""
    import dataclasses

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict

    m, kw = build("torch_cnn")
    g = capture(m, (), kw, name="torch_cnn")
    got = {op.name: (op.attr("folded_pool_input_bytes", 0), op.attr("folded_pool_bytes", 0)) for op in g.ops}
    assert got == {"conv1": (0, 0), "conv2": (4 * (4 * 16 * 16 * 16), 4 * (4 * 16 * 8 * 8)),
                   "conv3": (4 * (4 * 32 * 8 * 8), 4 * (4 * 32 * 4 * 4)), "add": (0, 0),
                   "fc1": (4 * (4 * 32 * 4 * 4), 4 * (4 * 32 * 4 * 4)), "fc2": (0, 0)}
    base = get_cluster("dgx-a100", devices=2)
    pool_bw = 1e9
    slow = dataclasses.replace(base, device=dataclasses.replace(base.device, pool_bandwidth=pool_bw))
    plain, pooled = (build_tables(g, AnalyticCostModel(c), 2) for c in (base, slow))
    choice = data_parallel(plain)
    for i, op in enumerate(g.ops):
        pin, pout = got[op.name]
        procs = float(plain.configs[i][choice[i]].prod())
        expected = (pin / pool_bw - 6 * pout / base.device.memory_bandwidth) / procs
        diff = float(pooled.nodes[i].compute[choice[i]] - plain.nodes[i].compute[choice[i]])
        assert diff == pytest.approx(expected, rel=1e-9, abs=1e-15), op.name
    assert cluster_from_dict(cluster_to_dict(slow)).device.pool_bandwidth == pool_bw
    with pytest.raises(ClusterError, match="pool_bandwidth"):
        dataclasses.replace(base.device, pool_bandwidth=0.0)


def test_a_pooled_map_keeps_its_rows_and_is_read_at_its_pooled_size():
    """A 2x2 max pool (stride = kernel) pools each block of an even row split on its own, so the
    convolution after it labels the producer's rows and columns with its own (a row split of conv2
    is a row split of conv1's output) and reads the map at its pooled extents (``Operand.shape``):
    moves into it and the tile it keeps are priced at a quarter of the producer's tensor. A 3x3 pool
    of stride 1 with padding, whose windows cross block edges, keeps neither."""
    import torch.nn.functional as F
    from torch import nn

    m, kw = build("torch_cnn")
    g = capture(m, (), kw, name="torch_cnn")
    conv2 = g.ops[g.op_index("conv2")]
    x = conv2.inputs[0]
    assert (x.tensor, x.axes) == ("conv1:out", (("batch",), ("in_channels",), ("height",), ("width",)))
    assert x.shape == (4, 16, 8, 8) and g.tensor("conv1:out").shape == (4, 16, 16, 16)
    assert g.read_spec(x).nbytes * 4 == g.tensor("conv1:out").nbytes
    assert g.ops[g.op_index("conv1")].inputs[0].shape is None  # the image, read as it is

    class Overlapping(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return self.b(F.max_pool2d(self.a(x), 3, 1, 1))

    g = capture(Overlapping(), (torch.randn(2, 3, 8, 8),))
    x = g.ops[1].inputs[0]
    assert x.axes == (("batch",), ("in_channels",), (), ()) and x.shape is None


def test_loss_gathers_the_output_whole_by_hand():
    """A captured graph names its first output (``loss_output``: the last fc's output here, an HF
    model's logits), which ``shardplan run`` gathers whole for the loss. By hand, on 2 devices of one
    node: a batch-split last layer pays an all-gather of the whole (4 x 16) fp32 output,
    ``alpha + (1/2) n / beta``, and so does an out_features split; replicated or an in_features
    split (its output summed whole by the forward all-reduce) pays none. The loss's own memory
    traffic is the same in every configuration; ops before the last pay none of it."""

    m, kw = build("torch_mlp")
    g = capture(m, (), kw, name="torch_mlp")
    last = g.ops[-1]
    assert g.hint("loss_output") == last.outputs[0].tensor
    c = get_cluster("dgx-a100", devices=2)
    model = AnalyticCostModel(c)
    lv = c.levels[0]
    n = 4 * 4 * 16  # batch 4 x 16 classes, fp32
    names = last.dim_names
    by = {}
    for split in ({}, {"batch": 2}, {"in_features": 2}, {"out_features": 2}):
        config = np.array([[split.get(d, 1) for d in names]])
        items = {it.name: float(it.seconds[0]) for it in model.node_cost_items(g, last, config)}
        by[tuple(split)] = items
    assert by[()]["loss_gather"] == 0.0 and by[("in_features",)]["loss_gather"] == 0.0
    assert by[("batch",)]["loss_gather"] == pytest.approx(lv.latency + 0.5 * n / lv.bandwidth, rel=1e-12)
    assert by[("out_features",)]["loss_gather"] == pytest.approx(lv.latency + 0.5 * n / lv.bandwidth, rel=1e-12)
    assert len({items["loss"] for items in by.values()}) == 1 and by[()]["loss"] > 0
    # a hand-built graph has no loss output: no such items
    assert all(it.name not in ("loss", "loss_gather") for op in g.ops[:-1]
               for it in model.node_cost_items(g, op, np.ones((1, len(op.dims)), dtype=int)))


@pytest.mark.parametrize("name", ["torch_cnn", "llama", "gpt2"])
def test_dispatches_cover_every_exported_call_once(name):
    """Every aten call of the exported program is charged, as a dispatch, to exactly one IR op."""
    m, kw = build(name)
    g = capture(m, (), kw, name=name)
    ep = torch.export.export(m, (), kw, strict=False)
    calls = sum(1 for n in ep.graph.nodes if n.op == "call_function")
    assert sum(op.attr("dispatches", 0) for op in g.ops) == calls
    assert all(op.attr("dispatches", 0) >= 1 for op in g.ops if op.kind in ("fc", "conv", "einsum"))


def test_cnn_dispatches_by_hand():
    """torch_cnn's exported calls, in program order, charged to the next op: conv1 its own; conv2
    relu, pool and itself; conv3 relu, pool, itself; add: relu and the add; fc1: relu, pool, flatten,
    linear; fc2: relu and the linear."""
    m, kw = build("torch_cnn")
    g = capture(m, (), kw, name="torch_cnn")
    got = {op.name: op.attr("dispatches") for op in g.ops}
    ep = torch.export.export(m, (), kw, strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum(got.values()) == len(targets) and got["conv1"] == 1 and got["conv2"] == 3


def test_folded_norm_scale_gradient_is_reduced_over_the_batch_only():
    """Llama's post-attention RMSNorm scale rides on gate_proj (unindexed). Column-splitting gate_proj
    reduces its input gradient at the op (apply does), so the scale needs no all-reduce of its own;
    a batch split still all-reduces it (data parallelism)."""

    from shardplan.cluster.presets import get_cluster
    from shardplan.cost.analytic import AnalyticCostModel

    m, kw = build("llama")
    g = capture(m, (), kw, name="llama")
    op = g.op("model.layers.0.mlp.gate_proj")
    scale = [o.tensor for o in op.inputs if g.tensor(o.tensor).is_param and not any(o.axes)]
    assert scale == ["model.layers.0.post_attention_layernorm.weight"]
    model = AnalyticCostModel(get_cluster("dgx-a100", devices=2))

    def grads(**split):
        cfg = np.array([[split.get(d.name, 1) for d in op.dims]])
        return {it.tensor for it in model.node_cost_items(g, op, cfg)
                if it.name == "weight_grad_allreduce" and it.seconds[0] > 0}

    assert scale[0] not in grads(out_features=2)
    assert "model.layers.0.mlp.gate_proj.weight" not in grads(out_features=2)
    assert scale[0] in grads(batch=2) and "model.layers.0.mlp.gate_proj.weight" in grads(batch=2)


def test_vgg_example_plans_split_rows_and_channels():
    """``examples/vgg.py`` (VGG-11, 2 images of 224 x 224, captured on the meta device): on 8
    DGX-A100 GPUs the exact search splits the early convolutions' columns beside the batch and the
    late ones by channels (OptCNN's kind of plan, which data parallel's weight all-reduce makes
    worth it), beats data parallel several times over, and the runtime accepts the plan on its mesh."""
    import importlib.util
    import os

    from shardplan.execute.apply import check, choose_mesh
    from shardplan.plan import Plan
    from shardplan.search.baselines import data_parallel

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "vgg.py")
    spec = importlib.util.spec_from_file_location("vgg_example", path)
    vgg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vgg)
    with torch.device("meta"):
        module = vgg.build()
        x = torch.zeros(2, 3, 224, 224)
    graph = capture(module, (x,), name="vgg11")
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=8)), 8)
    result = solve(tables)
    plan = Plan.from_choice(tables, list(result.choice))
    convs = [dict(p.split) for p, op in zip(plan.ops, graph.ops) if op.kind == "conv"]
    assert convs[0]["width"] * convs[0]["height"] > 1  # the first convolution splits its image
    assert any(c["in_channels"] * c["out_channels"] > 1 for c in convs[-3:])
    assert tables.cost_of(data_parallel(tables)) > 4 * result.cost
    check(graph, plan, choose_mesh(graph, plan))
