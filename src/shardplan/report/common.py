"""What the ``shardplan`` commands share: the usage error, flag checks, the cost model the flags name
and JSON output."""

from __future__ import annotations

import argparse
import json
import math

from shardplan.cluster import PRESETS, ClusterError, get_cluster
from shardplan.cost.analytic import AnalyticCostModel
from shardplan.cost.pase import PaseCostModel

COST_MODELS = ("analytic", "pase")
DEFAULT_CLUSTER = "dgx-a100"


class UsageError(Exception):
    """A bad flag, file or plan: printed as one line, exit status 2."""


def positive(flag: str, value):
    if value is not None and value <= 0:
        raise UsageError(f"{flag} must be positive, got {value}")


def cost_model(args: argparse.Namespace):
    """(cost model, cluster or None, devices) from the flags."""
    if args.cost_model not in COST_MODELS:
        raise UsageError(f"unknown cost model {args.cost_model!r}; available: {', '.join(COST_MODELS)}")
    positive("--devices", args.devices)
    positive("--nodes", args.nodes)
    cluster = None
    if args.cluster is not None or args.cost_model == "analytic" or args.nodes is not None:
        try:
            cluster = get_cluster(args.cluster or DEFAULT_CLUSTER, nodes=args.nodes, devices=args.devices)
        except ClusterError as exc:
            raise UsageError(str(exc)) from None
    devices = args.devices
    if devices is None:
        if cluster is None or (args.nodes is None and args.cluster in (None, *PRESETS)):
            raise UsageError("--devices is required (or give --nodes, or a cluster file, to use a whole cluster)")
        devices = cluster.num_devices
    mesh = parse_mesh(getattr(args, "mesh", None), devices)
    if args.cost_model == "pase":
        if mesh is not None:
            raise UsageError("--mesh limits the analytic model's search; PaSE's model splits freely")
        if cluster is None:
            return PaseCostModel(), None, devices
        return PaseCostModel.from_machine(cluster.device.peak_flops, cluster.levels[0].bandwidth), cluster, devices
    return AnalyticCostModel(cluster, mesh=mesh), cluster, devices


def parse_mesh(text: str | None, devices: int) -> tuple[int, ...] | None:
    """``--mesh 8x8`` -> (8, 8), checked against the device count; None when not given or ``auto``
    (which the caller handles: every mesh is tried)."""
    if not text or text == "auto":
        return None
    try:
        mesh = tuple(int(a) for a in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--mesh: expected sizes joined by x, such as 8x8 or 2x4x8; got {text!r}") from None
    if any(a < 1 for a in mesh):
        raise UsageError(f"--mesh {text}: every axis needs at least one device")
    if math.prod(mesh) != devices:
        raise UsageError(f"--mesh {text} holds {math.prod(mesh)} devices; planning for {devices}")
    return mesh


def write_json(args, out: dict) -> bool:
    """``--json -`` prints ``out`` and returns True (nothing else is printed); ``--json FILE`` writes it."""
    if args.json == "-":
        print(json.dumps(out))
        return True
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return False
