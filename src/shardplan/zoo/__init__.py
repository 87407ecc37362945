"""Built-in models by name."""

from __future__ import annotations

from typing import Callable

from shardplan.ir.graph import Graph
from shardplan.zoo.pase_models import alexnet, inception_v3, resnet101, rnnlm, transformer

MODELS: dict[str, Callable[..., Graph]] = {
    "alexnet": alexnet,
    "inception_v3": inception_v3,
    "resnet101": resnet101,
    "rnnlm": rnnlm,
    "transformer": transformer,
}


def build_model(name: str, batch: int | None = None) -> Graph:
    """Build a zoo model; raise ValueError naming the culprit for an unknown name or bad batch."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(sorted(MODELS))}")
    if batch is None:
        return MODELS[name]()
    if batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch}")
    return MODELS[name](batch=batch)
