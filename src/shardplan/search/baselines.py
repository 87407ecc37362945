"""Baseline plans priced by the same tables: data parallelism."""

from __future__ import annotations

from shardplan.cost.tables import CostTables
from shardplan.ir.graph import DimKind


def data_parallel(tables: CostTables) -> list[int]:
    """Every op splits only its batch dim, as many ways as the devices allow (largest fitting factor)."""
    choice = []
    for i, op in enumerate(tables.graph.ops):
        cfgs = tables.configs[i]
        best, best_split = 0, 0
        for j, row in enumerate(cfgs):
            ok = all(c == 1 or d.kind == DimKind.BATCH for c, d in zip(row, op.dims))
            split = int(row.prod())
            if ok and split > best_split:
                best, best_split = j, split
        choice.append(best)
    return choice
