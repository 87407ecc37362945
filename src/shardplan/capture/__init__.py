"""From PyTorch to the graph IR (imports torch; the planner core does not)."""

from shardplan.capture.export import CaptureError, capture

__all__ = ["CaptureError", "capture"]
