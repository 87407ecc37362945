"""Memory per device for training with pipelines, tensor parallelism, ZeRO and recomputation (bytes).

Every formula gives bytes per device; sources:

* **Model states** (Rajbhandari et al., "ZeRO", SC 2020, section 3.1): mixed-precision Adam keeps
  2 bytes/param of fp16/bf16 weights, 2 of gradients and 12 of fp32 optimizer state (master weight,
  momentum, variance): 16 bytes/param. Without mixed precision: 4 + 4 + 8. SGD with momentum keeps
  4 (master, mixed only) + 4 (momentum); plain SGD 4 (master, mixed only) + 0.
  ZeRO along the data-parallel axis of degree d divides: stage 1 the optimizer state, stage 2 also the
  gradients, stage 3 (FSDP) also the weights.
* **Activations of one transformer layer** for one microbatch (Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", 2022, section 4; 16-bit activations,
  1-byte dropout masks, ffn = 4h), with s = sequence, b = microbatch, h = hidden, a = heads,
  t = tensor-parallel degree:
    - no parallelism:                  s b h (34 + 5 a s / h)
    - tensor parallel:                 s b h (10 + 24 / t + 5 a s / (h t))
    - tensor + sequence parallel:      s b h / t (34 + 5 a s / h)
    - selective recomputation (attention core recomputed): drop the 5 a s / h term
      (TP: s b h (10 + 24 / t); TP + SP: 34 s b h / t)
    - full recomputation: only the layer input is kept, 2 s b h (/ t with sequence parallelism).
* **Microbatches in flight** (activations kept at once by stage i of p, m microbatches;
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC 2021, section 2.2): GPipe keeps all m; 1F1B keeps min(p - i, m); interleaved 1F1B
  with v chunks per device keeps min(2 (p - i - 1) + (v - 1) p + 1, m v) chunks, each 1/v of the
  stage's layers (Megatron-LM's warm-up count plus the one in flight), so stage 0 holds
  p + (p - 1) / v microbatches' worth.
* **Temporary buffers of collectives**: one 16-bit activation-sized buffer (tensor-parallel all-reduce
  output or point-to-point receive, 2 s b h bytes) and, with ZeRO-3, two layers of gathered 16-bit
  weights (the layer in use and the one prefetched, as FSDP does).
"""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


class MemoryOptionsError(ValueError):
    """Bad memory options; the message names the field."""


@dataclass(frozen=True)
class MemoryOptions:
    """How a stage keeps its state. Units: bytes."""

    mixed_precision: bool = True
    """16-bit weights, gradients and activations with fp32 master weights (Micikevicius et al. 2018)."""
    optimizer: str = "adam"
    """adam | sgd_momentum | sgd"""
    zero: int = 0
    """ZeRO stage along the data-parallel axis: 0 none, 1 optimizer state, 2 + gradients, 3 + weights."""
    recompute: str = "none"
    """none | selective (attention core) | full (keep only each layer's input)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism: norms and dropouts split t ways too."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_BYTES:
            raise MemoryOptionsError(f"optimizer must be one of {', '.join(OPTIMIZER_BYTES)}, got {self.optimizer!r}")
        if self.zero not in (0, 1, 2, 3):
            raise MemoryOptionsError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute not in RECOMPUTE:
            raise MemoryOptionsError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")

    @property
    def weight_bytes(self) -> int:
        return 2 if self.mixed_precision else 4

    @property
    def grad_bytes(self) -> int:
        return 2 if self.mixed_precision else 4

    @property
    def optimizer_bytes(self) -> int:
        return OPTIMIZER_BYTES[self.optimizer][0 if self.mixed_precision else 1]

    @property
    def activation_bytes(self) -> int:
        return 2 if self.mixed_precision else 4


OPTIMIZER_BYTES = {"adam": (12, 8), "sgd_momentum": (8, 4), "sgd": (4, 0)}
"""Optimizer-state bytes per parameter (mixed precision, fp32): Rajbhandari et al. 2020, section 3.1."""


@dataclass(frozen=True)
class StageMemory:
    """Bytes per device of one pipeline stage, by kind."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers


def model_state_bytes(params_per_device: float, opts: MemoryOptions, data_parallel: int = 1
                      ) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes on a device holding ``params_per_device`` parameters
    (already divided by the tensor degree), with ZeRO-``opts.zero`` over ``data_parallel`` replicas."""
    if data_parallel < 1:
        raise MemoryOptionsError(f"data_parallel must be at least 1, got {data_parallel}")
    d = float(data_parallel)
    w = params_per_device * opts.weight_bytes / (d if opts.zero >= 3 else 1.0)
    g = params_per_device * opts.grad_bytes / (d if opts.zero >= 2 else 1.0)
    o = params_per_device * opts.optimizer_bytes / (d if opts.zero >= 1 else 1.0)
    return w, g, o


def transformer_layer_activation_bytes(seq: int, micro_batch: int, hidden: int, heads: int,
                                       tensor_parallel: int = 1, recompute: str = "none",
                                       sequence_parallel: bool = False) -> float:
    """Bytes one transformer layer keeps for the backward pass of one microbatch (Korthikanti 2022)."""
    s, b, h, a, t = float(seq), float(micro_batch), float(hidden), float(heads), float(tensor_parallel)
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh / (t if sequence_parallel else 1.0)
    attn = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if recompute not in RECOMPUTE:
        raise MemoryOptionsError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if sequence_parallel:
        return sbh / t * (34.0 + attn)
    return sbh * (10.0 + 24.0 / t + attn / t)


def inflight_microbatches(schedule: str, num_stages: int, stage: int, num_microbatches: int,
                          chunks: int = 1) -> float:
    """Microbatches' worth of activations stage ``stage`` (0 = first) keeps at once (Narayanan 2021)."""
    p, i, m, v = num_stages, stage, num_microbatches, chunks
    if not 0 <= i < p:
        raise MemoryOptionsError(f"stage {i} is outside 0..{p - 1}")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - i, m))
    if schedule == "interleaved":
        return min(2 * (p - i - 1) + (v - 1) * p + 1, m * v) / v
    raise MemoryOptionsError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def transformer_stage_memory(num_layers: int, params_per_device: float, seq: int, micro_batch: int,
                             hidden: int, heads: int, opts: MemoryOptions, inflight: float,
                             tensor_parallel: int = 1, data_parallel: int = 1,
                             layer_params_per_device: float = 0.0) -> StageMemory:
    """Memory of a stage of ``num_layers`` transformer layers holding ``params_per_device`` parameters."""
    w, g, o = model_state_bytes(params_per_device, opts, data_parallel)
    per_layer = transformer_layer_activation_bytes(seq, micro_batch, hidden, heads, tensor_parallel,
                                                   opts.recompute, opts.sequence_parallel)
    act = inflight * num_layers * per_layer
    buffers = opts.activation_bytes * seq * micro_batch * hidden
    if opts.zero >= 3 and data_parallel > 1:
        buffers += 2.0 * layer_params_per_device * opts.weight_bytes
    return StageMemory(w, g, o, act, buffers)
