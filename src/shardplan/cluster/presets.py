"""Named clusters and cluster files (YAML or JSON).

Datasheet figures; bandwidths are per device, one direction. Sources:
* GTX 1080 Ti: 11.3 TFLOP/s fp32, 11 GB GDDR5X at 484 GB/s; RTX 2080 Ti: 13.4 TFLOP/s fp32, 11 GB at
  616 GB/s (NVIDIA specifications). PaSE's clusters (IPDPS 2021, section VI): 8 GPUs per node on
  PCIe 3.0 x16 (about 12 GB/s; the 2080 Ti has no peer-to-peer access, so copies go through the host,
  about half that), nodes on 100 Gb/s EDR InfiniBand (12.5 GB/s).
* DGX A100: A100-SXM4-80GB, 312 TFLOP/s bf16 dense, 2.04 TB/s HBM2e, NVLink 3 at 300 GB/s per
  direction; 8 HDR 200 Gb/s NICs, so 25 GB/s per GPU between nodes.
* DGX H100: H100-SXM5-80GB, 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 at 450 GB/s per
  direction; 8 NDR 400 Gb/s NICs, so 50 GB/s per GPU between nodes.
Latencies are typical NCCL per-step figures (a few microseconds in a node, about 10 us across).

A cluster file::

    name: my-a100s
    device: {name: A100, peak_flops: 312e12, memory_bytes: 80e9, memory_bandwidth: 2.0e12}
    levels:
      - {name: nvlink, fanout: 8, bandwidth: 300e9, latency: 3e-6}
      - {name: infiniband, fanout: 4, bandwidth: 25e9, latency: 10e-6}
"""

from __future__ import annotations

import json
import os
from typing import Any

from shardplan.cluster.model import Cluster, ClusterError, Device, Level

GB = 1e9
T = 1e12

PRESETS: dict[str, Cluster] = {
    "pase-1080ti": Cluster("pase-1080ti", Device("GTX 1080 Ti", 11.3 * T, 11 * GB, 484 * GB),
                           (Level("pcie", 8, 12 * GB, 5e-6), Level("infiniband", 8, 12.5 * GB, 10e-6))),
    "pase-2080ti": Cluster("pase-2080ti", Device("RTX 2080 Ti", 13.4 * T, 11 * GB, 616 * GB),
                           (Level("pcie-via-host", 8, 6 * GB, 10e-6), Level("infiniband", 8, 12.5 * GB, 10e-6))),
    "dgx-a100": Cluster("dgx-a100", Device("A100-SXM4-80GB", 312 * T, 80 * GB, 2039 * GB),
                        (Level("nvlink", 8, 300 * GB, 3e-6), Level("infiniband", 1, 25 * GB, 10e-6))),
    "dgx-h100": Cluster("dgx-h100", Device("H100-SXM5-80GB", 989 * T, 80 * GB, 3350 * GB),
                        (Level("nvlink", 8, 450 * GB, 3e-6), Level("infiniband", 1, 50 * GB, 10e-6))),
}
"""Built-in clusters. One node each; ``get_cluster(name, nodes=N)`` or ``devices=`` scales them."""

DESCRIPTIONS = {
    "pase-1080ti": "PaSE's GTX 1080 Ti cluster: 8 per node on PCIe, EDR InfiniBand",
    "pase-2080ti": "PaSE's RTX 2080 Ti cluster: no peer-to-peer, EDR InfiniBand",
    "dgx-a100": "DGX A100 80GB: 8 per node on NVLink 3, 8x HDR InfiniBand",
    "dgx-h100": "DGX H100 80GB: 8 per node on NVLink 4, 8x NDR InfiniBand",
}


def get_cluster(name_or_path: str, nodes: int | None = None, devices: int | None = None) -> Cluster:
    """A preset by name or a cluster file by path, scaled to ``nodes`` nodes or enough for ``devices``."""
    if name_or_path in PRESETS:
        cluster = PRESETS[name_or_path]
    elif os.path.exists(name_or_path) or name_or_path.endswith((".yaml", ".yml", ".json")):
        cluster = load_cluster(name_or_path)
    else:
        raise ClusterError(f"unknown cluster {name_or_path!r}; presets: {', '.join(sorted(PRESETS))} "
                           "(or give a .yaml/.json cluster file)")
    if nodes is not None:
        if not isinstance(nodes, int) or nodes < 1:
            raise ClusterError(f"nodes must be a positive integer, got {nodes!r}")
        if len(cluster.levels) < 2:
            raise ClusterError(f"cluster {cluster.name!r} has a single level; --nodes needs a multi-node cluster")
        cluster = cluster.with_devices(nodes * cluster.spans[-2])
    if devices is not None:
        if devices > cluster.num_devices and nodes is not None:
            raise ClusterError(f"{devices} devices requested but cluster {cluster.name!r} with {nodes} nodes "
                               f"has {cluster.num_devices}")
        if devices > cluster.num_devices or nodes is None:
            cluster = cluster.with_devices(devices)
    return cluster


_DEVICE_FIELDS = {"name": str, "peak_flops": float, "memory_bytes": float, "memory_bandwidth": float,
                  "efficiency": float, "op_overhead": float, "conv_efficiency": float, "gemm_efficiency": list,
                  "conv_reduction_efficiency": list, "conv_rows_efficiency": list,
                  "split_op_overhead": float, "sync_stretch": float, "sync_jitter": float, "sync_jitter_horizon": float,
                  "sync_jitter_exponent": float,
                  "pool_bandwidth": float, "elementwise_bandwidth": float, "redistribute_overhead": float,
                  "all_to_all_by_gather": bool}
_LEVEL_FIELDS = {"name": str, "fanout": int, "bandwidth": float, "latency": float, "gather_bandwidth": float,
                 "gather_latency": float, "all_to_all_bandwidth": float, "all_to_all_latency": float}


def _fields(where: str, raw: Any, spec: dict[str, type], required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ClusterError(f"{where} must be a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(spec))
    if unknown:
        raise ClusterError(f"{where}: unknown field {unknown[0]!r}; expected {', '.join(spec)}")
    missing = [f for f in required if f not in raw]
    if missing:
        raise ClusterError(f"{where}: missing field {missing[0]!r}")
    out = {}
    for key, value in raw.items():
        kind = spec[key]
        if kind is str:
            out[key] = str(value)
            continue
        if kind is bool:
            if not isinstance(value, bool):
                raise ClusterError(f"{where}.{key} must be true or false, got {value!r}")
            out[key] = value
            continue
        if kind in (dict, list):
            if not isinstance(value, kind):
                raise ClusterError(f"{where}: field {key!r} must be a {'mapping' if kind is dict else 'list'}")
            out[key] = value
            continue
        if isinstance(value, bool):
            raise ClusterError(f"{where}.{key} must be a number, got {value!r}")
        try:
            number = float(value)  # YAML reads 312e12 as a string; accept it
        except (TypeError, ValueError):
            raise ClusterError(f"{where}.{key} must be a number, got {value!r}") from None
        if kind is int:
            if number != int(number):
                raise ClusterError(f"{where}.{key} must be an integer, got {value!r}")
            number = int(number)
        out[key] = number
    return out


def cluster_from_dict(raw: Any, source: str = "cluster") -> Cluster:
    """Validate a parsed cluster file; every error names the bad field."""
    top = _fields(source, raw, {"name": str, "device": dict, "levels": list}, ("device", "levels"))
    dev = _fields(f"{source}: device", raw["device"], _DEVICE_FIELDS,
                  ("peak_flops", "memory_bytes", "memory_bandwidth"))
    dev.setdefault("name", "device")
    levels_raw = raw["levels"]
    if not isinstance(levels_raw, list) or not levels_raw:
        raise ClusterError(f"{source}: levels must be a non-empty list")
    levels = []
    for i, lv in enumerate(levels_raw):
        f = _fields(f"{source}: levels[{i}]", lv, _LEVEL_FIELDS, ("fanout", "bandwidth"))
        f.setdefault("name", f"level{i}")
        f.setdefault("latency", 0.0)
        try:
            levels.append(Level(**f))
        except ClusterError as exc:
            raise ClusterError(f"{source}: levels[{i}]: {exc}") from None
    for curve in ("gemm_efficiency", "conv_reduction_efficiency", "conv_rows_efficiency"):
        if curve in dev:
            try:
                dev[curve] = tuple((float(m), float(e)) for m, e in dev[curve])
            except (TypeError, ValueError):
                raise ClusterError(f"{source}: device.{curve} must be a list of [size, efficiency] pairs, "
                                   f"got {dev[curve]!r}") from None
    try:
        device = Device(**dev)
    except ClusterError as exc:
        raise ClusterError(f"{source}: {exc}") from None
    return Cluster(top.get("name", os.path.basename(source)), device, tuple(levels))


def load_cluster(path: str) -> Cluster:
    """Read a YAML or JSON cluster file."""
    if not os.path.exists(path):
        raise ClusterError(f"cluster file {path!r} does not exist")
    with open(path) as fh:
        text = fh.read()
    try:
        if path.endswith(".json"):
            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text)
    except (json.JSONDecodeError, Exception) as exc:  # yaml.YAMLError and friends
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ClusterError(f"cluster file {path!r} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                           f"{first}") from None
    return cluster_from_dict(raw, source=f"cluster file {path!r}")


def cluster_to_dict(cluster: Cluster) -> dict:
    d = cluster.device
    return {"name": cluster.name,
            "device": {"name": d.name, "peak_flops": d.peak_flops, "memory_bytes": d.memory_bytes,
                       "memory_bandwidth": d.memory_bandwidth, "efficiency": d.efficiency,
                       "op_overhead": d.op_overhead, "conv_efficiency": d.conv_efficiency,
                       **{curve: [list(q) for q in getattr(d, curve)] for curve in
                          ("gemm_efficiency", "conv_reduction_efficiency", "conv_rows_efficiency")
                          if getattr(d, curve)},
                       **({"split_op_overhead": d.split_op_overhead} if d.split_op_overhead is not None else {}),
                       **({"sync_stretch": d.sync_stretch} if d.sync_stretch else {}),
                       **({"sync_jitter": d.sync_jitter} if d.sync_jitter else {}),
                       **({"sync_jitter_horizon": d.sync_jitter_horizon} if d.sync_jitter_horizon else {}),
                       **({"sync_jitter_exponent": d.sync_jitter_exponent} if d.sync_jitter_exponent != 0.5 else {}),
                       **({"pool_bandwidth": d.pool_bandwidth} if d.pool_bandwidth is not None else {}),
                       **({"elementwise_bandwidth": d.elementwise_bandwidth}
                          if d.elementwise_bandwidth is not None else {}),
                       **({"redistribute_overhead": d.redistribute_overhead} if d.redistribute_overhead else {}),
                       **({"all_to_all_by_gather": True} if d.all_to_all_by_gather else {})},
            "levels": [{"name": lv.name, "fanout": lv.fanout, "bandwidth": lv.bandwidth, "latency": lv.latency,
                        **({"gather_bandwidth": lv.gather_bandwidth} if lv.gather_bandwidth is not None else {}),
                        **({"gather_latency": lv.gather_latency} if lv.gather_latency is not None else {}),
                        **({"all_to_all_bandwidth": lv.all_to_all_bandwidth}
                           if lv.all_to_all_bandwidth is not None else {}),
                        **({"all_to_all_latency": lv.all_to_all_latency} if lv.all_to_all_latency is not None else {})}
                       for lv in cluster.levels]}
