"""What capture adds after the walk: which repeated block each op belongs to (``op.layer``, for
pipeline stages) and which modules run as local computations on a batch shard (mixture-of-experts
blocks: ``meta["local_blocks"]``, their ops split by batch only)."""

from __future__ import annotations

import dataclasses

import torch

from shardplan.ir.graph import DimKind, Graph


def annotate(graph: Graph, module: torch.nn.Module) -> Graph:
    """The captured ``graph`` of ``module`` with block indices and local blocks marked."""
    return local_blocks(with_layers(graph, module))


def local_blocks(graph: Graph) -> Graph:
    """Mixture-of-experts blocks (the module holding routed experts, e.g. Mixtral's ``...mlp``) run as
    local computations on each rank's batch shard (``execute.apply``): their ops keep every dim but the
    batch whole, and the graph lists the blocks in ``meta["local_blocks"]``."""
    blocks = sorted({op.module.rsplit(".", 1)[0] for op in graph.ops
                     if "experts" in op.dim_names and op.module and "." in op.module})
    if not blocks:
        return graph

    def inside(op):
        return op.module is not None and any(op.module == b or op.module.startswith(b + ".") for b in blocks)

    ops = []
    for op in graph.ops:
        if inside(op):
            dims = tuple(dataclasses.replace(d, splittable=d.splittable and d.kind is DimKind.BATCH) for d in op.dims)
            op = dataclasses.replace(op, dims=dims)
        ops.append(op)
    meta = tuple(graph.meta) + (("local_blocks", tuple(blocks)),)
    return Graph(graph.name, tuple(ops), graph.tensors, meta)


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
