"""Cost tables: every op's configurations with their costs, every edge's cost over layouts.

This is the whole search problem as arrays, kept apart from the code that fills them (so searches
can be tested on random tables):

    minimise  sum_v node[v][c_v]  +  sum_e edge_e.cost[src_class_e[c_src], dst_class_e[c_dst]]

An edge cost depends on the producer's configuration only through the *layout* of the tensor it
writes (how each tensor axis is split), and likewise for the consumer. ``src_class`` maps each
producer configuration to its layout class, so an edge table has L_src x L_dst entries rather than
K_src x K_dst, and the exact search works on these smaller domains.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from shardplan.cluster.mesh import placed_layouts
from shardplan.cost.configs import ConfigSpace, enumerate_configs, operand_layouts, split_limits
from shardplan.ir.graph import Graph, GraphError, Op, TensorSpec


@dataclass(frozen=True)
class NodeCosts:
    """Per-configuration costs of one op, in the cost model's unit (memory in bytes)."""

    total: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    memory: np.ndarray


class CostModel(Protocol):
    """What a cost model provides; see ``cost.pase`` and ``cost.analytic``."""

    name: str
    unit: str
    dedup_edges: bool

    def config_space(self, graph: Graph, devices: int) -> ConfigSpace: ...

    def frozen_dims(self, op: Op) -> frozenset[str]: ...

    def node_costs(self, graph: Graph, op: Op, configs: np.ndarray) -> NodeCosts: ...

    def edge_costs(self, graph: Graph, tensor: TensorSpec, src_layouts: np.ndarray,
                   dst_layouts: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class EdgeTable:
    """Cost of one (deduplicated or summed) set of transfers between ops ``src`` and ``dst``."""

    src: int
    dst: int
    src_class: np.ndarray  # (K_src,) int: layout class of each producer configuration
    dst_class: np.ndarray  # (K_dst,) int
    cost: np.ndarray  # (L_src, L_dst)
    tensors: tuple[str, ...] = ()
    syncs: np.ndarray | None = None
    """(L_src, L_dst) uint8, from models that tell (``edge_prices``): bit 0 set where the forward move
    is a collective, bit 1 where the gradient's move back is; None: any cost is taken for both."""

    def sync_code(self, src_choice: int, dst_choice: int) -> int:
        """Which directions move bytes between ranks for these two ops' configurations (bit 0 forward,
        bit 1 backward; see ``syncs``)."""
        a, b = self.src_class[src_choice], self.dst_class[dst_choice]
        if self.syncs is None:
            return 3 if float(self.cost[a, b]) > 0 else 0
        return int(self.syncs[a, b])


@dataclass(frozen=True)
class CostTables:
    """The search problem for one graph, cost model and device count."""

    graph: Graph
    devices: int
    model_name: str
    unit: str
    configs: tuple[np.ndarray, ...]
    nodes: tuple[NodeCosts, ...]
    edges: tuple[EdgeTable, ...]
    build_seconds: float = 0.0
    memory_limit_bytes: float | None = None
    mesh: tuple[int, ...] | None = None
    """The device mesh the configurations were limited to (the cost model's ``mesh``), or None."""
    _by_pair: dict = field(init=False, repr=False, compare=False, default=None)

    @property
    def num_configs(self) -> list[int]:
        return [len(c) for c in self.configs]

    def edge_cost_of(self, choice: list[int] | np.ndarray) -> float:
        """Redistribution cost of a full assignment: the sum of its edge-table entries."""
        return sum(float(e.cost[e.src_class[choice[e.src]], e.dst_class[choice[e.dst]]]) for e in self.edges)

    def cost_of(self, choice: list[int] | np.ndarray) -> float:
        """Objective of a full assignment (one configuration index per op)."""
        return sum(float(n.total[c]) for n, c in zip(self.nodes, choice)) + self.edge_cost_of(choice)

    def breakdown(self, choice: list[int] | np.ndarray) -> dict[str, float]:
        """compute / intra-op comm / redistribution / memory of an assignment."""
        compute = sum(float(n.compute[c]) for n, c in zip(self.nodes, choice))
        comm = sum(float(n.comm[c]) for n, c in zip(self.nodes, choice))
        redist = self.edge_cost_of(choice)
        memory = sum(float(n.memory[c]) for n, c in zip(self.nodes, choice))
        return {"compute": compute, "comm": comm, "redistribution": redist, "memory_bytes": memory}

    def index_of(self, op: int, config: tuple[int, ...]) -> int:
        """Index of a configuration tuple among op ``op``'s configurations."""
        rows = np.nonzero((self.configs[op] == np.array(config, dtype=np.int64)).all(axis=1))[0]
        if len(rows) == 0:
            raise GraphError(
                f"op {self.graph.ops[op].name!r}: configuration {dict(zip(self.graph.ops[op].dim_names, config))} "
                f"is outside the search space of the {self.model_name} cost model on {self.devices} devices"
            )
        return int(rows[0])


def _classes(layouts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uniq, inverse = np.unique(layouts, axis=0, return_inverse=True)
    return uniq, inverse.reshape(-1).astype(np.int64)


def edge_layouts(op: Op, configs: np.ndarray, axes: tuple[tuple[str, ...], ...],
                 mesh: tuple[int, ...] | None) -> np.ndarray:
    """An operand's layout under every configuration, the key of its edge classes: its split factors
    (``operand_layouts``), and with a ``mesh`` also the tensor axis each mesh axis splits
    (``cluster.mesh.placed_layouts``), for models that price the blocks each rank holds."""
    return operand_layouts(op, configs, axes) if mesh is None else placed_layouts(op, configs, axes, mesh)


def build_tables(graph: Graph, model: CostModel, devices: int,
                 progress: Callable[[int, int], None] | None = None) -> CostTables:
    """Enumerate configurations and price every op and edge under ``model``."""
    start = time.perf_counter()
    space = model.config_space(graph, devices)
    configs, nodes = [], []
    for i, op in enumerate(graph.ops):
        cfg = enumerate_configs(op, space, model.frozen_dims(op), split_limits(graph, op))
        configs.append(cfg)
        nodes.append(model.node_costs(graph, op, cfg))
        if progress:
            progress(i + 1, len(graph.ops))
    transfers = graph.edges()
    if model.dedup_edges:
        last = {}
        for e in transfers:
            last[(e.src, e.dst)] = e  # a later transfer overwrites an earlier one, as networkx does
        transfers = list(last.values())
    mesh = model.edge_mesh(devices) if hasattr(model, "edge_mesh") else None
    merged: dict[tuple[int, int], list] = {}
    for e in transfers:
        src_op, dst_op = graph.ops[e.src], graph.ops[e.dst]
        s_uniq, s_cls = _classes(edge_layouts(src_op, configs[e.src], src_op.outputs[e.src_out].axes, mesh))
        d_uniq, d_cls = _classes(edge_layouts(dst_op, configs[e.dst], dst_op.inputs[e.dst_in].axes, mesh))
        tensor = graph.read_spec(dst_op.inputs[e.dst_in])  # moved as the reader reads it (a pooled map)
        if hasattr(model, "edge_prices"):  # seconds and which directions are collectives, in one pass
            cost, syncs = (model.edge_prices(graph, tensor, s_uniq, d_uniq) if mesh is None
                           else model.edge_prices(graph, tensor, s_uniq, d_uniq, mesh=mesh))
        else:
            cost, syncs = model.edge_costs(graph, tensor, s_uniq, d_uniq), None
        merged.setdefault((e.src, e.dst), []).append((s_cls, d_cls, cost, e.tensor, syncs))
    edges = []
    for (src, dst), parts in merged.items():
        if len(parts) == 1:
            s_cls, d_cls, cost, name, syncs = parts[0]
            edges.append(EdgeTable(src, dst, s_cls, d_cls, cost, (name,), syncs))
            continue
        # Several tensors between the same ops: combine into one table over joint layout classes.
        s_joint, s_cls = _classes(np.stack([p[0] for p in parts], axis=1))
        d_joint, d_cls = _classes(np.stack([p[1] for p in parts], axis=1))
        cost = np.zeros((len(s_joint), len(d_joint)))
        syncs = None if parts[0][4] is None else np.zeros(cost.shape, dtype=np.uint8)
        for j, p in enumerate(parts):
            cost += p[2][np.ix_(s_joint[:, j], d_joint[:, j])]
            if syncs is not None:
                syncs |= p[4][np.ix_(s_joint[:, j], d_joint[:, j])]
        edges.append(EdgeTable(src, dst, s_cls, d_cls, cost, tuple(p[3] for p in parts), syncs))
    mesh = getattr(model, "mesh", None)
    return CostTables(graph, devices, model.name, model.unit, tuple(configs), tuple(nodes), tuple(edges),
                      build_seconds=time.perf_counter() - start, mesh=tuple(mesh) if mesh else None)
