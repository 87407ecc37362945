"""Built-in models by name."""

from __future__ import annotations

import inspect
from typing import Callable

from shardplan.ir.graph import Graph
from shardplan.zoo.models import GPT_SIZES, gnmt, gpt, mlp, vgg16
from shardplan.zoo.pase_models import alexnet, inception_v3, resnet101, rnnlm, transformer

MODELS: dict[str, Callable[..., Graph]] = {
    "alexnet": alexnet,
    "gnmt": gnmt,
    "gpt": gpt,
    "inception_v3": inception_v3,
    "mlp": mlp,
    "resnet101": resnet101,
    "rnnlm": rnnlm,
    "transformer": transformer,
    "vgg16": vgg16,
}

# Named sizes of the models that take a ``size`` argument.
MODEL_SIZES: dict[str, tuple[str, ...]] = {
    "gpt": tuple(GPT_SIZES),
}


def _check_name(name: str) -> None:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(sorted(MODELS))}")


def _accepts_size(name: str) -> bool:
    return "size" in inspect.signature(MODELS[name]).parameters


def model_sizes(name: str) -> list[str]:
    """Named sizes of a zoo model (``["125m", ...]`` for gpt); empty when it has none."""
    _check_name(name)
    return list(MODEL_SIZES.get(name, ())) if _accepts_size(name) else []


def build_model(name: str, batch: int | None = None, size: str | None = None) -> Graph:
    """Build a zoo model; raise ValueError naming the culprit for an unknown name, bad batch or size."""
    _check_name(name)
    kwargs: dict[str, object] = {}
    if batch is not None:
        if batch < 1:
            raise ValueError(f"batch must be a positive integer, got {batch}")
        kwargs["batch"] = batch
    if size is not None:
        if not _accepts_size(name):
            raise ValueError(f"model {name!r} has no named sizes")
        kwargs["size"] = size
    return MODELS[name](**kwargs)
