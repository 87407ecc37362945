"""Run plans on PyTorch's distributed engine (imports torch; the planner core does not)."""

from shardplan.execute.apply import ApplyError, ParallelModule, apply, apply_plan

__all__ = ["ApplyError", "ParallelModule", "apply", "apply_plan"]
