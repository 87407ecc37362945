"""Strategy search. ``solve`` is the front door (exact search under a memory cap and a time limit);
``exact``, ``brute_force`` and ``baselines`` are the algorithms behind it."""

from shardplan.search.exact import ExactResult, SearchInterrupted, exact_search
from shardplan.search.solve import PlanDoesNotFit, Solution, solve

__all__ = ["ExactResult", "PlanDoesNotFit", "SearchInterrupted", "Solution", "exact_search", "solve"]
