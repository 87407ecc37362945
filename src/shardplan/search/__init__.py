"""Strategy search. ``solve`` is the front door (exact search under a memory cap and a time limit);
``exact``, ``brute_force`` and ``baselines`` are the algorithms behind it. The rival methods, for
comparison: ``ilp_search`` (integer program, HiGHS), ``mcmc_search`` (FlexFlow's Metropolis-Hastings)
and ``optcnn_search`` (OptCNN's graph reduction, series-parallel graphs only)."""

from shardplan.search.exact import ExactResult, SearchInterrupted, exact_search
from shardplan.search.solve import PlanDoesNotFit, Solution, solve
from shardplan.search.ilp import ilp_search
from shardplan.search.mcmc import mcmc_search
from shardplan.search.optcnn import NotReducible, optcnn_search

__all__ = ["ExactResult", "NotReducible", "PlanDoesNotFit", "SearchInterrupted", "Solution", "exact_search",
           "ilp_search", "mcmc_search", "optcnn_search", "solve"]
