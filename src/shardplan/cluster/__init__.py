"""The machine: devices and the network levels that join them (see ``cluster.model``)."""

from shardplan.cluster.model import Cluster, ClusterError, Device, Level, collective_seconds
from shardplan.cluster.presets import PRESETS, get_cluster, load_cluster

__all__ = ["Cluster", "ClusterError", "Device", "Level", "PRESETS", "collective_seconds", "get_cluster",
           "load_cluster"]
