"""shardplan: exact planner for parallel training of deep networks.

``shardplan.simulate(graph, cluster, plan)`` runs the event simulator (``shardplan.simulate``);
it is imported on first use, so ``import shardplan`` stays light (no numpy, no torch).
"""


def __getattr__(name):
    if name in ("simulate", "SimResult"):
        import importlib

        module = importlib.import_module("shardplan.simulate")
        return module if name == "simulate" else module.SimResult
    raise AttributeError(f"module 'shardplan' has no attribute {name!r}")
