"""What capture adds after the walk: which repeated block each op belongs to (``op.layer``, for
pipeline stages) and the mixture-of-experts blocks fused into one ``moe`` op each
(``capture.moe``; ``meta["local_blocks"]`` lists them)."""

from __future__ import annotations

import dataclasses

import torch

from shardplan.capture import moe
from shardplan.ir.graph import Graph


def annotate(graph: Graph, module: torch.nn.Module) -> Graph:
    """The captured ``graph`` of ``module`` with block indices and local blocks marked."""
    return moe.fuse(with_layers(graph, module))


def block_list(module: torch.nn.Module) -> str | None:
    """FQN of the model's repeated blocks: the ``nn.ModuleList`` of at least two children of one type
    holding the most parameters (``transformer.h``, ``model.layers``, ``encoder.layer``), or None."""
    best, size = None, 0
    for fqn, sub in module.named_modules():
        if isinstance(sub, torch.nn.ModuleList) and len(sub) >= 2 and len({type(c) for c in sub}) == 1:
            n = sum(p.numel() for p in sub.parameters())
            if n > size:
                best, size = fqn, n
    return best


def with_layers(graph: Graph, module: torch.nn.Module) -> Graph:
    """Set ``op.layer`` to the block index for ops run inside the repeated blocks (for pipeline stages)."""
    blocks = block_list(module)
    if blocks is None:
        return graph
    prefix = blocks + "."
    ops = []
    for op in graph.ops:
        layer = None
        if op.module and op.module.startswith(prefix):
            head = op.module[len(prefix):].split(".", 1)[0]
            layer = int(head) if head.isdigit() else None
        ops.append(dataclasses.replace(op, layer=layer))
    return Graph(graph.name, tuple(ops), graph.tensors, graph.meta)
