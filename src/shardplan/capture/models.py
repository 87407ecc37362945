"""Small PyTorch models to capture and run: an MLP, a CNN, an LSTM language model, and Hugging Face
models (GPT-2, Llama, BERT, Mixtral) built from configs with random weights (nothing downloaded).

``build(name, **overrides)`` returns ``(module, example_kwargs)``; HF overrides are config fields.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, features: int = 64, hidden: int = 256, classes: int = 16, layers: int = 3):
        super().__init__()
        sizes = [features] + [hidden] * (layers - 1) + [classes]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return x


class CNN(nn.Module):
    """A small VGG-style network (torchvision does not install beside torch 2.13)."""

    def __init__(self, channels: int = 16, classes: int = 10, hidden: int = 64):
        super().__init__()
        c = channels
        self.conv1 = nn.Conv2d(3, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(2 * c * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.conv3(x)) + x  # a skip connection
        x = nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        h, _ = self.lstm(self.embed(ids))
        return self.head(h)


# family -> (model class, config class, small config used by tests, run and the fidelity benchmark)
_HF = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)),
    "bert": ("BertForMaskedLM", "BertConfig",
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, num_local_experts=4,
                     num_experts_per_tok=2)),
}


def _hf(kind: str, overrides: dict, small: bool):
    """An HF model with random weights: the small config (or the library's defaults) plus overrides.

    Caches are off (torch.export cannot return them) and attention is eager (matmuls, which torch's
    FLOP counter sees); the small config also unties embeddings so each parameter has one owner.
    """
    import transformers

    if kind not in _HF:
        raise ValueError(f"unknown Hugging Face model {kind!r}; known: {', '.join(_HF)}")
    model_name, config_name, small_cfg = _HF[kind]
    ccls = getattr(transformers, config_name)
    known = set(ccls().to_dict())
    for k in overrides:
        if k not in known:
            raise ValueError(f"--hf-config: {k!r} is not a field of {config_name}")
    cfg = dict(use_cache=False, attn_implementation="eager")
    if small:
        cfg.update(small_cfg, tie_word_embeddings=False)
    cfg.update(overrides)
    return getattr(transformers, model_name)(ccls(**cfg))


HF_MODELS = tuple(_HF)
TORCH_MODELS = ("torch_mlp", "torch_cnn", "lstm_lm")


def build(name: str, batch: int = 4, seq: int = 16, device: str | torch.device = "cpu", **overrides):
    """(module, example kwargs) for a built-in PyTorch model; HF models take config overrides."""
    with torch.device(device):
        if name == "torch_mlp":
            m = MLP(**overrides)
            return m, {"x": torch.randn(batch, m.layers[0].in_features)}
        if name == "torch_cnn":
            return CNN(**overrides), {"x": torch.randn(batch, 3, 16, 16)}
        if name == "lstm_lm":
            m = LSTMLM(**overrides)
            return m, {"ids": torch.randint(0, m.embed.num_embeddings, (batch, seq))}
        model = _hf(name, overrides, small=True)
        vocab = model.config.vocab_size
        return model, {"input_ids": torch.randint(0, vocab, (batch, seq))}


def parse_config(text: str | None) -> dict:
    """``"hidden_size=4096,num_hidden_layers=32"`` -> dict with ints, floats and booleans parsed."""
    out: dict = {}
    for item in filter(None, (text or "").split(",")):
        if "=" not in item:
            raise ValueError(f"--hf-config: expected key=value, got {item!r}")
        k, v = (s.strip() for s in item.split("=", 1))
        for cast in (int, float):
            try:
                out[k] = cast(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def load_hf(kind: str, overrides: dict, batch: int = 8, seq: int = 128, meta: bool = True):
    """A full-size HF model (library defaults plus ``overrides``) on the meta device, and meta inputs;
    ``meta=False``: on the default device (under ``FakeTensorMode``, a dry run's fake tensors)."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = _hf(kind, overrides, small=False)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, {"input_ids": ids}, kind


def load_module(spec: str, input_shape: str | None, batch: int | None = None):
    """``pkg.mod:fn`` -> (fn(), {first input: zeros of input_shape}) for a user's own model."""
    import importlib
    import inspect

    if ":" not in spec:
        raise ValueError(f"--module: expected pkg.module:function, got {spec!r}")
    mod_name, fn_name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--module {spec!r}: {exc}") from None
    if not input_shape:
        raise ValueError("--module needs --input-shape, e.g. --input-shape 8,3,224,224")
    try:
        shape = [int(s) for s in input_shape.split(",")]
    except ValueError:
        raise ValueError(f"--input-shape: expected integers separated by commas, got {input_shape!r}") from None
    if batch is not None:
        shape[0] = batch
    module = fn() if callable(fn) and not isinstance(fn, torch.nn.Module) else fn
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"--module {spec!r} did not return an nn.Module")
    params = [p for p in inspect.signature(module.forward).parameters if p != "self"]
    x = torch.zeros(shape, device="meta") if any(p.is_meta for p in module.parameters()) else torch.zeros(shape)
    return module, {params[0]: x}, type(module).__name__
