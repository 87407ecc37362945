"""Zoo models: MLP, VGG-16, GNMT, GPT (structure, parameter and FLOP counts, sizes, search sanity)."""

import time
from collections import Counter

import pytest

from shardplan.cost.pase import PaseCostModel
from shardplan.cost.tables import build_tables
from shardplan.search.baselines import data_parallel
from shardplan.search.exact import exact_search
from shardplan.zoo import MODELS, build_model, model_sizes
from shardplan.zoo.models import GPT_SIZES, VGG16_CONFIG, gnmt, gpt, mlp, vgg16

NEW_MODELS = ("mlp", "vgg16", "gnmt", "gpt")


def kinds(graph):
    return Counter(op.kind for op in graph.ops)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_zoo_model_verifies(name):
    g = build_model(name)
    assert g.verify() is g
    assert g.ops[-1].kind == "softmax_xent"
    assert g.num_params > 0 and g.forward_flops > 0


@pytest.mark.parametrize("name", NEW_MODELS)
def test_new_models_are_registered_and_take_batch(name):
    assert name in MODELS
    g = build_model(name, batch=16)
    assert g.tensor(g.ops[0].inputs[0].tensor).shape[0] == 16


# -- MLP -----------------------------------------------------------------------------------------

def test_mlp_counts():
    g = mlp()
    assert [op.name for op in g.ops] == ["fc1", "fc2", "fc3", "classifier", "loss"]
    assert [op.attr("pw_ops") for op in g.ops[:4]] == [1, 1, 1, 0]
    assert g.num_params == 1024 * 4096 + 2 * 4096 * 4096 + 4096 * 1000 == 41_844_736  # no biases
    b = 64
    matmul = 2 * b * (1024 * 4096 + 2 * 4096 * 4096 + 4096 * 1000)
    relu = 3 * b * 4096
    assert g.forward_flops == matmul + relu + 5 * b * 1000
    g = mlp(batch=2, hidden=(8, 16), in_features=4, num_classes=3)
    assert len(g.ops) == 4 and g.num_params == 4 * 8 + 8 * 16 + 16 * 3


# -- VGG-16 --------------------------------------------------------------------------------------

def test_vgg16_structure_and_params():
    g = vgg16()
    assert kinds(g) == {"conv": 13, "pool": 5, "reshape": 2, "fc": 3, "softmax_xent": 1}
    assert len(g.ops) == 24
    assert g.hint("pase_cutoff") == 4
    assert all(op.attr("pw_ops") == 1 for op in g.ops if op.kind == "conv")
    assert g.tensor("pool5.out").shape == (64, 512, 7, 7)
    assert g.op("fc6").dim("in_features").size == 25088
    # Hand count. torchvision's vgg16 has 138,357,544 parameters including biases; the builder's
    # convs have no bias and the zoo keeps linears bias-free too, so subtract every bias.
    channels = [c for c in VGG16_CONFIG if c != "M"]
    conv_w = sum(cin * cout * 9 for cin, cout in zip([3] + channels[:-1], channels))
    fc_w = 512 * 7 * 7 * 4096 + 4096 * 4096 + 4096 * 1000
    biases = sum(channels) + 4096 + 4096 + 1000
    assert conv_w == 14_710_464 and biases == 13_416
    assert g.num_params == conv_w + fc_w == 138_357_544 - biases == 138_344_128


def test_vgg16_flops_per_image():
    g = vgg16(batch=1)
    macs = sum(op.flops - op.attr("pw_ops", 0) * g.tensor(op.outputs[0].tensor).numel
               for op in g.ops if op.kind in ("conv", "fc")) / 2
    assert macs == pytest.approx(15.47e9, rel=0.002)  # the usual "15.5 GMACs" of VGG-16


# -- GNMT ----------------------------------------------------------------------------------------

def test_gnmt_structure_and_params():
    g = gnmt()
    assert [op.name for op in g.ops] == [
        "src_embed", "enc.fwd", "enc.bwd", "enc.merge", "enc.lstm", "tgt_embed", "dec.lstm",
        "attn.scores", "attn.softmax", "attn.context", "attn.concat", "attn.combine", "proj", "loss"]
    assert kinds(g)["lstm"] == 4
    assert g.op("enc.lstm").dim("layers").size == 3 and g.op("dec.lstm").dim("layers").size == 4
    enc = g.op("enc.lstm").outputs[0].tensor
    readers = [op.name for op in g.ops if any(i.tensor == enc for i in op.inputs)]
    assert readers == ["attn.scores", "attn.context"]
    assert g.tensor(g.op("attn.scores").outputs[0].tensor).shape == (64, 40, 40)
    assert g.tensor(g.op("attn.concat").outputs[0].tensor).shape == (64, 40, 2048)
    h, v, L = 1024, 32000, 4
    lstm = 8 * h * h * (1 + 1 + (L - 1) + L)  # fwd, bwd, L-1 encoder layers, L decoder layers
    assert g.num_params == 2 * v * h + lstm + 2 * h * h + h * v == 175_898_624
    assert len(gnmt(layers=8).ops) == 14 and len(gnmt(layers=1).ops) == 13
    with pytest.raises(ValueError, match="layers"):
        gnmt(layers=0)


# -- GPT -----------------------------------------------------------------------------------------

def gpt_params(L, h, V, s, ffn=None):
    """Hand count as the graph models GPT: no biases, tied LM head, learned positions."""
    ffn = 4 * h if ffn is None else ffn
    per_layer = 4 * h * h + 2 * h * ffn + 2 * 2 * h  # qkv + out, mlp up + down, two layer norms
    return L * per_layer + 2 * h + V * h + s * h  # final norm, token and position tables


def test_gpt_125m_params_and_ops():
    g = gpt("125m")
    L, h = 12, 768
    assert g.hint("seq") == 2048 and g.hint("vocab") == 50304  # 50257 padded to a multiple of 128
    assert g.num_params == 12 * L * h * h + 4 * L * h + 2 * h + 50304 * h + 2048 * h
    assert g.num_params == gpt_params(L, h, 50304, 2048) == 125_179_392
    assert g.num_params == pytest.approx(125e6, rel=0.005)
    assert len(g.ops) == 12 * L + 6 == 150
    assert kinds(g) == {"embedding": 2, "elementwise": 1 + 2 * L, "norm": 2 * L + 1, "einsum": 6 * L + 1,
                        "unstack": L, "softmax": L, "softmax_xent": 1}
    assert g.op("lm_head").inputs[1].tensor == "tok_embed.weight"  # tied
    assert g.hint("pase_cutoff") == 1 and g.hint("family") == "transformer"


@pytest.mark.parametrize("size", list(GPT_SIZES))
def test_gpt_named_sizes_match_gpt3_table(size):
    nominal = {"125m": 125e6, "350m": 350e6, "760m": 760e6, "1.3b": 1.3e9, "2.7b": 2.7e9,
               "6.7b": 6.7e9, "13b": 13e9, "175b": 175e9, "530b": 530e9}[size]
    L, h, heads = GPT_SIZES[size]
    g = build_model("gpt", size=size)
    assert g.hint("layers") == L and g.hint("hidden") == h and g.hint("heads") == heads
    assert g.num_params == gpt_params(L, h, 50304, 2048)
    assert g.num_params == pytest.approx(nominal, rel=0.025)
    assert len(g.ops) == 12 * L + 6


def test_gpt_layer_flops_match_formula():
    b, s, h, heads, L = 2, 128, 256, 8, 3
    g = gpt(layers=L, hidden=h, heads=heads, seq=s, vocab=1000, batch=b)
    for i in range(L):
        ops = [op for op in g.ops if op.layer == i]
        assert len(ops) == 12
        gelu = b * s * 4 * h  # fused into mlp.up as one pointwise op per output element
        contraction = sum(op.flops for op in ops if op.kind == "einsum") - gelu
        assert contraction == 24 * b * s * h * h + 4 * b * s * s * h  # Megatron's forward count
        extra = 2 * 8 * b * s * h + 2 * b * s * h + 5 * b * heads * s * s + gelu  # norms, adds, softmax, gelu
        assert sum(op.flops for op in ops) == contraction + extra
    head = g.op("lm_head")
    assert head.flops == 2 * b * s * h * 1024  # vocab 1000 padded to 1024


def test_gpt_layers_and_modules():
    g = gpt(layers=3, hidden=64, heads=4, seq=16, vocab=100, batch=2)
    for op in g.ops:
        assert op.module is not None
        if op.name.startswith("layers."):
            i = int(op.name.split(".")[1])
            assert op.layer == i
            assert op.module.startswith(f"layers.{i}.")
        else:
            assert op.layer is None
    assert g.op("layers.2.attn.scores").module == "layers.2.attn"
    assert g.op("layers.0.mlp.up").module == "layers.0.mlp" and g.op("layers.0.mlp.up").attr("pw_ops") == 1


def test_gpt_split_dims_are_divisible():
    g = gpt("125m")
    assert g.op("lm_head").dim("vocab").size % 128 == 0
    assert g.op("layers.0.attn.qkv").dim("heads").size == 12
    assert g.op("layers.0.mlp.up").dim("ffn").size == 3072
    assert gpt(vocab=50257, pad_vocab_to=1, layers=1).hint("vocab") == 50257
    assert gpt(layers=1, ffn=1000).op("layers.0.mlp.up").dim("ffn").size == 1000
    with pytest.raises(ValueError, match="heads"):
        gpt(hidden=100, heads=3)


def test_gpt_size_overrides_shape():
    g = gpt(size="350m", layers=2, hidden=64, heads=2, seq=16)
    assert (g.hint("layers"), g.hint("hidden"), g.hint("heads"), g.hint("seq")) == (24, 1024, 16, 2048)
    g = build_model("gpt", batch=4, size="125m")
    assert g.tensor("tokens").shape == (4, 2048)
    assert build_model("gpt").hint("seq") == 1024


def test_unknown_size_errors():
    with pytest.raises(ValueError) as err:
        gpt(size="7b")
    msg = str(err.value)
    assert "'7b'" in msg and all(s in msg for s in GPT_SIZES)
    with pytest.raises(ValueError, match="nope"):
        build_model("gpt", size="nope")
    with pytest.raises(ValueError, match="model 'mlp' has no named sizes"):
        build_model("mlp", size="125m")
    assert model_sizes("gpt") == list(GPT_SIZES)
    assert model_sizes("mlp") == [] and model_sizes("alexnet") == []
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        model_sizes("nope")


def test_build_model_keeps_its_errors():
    with pytest.raises(ValueError, match="unknown model 'nope'; built-in models: alexnet"):
        build_model("nope")
    with pytest.raises(ValueError, match="batch must be a positive integer, got 0"):
        build_model("gpt", batch=0, size="125m")


def test_gpt_175b_builds_fast():
    start = time.perf_counter()
    g = gpt("175b")
    assert time.perf_counter() - start < 2.0
    assert len(g.ops) == 96 * 12 + 6
    assert g.num_params == pytest.approx(175e9, rel=0.01)


# -- search sanity -------------------------------------------------------------------------------

@pytest.mark.parametrize("graph", [
    pytest.param(lambda: mlp(), id="mlp"),
    pytest.param(lambda: gpt(layers=2, hidden=768, heads=12, seq=2048), id="gpt125m-2layers"),
])
def test_exact_search_beats_data_parallel(graph):
    tables = build_tables(graph(), PaseCostModel(), 8)
    result = exact_search(tables)
    assert tables.cost_of(result.choice) == pytest.approx(result.cost, rel=1e-12)
    assert result.cost <= tables.cost_of(data_parallel(tables)) * (1 + 1e-12)
