"""Hand-made plans on captured graphs, for tests and the fidelity benchmark (torch-free).

``tensor_parallel`` is Megatron's pattern expressed on a captured graph: first linears of a block
split by output features, second ones by input features, attention by heads, a gated MLP's product
by its features. ``odd`` is data parallel plus one unusual split (the LM head's vocabulary, or the
CNN's first linear split-K).
``replicated`` runs everything everywhere. ``mixed`` is tensor parallel in the MLP blocks and data
parallel elsewhere. ``half_data_parallel`` is data parallel up to the middle op and replicated after
(one all-gather of the batch between), a plan whose cost lies between the two. ``random_plan`` draws each op's
configuration uniformly from the search space (seeded): a plan no one would pick by hand, with
redistributions wherever neighbours disagree, that the cost model must still price. ``expert_parallel``
is data parallel with each mixture-of-experts block's experts split over as many devices as divide
them, their tokens sent by all-to-all (or gathered), the rest of the devices splitting its batch.
"""

from __future__ import annotations

import math

import numpy as np

from shardplan.cost.tables import CostTables
from shardplan.search.baselines import data_parallel

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_attn", "c_fc", "query", "key", "value",
          "intermediate.dense", "layers.0", "fc1")
ROW = ("o_proj", "down_proj", "c_proj", "attention.output.dense", "output.dense", "layers.1", "fc2")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "mlp.c_fc", "mlp.c_proj", "intermediate.dense", "fc1", "fc2",
             ".mlp")


def _config(tables: CostTables, i: int, **split) -> int:
    op = tables.graph.ops[i]
    return tables.index_of(i, tuple(split.get(d.name, 1) for d in op.dims))


def _maybe(tables: CostTables, i: int, dim: str, ways: int) -> int | None:
    """The configuration splitting ``dim`` of op ``i`` ``ways`` ways, or None when the search space
    has none (the dim does not divide, or a view limits it: GQA's k/v split along whole kv heads)."""
    op = tables.graph.ops[i]
    if dim not in op.dim_names:
        return None
    target = np.array([ways if d.name == dim else 1 for d in op.dims], dtype=np.int64)
    rows = np.nonzero((tables.configs[i] == target).all(axis=1))[0]
    return int(rows[0]) if len(rows) else None


def _tp_choice(tables: CostTables, i: int) -> int | None:
    p, op = tables.devices, tables.graph.ops[i]
    name = op.module or ""
    if op.kind == "fc" and name.endswith(COLUMN):
        return _maybe(tables, i, "out_features", p)
    if op.kind == "fc" and name.endswith(ROW):
        return _maybe(tables, i, "in_features", p)
    if op.kind == "einsum":
        return _maybe(tables, i, "heads", p)
    if op.kind == "elementwise" and name.endswith(".mlp"):
        # the gated MLP's act(gate) * up: split like the column-parallel gate and up that feed it
        return _maybe(tables, i, "features", p)
    return None


def tensor_parallel(tables: CostTables) -> list[int]:
    out = []
    for i in range(len(tables.graph.ops)):
        c = _tp_choice(tables, i)
        out.append(_config(tables, i) if c is None else c)
    return out


def mixed(tables: CostTables) -> list[int]:
    """Tensor parallel inside MLP blocks, data parallel everywhere else."""
    choice = list(data_parallel(tables))
    for i, op in enumerate(tables.graph.ops):
        if (op.module or "").endswith(MLP_PARTS):
            c = _tp_choice(tables, i)
            if c is not None:
                choice[i] = c
    return choice


def replicated(tables: CostTables) -> list[int]:
    return [_config(tables, i) for i in range(len(tables.graph.ops))]


def odd(tables: CostTables) -> list[int]:
    p, choice = tables.devices, list(data_parallel(tables))
    graph = tables.graph
    fcs = [i for i, op in enumerate(graph.ops) if op.kind == "fc"]
    if any(op.kind == "conv" for op in graph.ops):
        choice[fcs[0]] = _config(tables, fcs[0], in_features=p)
    else:
        choice[fcs[-1]] = _config(tables, fcs[-1], out_features=p)
    return choice


def half_data_parallel(tables: CostTables) -> list[int]:
    """Data parallel for the first half of the ops (in graph order), replicated for the rest."""
    dp, rep = list(data_parallel(tables)), replicated(tables)
    half = len(dp) // 2
    return dp[:half] + rep[half:]


def expert_parallel(tables: CostTables, dispatch: str = "all_to_all") -> list[int]:
    """Data parallel, and every fused mixture-of-experts op (``capture.moe``) split over its experts
    ``e = gcd(experts, p)`` ways. ``dispatch="all_to_all"`` (GShard's layout): the ``e`` expert ranks
    also split the block's tokens and send each row to its expert (``experts_a2a``), the batch split
    over the remaining devices; ``"gather"``: the ``e`` ranks gather the tokens and sum the experts'
    outputs (``experts``), the batch over the remaining devices. Either batch split is the largest
    the batch allows."""
    if dispatch not in ("all_to_all", "gather"):
        raise ValueError(f"dispatch must be 'all_to_all' or 'gather', got {dispatch!r}")
    p, choice = tables.devices, list(data_parallel(tables))
    for i, op in enumerate(tables.graph.ops):
        if op.kind != "moe":
            continue
        e = math.gcd(op.dim("experts").size, p)
        if dispatch == "gather":
            choice[i] = _config(tables, i, experts=e, batch=math.gcd(op.dim("batch").size, p // e))
            continue
        e = math.gcd(e, op.dim("batch").size)  # the tokens split by whole samples over the expert ranks
        choice[i] = _config(tables, i, experts_a2a=e, batch=math.gcd(op.dim("batch").size // e, p // e))
    return choice


def random_plan(tables: CostTables, seed: int) -> list[int]:
    """Each op's configuration drawn uniformly from the tables' search space (``numpy`` seeded)."""
    rng = np.random.default_rng(seed)
    return [int(rng.integers(len(c))) for c in tables.configs]
