"""Memory model against hand-calculated cases (the arithmetic is written out in each test)."""

import pytest

from shardplan.cost.memory import (MemoryOptions, MemoryOptionsError, inflight_microbatches,
                                   model_state_bytes, transformer_layer_activation_bytes,
                                   transformer_stage_memory)

GB = 1e9


def test_mixed_precision_adam_is_16_bytes_per_param():
    # ZeRO paper: 2 (fp16 weight) + 2 (fp16 grad) + 12 (fp32 master, momentum, variance) = 16 B/param
    w, g, o = model_state_bytes(1e9, MemoryOptions())
    assert (w, g, o) == (2e9, 2e9, 12e9)
    # fp32 Adam: 4 + 4 + 8
    assert model_state_bytes(1e9, MemoryOptions(mixed_precision=False)) == (4e9, 4e9, 8e9)


@pytest.mark.parametrize("zero, expected", [
    (0, 2 + 2 + 12),          # nothing sharded
    (1, 2 + 2 + 12 / 8),      # optimizer state / d
    (2, 2 + 2 / 8 + 12 / 8),  # + gradients / d
    (3, (2 + 2 + 12) / 8),    # + weights / d  (FSDP)
])
def test_zero_stages_divide_along_data_parallel(zero, expected):
    # 7.5B params, d = 8 (ZeRO paper's 64-GPU example uses Psi = 7.5B, N_d = 64; here N_d = 8)
    total = sum(model_state_bytes(7.5e9, MemoryOptions(zero=zero), data_parallel=8))
    assert total == pytest.approx(7.5e9 * expected)


def test_zero_paper_figure1_numbers():
    # Rajbhandari et al. Fig. 1: Psi = 7.5B, K = 12, N_d = 64: baseline 120 GB, P_os 31.4 GB,
    # P_os+g 16.6 GB, P_os+g+p 1.88 GB. Exactly: 16 * 7.5 = 120; 4 * 7.5 + 12 * 7.5 / 64 = 31.40625;
    # 2 * 7.5 + 14 * 7.5 / 64 = 16.640625; 16 * 7.5 / 64 = 1.875
    psi = 7.5e9
    got = [sum(model_state_bytes(psi, MemoryOptions(zero=z), 64)) / GB for z in (0, 1, 2, 3)]
    assert got == pytest.approx([120.0, 31.40625, 16.640625, 1.875])


def test_korthikanti_activation_formula_gpt3_175b():
    # GPT-3 175B: s = 2048, h = 12288, a = 96, microbatch b = 1
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h  # 25,165,824
    # no parallelism: sbh (34 + 5 a s / h) = sbh (34 + 5*96*2048/12288) = sbh (34 + 80) = 114 sbh
    assert transformer_layer_activation_bytes(s, b, h, a) == pytest.approx(114 * sbh)
    assert 114 * sbh == 2_868_903_936
    # tensor parallel t = 8: sbh (10 + 24/8 + 80/8) = 23 sbh
    assert transformer_layer_activation_bytes(s, b, h, a, 8) == pytest.approx(23 * sbh)
    # t = 8 with sequence parallelism: sbh/8 (34 + 80) = 14.25 sbh
    assert transformer_layer_activation_bytes(s, b, h, a, 8, sequence_parallel=True) == pytest.approx(14.25 * sbh)
    # selective recomputation, t = 8: sbh (10 + 3) = 13 sbh; with SP: 34/8 sbh
    assert transformer_layer_activation_bytes(s, b, h, a, 8, "selective") == pytest.approx(13 * sbh)
    assert transformer_layer_activation_bytes(s, b, h, a, 8, "selective", True) == pytest.approx(4.25 * sbh)
    # full recomputation: only the 16-bit layer input, 2 sbh
    assert transformer_layer_activation_bytes(s, b, h, a, 8, "full") == pytest.approx(2 * sbh)


def test_inflight_microbatches_per_schedule():
    p, m = 4, 16
    assert [inflight_microbatches("gpipe", p, i, m) for i in range(p)] == [16, 16, 16, 16]
    assert [inflight_microbatches("1f1b", p, i, m) for i in range(p)] == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", p, 0, 2) == 2  # fewer microbatches than stages
    # interleaved, v = 2: stage 0 keeps (2*3 + 1*4 + 1) / 2 = 5.5 = p + (p - 1)/v
    assert inflight_microbatches("interleaved", p, 0, m, chunks=2) == pytest.approx(4 + 3 / 2)
    assert inflight_microbatches("interleaved", p, 3, m, chunks=2) == pytest.approx((0 + 4 + 1) / 2)
    with pytest.raises(MemoryOptionsError, match="schedule"):
        inflight_microbatches("zigzag", p, 0, m)


def test_stage_memory_175b_megatron_stage():
    # Megatron's 175B layout: t = 8, p = 16 -> 6 layers per stage; d = 8.
    # Params of one layer: 12 h^2 + 13 h = 1,812,099,072 (approx.); per device / 8.
    h = 12288
    layer_params = 12 * h * h
    per_device = 6 * layer_params / 8  # 1,358,954,496
    sbh = 2048 * 1 * h
    # 1F1B stage 0 of 16 keeps 16 microbatches; no recomputation: 6 layers * 23 sbh each
    mem = transformer_stage_memory(6, per_device, 2048, 1, h, 96, MemoryOptions(), inflight=16,
                                   tensor_parallel=8, data_parallel=8)
    assert mem.weights + mem.gradients + mem.optimizer == pytest.approx(16 * per_device)  # 21.74 GB
    assert mem.activations == pytest.approx(16 * 6 * 23 * sbh)  # 55.57 GB
    assert mem.buffers == pytest.approx(2 * sbh)
    assert mem.total == pytest.approx(16 * per_device + 16 * 6 * 23 * sbh + 2 * sbh)
    # full recomputation: 16 * 6 * 2 sbh = 4.83 GB of activations
    full = transformer_stage_memory(6, per_device, 2048, 1, h, 96, MemoryOptions(recompute="full"),
                                    inflight=16, tensor_parallel=8, data_parallel=8)
    assert full.activations == pytest.approx(16 * 6 * 2 * sbh)
    # ZeRO-3 over d = 8: states / 8, plus two gathered 16-bit layers (2 * layer_params/8 * 2 bytes)
    z3 = transformer_stage_memory(6, per_device, 2048, 1, h, 96, MemoryOptions(zero=3, recompute="full"),
                                  inflight=16, tensor_parallel=8, data_parallel=8,
                                  layer_params_per_device=layer_params / 8)
    assert z3.weights + z3.gradients + z3.optimizer == pytest.approx(16 * per_device / 8)
    assert z3.buffers == pytest.approx(2 * sbh + 2 * (layer_params / 8) * 2)


def test_bad_options_name_the_field():
    with pytest.raises(MemoryOptionsError, match="zero"):
        MemoryOptions(zero=4)
    with pytest.raises(MemoryOptionsError, match="recompute"):
        MemoryOptions(recompute="some")
    with pytest.raises(MemoryOptionsError, match="optimizer"):
        MemoryOptions(optimizer="lamb")
