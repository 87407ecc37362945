"""A plan as a value: which way every op is split, what it is expected to cost, and JSON for both.

A plan names its model, device count, cluster and cost model, and for every op its split factor
per iteration dim. The estimate is kept with it (cost, per-device breakdown, baselines), so a plan
file is a complete record of a planning run. ``Plan.to_choice(tables)`` maps a plan back onto the
cost tables of a graph and refuses, naming the op, a plan made for a different model.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field

from shardplan.cost.tables import CostTables
from shardplan.ir.graph import GraphError

SCHEMA_VERSION = 1


class PlanError(ValueError):
    """A plan file that cannot be read, or that does not match the model it is applied to."""


def _parse_json(text: str, source: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{source}: not valid JSON ({exc})") from None


@contextlib.contextmanager
def _fields(source: str, what: str):
    """Turn a missing or ill-typed field met while reading ``source`` into a PlanError naming it."""
    try:
        yield
    except KeyError as exc:
        raise PlanError(f"{source}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        raise PlanError(f"{source}: malformed {what} ({exc})") from None


@dataclass(frozen=True)
class OpPlan:
    name: str
    kind: str
    split: tuple[tuple[str, int], ...]
    """(dim, factor) for every iteration dim, in the op's dim order (factor 1 = not split)."""

    @property
    def devices(self) -> int:
        out = 1
        for _, f in self.split:
            out *= f
        return out

    def describe(self) -> str:
        parts = [f"{d}={f}" for d, f in self.split if f > 1]
        return " ".join(parts) or "replicated"


@dataclass(frozen=True)
class Plan:
    model: str
    devices: int
    cost_model: str
    unit: str
    cluster: str | None
    ops: tuple[OpPlan, ...]
    cost: float
    optimal: bool
    lower_bound: float
    method: str
    breakdown: dict = field(default_factory=dict, hash=False)
    baselines: dict = field(default_factory=dict, hash=False)
    search_seconds: float = 0.0
    note: str = ""
    mesh: tuple[int, ...] | None = None
    """The device mesh the plan was made for (``--mesh``), which the runtime runs it on; None: the
    runtime chooses (``execute.apply.choose_mesh``)."""

    @staticmethod
    def from_choice(tables: CostTables, choice, *, cluster: str | None = None, method: str = "exact",
                    optimal: bool = True, lower_bound: float | None = None, baselines: dict | None = None,
                    search_seconds: float = 0.0, note: str = "") -> "Plan":
        ops = []
        for op, cfgs, c in zip(tables.graph.ops, tables.configs, choice):
            ops.append(OpPlan(op.name, op.kind, tuple((d.name, int(f)) for d, f in zip(op.dims, cfgs[c]))))
        cost = tables.cost_of(choice)
        return Plan(tables.graph.name, tables.devices, tables.model_name, tables.unit, cluster, tuple(ops), cost,
                    optimal, cost if lower_bound is None else lower_bound, method, tables.breakdown(list(choice)),
                    dict(baselines or {}), search_seconds, note, getattr(tables, "mesh", None))

    def check_graph(self, graph) -> None:
        """PlanError, naming the first op that differs, if this plan was made for another graph."""
        if len(self.ops) != len(graph.ops):
            raise PlanError(f"plan is for {self.model!r} with {len(self.ops)} ops; model {graph.name!r} has "
                            f"{len(graph.ops)} ops")
        for i, (p, op) in enumerate(zip(self.ops, graph.ops)):
            dims = tuple(d for d, _ in p.split)
            if p.name != op.name or dims != op.dim_names:
                raise PlanError(f"plan op {i} is {p.name!r} with dims {dims}; model {graph.name!r} has "
                                f"{op.name!r} with dims {op.dim_names}")

    def to_choice(self, tables: CostTables) -> list[int]:
        """Configuration indices of this plan in ``tables``; PlanError if the plan does not match."""
        graph = tables.graph
        if len(self.ops) == len(graph.ops) and self.devices != tables.devices:
            raise PlanError(f"plan is for {self.devices} devices, not {tables.devices}")
        self.check_graph(graph)
        choice = []
        for i, p in enumerate(self.ops):
            try:
                choice.append(tables.index_of(i, tuple(f for _, f in p.split)))
            except GraphError as exc:
                raise PlanError(str(exc)) from None
        return choice

    def mesh_view(self, graph, mesh: tuple[int, ...] | None = None):
        """(mesh shape, per-op mesh axes) for execution; see ``cluster.mesh``."""
        from shardplan.cluster.mesh import MeshError, assign, default_mesh

        mesh = tuple(mesh) if mesh else default_mesh(self.devices)
        size = 1
        for a in mesh:
            size *= a
        if size != self.devices:
            raise MeshError(f"mesh {'x'.join(map(str, mesh))} has {size} devices; the plan is for {self.devices}")
        return mesh, [assign(op, tuple(f for _, f in p.split), mesh) for p, op in zip(self.ops, graph.ops)]

    # -- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION, "model": self.model, "devices": self.devices,
            "cost_model": self.cost_model, "unit": self.unit, "cluster": self.cluster, "cost": self.cost,
            "optimal": self.optimal,
            "lower_bound": self.lower_bound if math.isfinite(self.lower_bound) else None, "method": self.method,
            "search_seconds": self.search_seconds, "note": self.note,
            "layers": [{"name": o.name, "kind": o.kind, "split": {d: f for d, f in o.split if f > 1},
                        "dims": [d for d, _ in o.split]} for o in self.ops],
            "breakdown": self.breakdown, "baselines": self.baselines,
            **({"mesh": list(self.mesh)} if self.mesh else {}),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(raw: dict, source: str = "plan") -> "Plan":
        if not isinstance(raw, dict):
            raise PlanError(f"{source}: expected a JSON object")
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(f"{source}: schema_version {version!r} is not supported (this shardplan reads "
                            f"version {SCHEMA_VERSION})")
        with _fields(source, "plan"):
            ops = tuple(OpPlan(layer["name"], layer["kind"],
                               tuple((d, int(layer["split"].get(d, 1))) for d in layer["dims"]))
                        for layer in raw["layers"])
            return Plan(raw["model"], int(raw["devices"]), raw["cost_model"], raw["unit"], raw.get("cluster"),
                        ops, float(raw["cost"]), bool(raw["optimal"]), -math.inf if raw["lower_bound"] is None else float(raw["lower_bound"]), raw["method"],
                        dict(raw.get("breakdown", {})), dict(raw.get("baselines", {})),
                        float(raw.get("search_seconds", 0.0)), raw.get("note", ""),
                        tuple(int(a) for a in raw["mesh"]) if raw.get("mesh") else None)

    @staticmethod
    def from_json(text: str, source: str = "plan") -> "Plan":
        return Plan.from_dict(_parse_json(text, source), source)

    @staticmethod
    def load(path: str) -> "Plan":
        try:
            with open(path) as fh:
                return Plan.from_json(fh.read(), source=f"plan file {path!r}")
        except OSError as exc:
            raise PlanError(f"plan file {path!r}: {exc.strerror}") from None


PIPELINE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class StageRecord:
    """One pipeline stage (layers inclusive, -1 / L stand for embeddings / head; mesh is data x tensor),
    as the stage search returns it and a :class:`PipelinePlan` stores it."""

    layers: tuple[int, int]
    data_parallel: int
    tensor_parallel: int
    recompute: str
    zero: int
    seconds_per_microbatch: float
    memory_bytes: float

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.data_parallel, self.tensor_parallel)


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline plan as a value: stages on sub-meshes, microbatches, schedule, estimate, baselines."""

    model: str
    devices: int
    cluster: str | None
    batch: int
    stages: tuple[StageRecord, ...]
    num_microbatches: int
    schedule: str
    cost: float
    bubble_fraction: float
    peak_memory_bytes: float
    baselines: dict = field(default_factory=dict, hash=False)
    search_seconds: float = 0.0
    unit: str = "seconds"
    chunks: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B: ``stages`` lists the p x v chunks in pipeline
    order, chunk j on rank j mod p); 1 for GPipe and 1F1B."""

    @property
    def pipeline_ranks(self) -> int:
        return len(self.stages) // self.chunks

    @staticmethod
    def from_result(result, cluster: str | None = None, baselines: dict | None = None) -> "PipelinePlan":
        """From ``shardplan.search.pipeline.PipelineResult``."""
        return PipelinePlan(result.model, result.devices, cluster, result.batch, tuple(result.stages),
                            result.num_microbatches,
                            result.schedule, result.iteration_seconds, result.bubble_fraction,
                            result.peak_memory_bytes, dict(baselines or {}), result.search_seconds,
                            chunks=getattr(result, "chunks", 1))

    def to_dict(self) -> dict:
        return {"kind": "pipeline", "schema_version": PIPELINE_SCHEMA_VERSION, "model": self.model,
                "devices": self.devices, "cluster": self.cluster, "batch": self.batch, "unit": self.unit,
                "cost": self.cost, "num_microbatches": self.num_microbatches, "schedule": self.schedule,
                "chunks": self.chunks,
                "bubble_fraction": self.bubble_fraction, "peak_memory_bytes": self.peak_memory_bytes,
                "search_seconds": self.search_seconds, "baselines": self.baselines,
                "stages": [{"layers": list(s.layers), "mesh_shape": list(s.mesh_shape),
                            "data_parallel": s.data_parallel, "tensor_parallel": s.tensor_parallel,
                            "recompute": s.recompute, "zero": s.zero,
                            "seconds_per_microbatch": s.seconds_per_microbatch, "memory_bytes": s.memory_bytes}
                           for s in self.stages]}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(raw: dict, source: str = "pipeline plan") -> "PipelinePlan":
        if not isinstance(raw, dict) or raw.get("kind") != "pipeline":
            raise PlanError(f"{source}: not a pipeline plan (expected \"kind\": \"pipeline\")")
        if raw.get("schema_version") != PIPELINE_SCHEMA_VERSION:
            raise PlanError(f"{source}: pipeline schema_version {raw.get('schema_version')!r} is not supported "
                            f"(this shardplan reads version {PIPELINE_SCHEMA_VERSION})")
        with _fields(source, "pipeline plan"):
            stages = tuple(StageRecord((int(s["layers"][0]), int(s["layers"][1])), int(s["data_parallel"]),
                                       int(s["tensor_parallel"]), str(s["recompute"]), int(s["zero"]),
                                       float(s["seconds_per_microbatch"]), float(s["memory_bytes"]))
                           for s in raw["stages"])
            return PipelinePlan(raw["model"], int(raw["devices"]), raw.get("cluster"), int(raw["batch"]), stages,
                                int(raw["num_microbatches"]), raw["schedule"], float(raw["cost"]),
                                float(raw["bubble_fraction"]), float(raw["peak_memory_bytes"]),
                                dict(raw.get("baselines", {})), float(raw.get("search_seconds", 0.0)),
                                raw.get("unit", "seconds"), int(raw.get("chunks", 1)))

    @staticmethod
    def from_json(text: str, source: str = "pipeline plan") -> "PipelinePlan":
        return PipelinePlan.from_dict(_parse_json(text, source), source)
