"""shardplan: exact planner for parallel training of deep networks.

Front doors, each imported on first use so that ``import shardplan`` stays light (no numpy, no torch):

* ``shardplan.capture(module, example_inputs)``: a PyTorch module's graph IR (``shardplan.capture``);
* ``shardplan.apply(module, plan, device_mesh, example_inputs)``: the module run as the plan says,
  with DTensor (``shardplan.execute.apply_plan``);
* ``shardplan.simulate(graph, cluster, plan)``: the event simulator (``shardplan.simulate``).
"""


def __getattr__(name):
    import importlib

    if name in ("simulate", "SimResult"):
        module = importlib.import_module("shardplan.simulate")
        return module if name == "simulate" else module.SimResult
    if name == "capture":  # the package is callable: shardplan.capture(module, example_inputs)
        return importlib.import_module("shardplan.capture")
    if name == "apply":
        return importlib.import_module("shardplan.execute.apply").apply_plan
    raise AttributeError(f"module 'shardplan' has no attribute {name!r}")
