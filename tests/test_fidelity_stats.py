"""The fidelity benchmark's statistics (``benchmarks/fidelity.py``) against hand calculations."""

import importlib.util
import pathlib

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "fidelity", pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "fidelity.py")
fidelity = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fidelity)


def test_kendall_tau_b_by_hand():
    assert fidelity.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert fidelity.kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    # one swapped pair of six: (5 - 1) / 6
    assert fidelity.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # a tie in the prediction counts for neither side: 5 pairs, all agreeing, over sqrt(5 x 6)
    assert fidelity.kendall_tau([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / (5 * 6) ** 0.5)


def test_discordant_pairs_by_hand():
    """Predicted a < b < c, measured c < b < a (a 10% over b, b 1% over c): the pairs the two
    rankings order oppositely, with both ratios, the one measured furthest apart first; a tie in either
    ranking is no disagreement."""
    names = ["a", "b", "c"]
    pairs = fidelity.discordant(names, [1.0, 2.0, 3.0], [1.1, 1.0, 0.99])
    assert [(a, b) for a, b, *_ in pairs] == [("a", "c"), ("a", "b"), ("b", "c")]
    assert pairs[1][2:] == pytest.approx((1.1, 0.5))
    assert pairs[2][2:] == pytest.approx((1.0 / 0.99, 2.0 / 3.0))
    assert fidelity.discordant(names, [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == []
    assert fidelity.discordant(names, [1.0, 1.0, 3.0], [2.0, 1.0, 3.0]) == []


def test_paired_ranking_cancels_drift_between_rounds():
    """Plan b takes twice plan a's time in every round while the machine slows 10x from round to
    round: each over its round's geometric mean is 1/sqrt(2) and sqrt(2), whatever the drift."""
    a = [1.0, 10.0, 100.0]
    rel = fidelity.paired([a, [2 * x for x in a]])
    assert rel == pytest.approx([2 ** -0.5, 2 ** 0.5])


def test_resampled_rounds_bound_tau():
    """Rounds that all rank the plans as predicted give tau 1 in every draw; rounds that all rank them
    the other way, -1; rounds that disagree among themselves give an interval that spans both signs."""
    pred = [1.0, 2.0, 3.0]
    agree = [[1.0 + 0.1 * k for k in range(20)], [2.0 + 0.1 * k for k in range(20)], [3.0 + 0.1 * k for k in range(20)]]
    assert fidelity.bootstrap_tau(pred, agree, draws=50) == ((1.0, 1.0), (1.0, 1.0))
    assert fidelity.bootstrap_tau(pred[::-1], agree, draws=50) == ((-1.0, -1.0), (-1.0, -1.0))
    mixed = [[1.0, 3.0] * 10, [2.0, 2.0] * 10, [3.0, 1.0] * 10]
    (lo, hi), _ = fidelity.bootstrap_tau(pred, mixed, draws=200)
    assert lo < 0 < hi


def test_reprice_prices_saved_plans_again_and_measures_them_as_the_benchmark_does(tmp_path):
    """A saved run of two CNN plans (a cluster file with a jitter, the plan files, two launches'
    records, gzipped as ``fidelity.py --out`` writes them): ``reprice.py`` prices each plan again at
    ``step_seconds`` of the saved cluster, and at the tables' cost once ``--set sync_jitter=0``
    takes the waits away; its best steps, paired figures and medians are the benchmark's, by hand."""
    import dataclasses
    import gzip
    import json
    import sys

    import yaml

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    spec = importlib.util.spec_from_file_location("reprice", pathlib.Path(sys.path[0]) / "reprice.py")
    reprice = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reprice)

    from shardplan.capture import capture
    from shardplan.capture.models import build, parse_config
    from shardplan.cluster import get_cluster
    from shardplan.cluster.presets import cluster_to_dict
    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.step import step_seconds
    from shardplan.cost.tables import build_tables
    from shardplan.execute.launch import RUN_OPTIMIZER
    from shardplan.execute.plans import replicated
    from shardplan.plan import Plan
    from shardplan.search.baselines import data_parallel

    base = get_cluster("dgx-a100", devices=2)
    cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, sync_jitter=0.02))
    (tmp_path / "calibrated-torch_cnn.yaml").write_text(yaml.safe_dump(cluster_to_dict(cluster)))
    config, batch, seq = fidelity.MODELS["torch_cnn"]
    module, kwargs = build("torch_cnn", batch=batch, seq=seq, **parse_config(config))
    model = AnalyticCostModel(cluster, optimizer=RUN_OPTIMIZER)
    tables = build_tables(capture(module, (), kwargs, name="torch_cnn"), model, 2)
    plans = {"data_parallel": data_parallel(tables), "replicated": replicated(tables)}
    steps = {"data_parallel": [[1.0, 3.0, 2.0], [1.5, 2.5, 2.0]], "replicated": [[2.0, 3.0, 5.0], [2.0, 6.0, 1.0]]}
    records = {}
    for name, choice in plans.items():
        (tmp_path / f"torch_cnn-{name}.json").write_text(Plan.from_choice(tables, list(choice)).to_json())
        records[name] = [{"devices": 2, "predicted_step_seconds": 9.0, "step_seconds": s, "best_step_seconds": min(s),
                          "measured_step_seconds": sorted(s)[1]} for s in steps[name]]
    with gzip.open(tmp_path / "torch_cnn-runs.json.gz", "wt") as fh:
        json.dump(records, fh)

    assert reprice.reprice(str(tmp_path), "torch_cnn", {}) == pytest.approx(
        [step_seconds(model, tables, list(c)) for c in plans.values()], rel=1e-12)
    assert reprice.reprice(str(tmp_path), "torch_cnn", reprice.overrides(["sync_jitter=0"])) == pytest.approx(
        [tables.cost_of(list(c)) for c in plans.values()], rel=1e-12)
    best, rel, median = reprice.measured(reprice.load_records(str(tmp_path), "torch_cnn"), list(plans))
    assert best == [1.0, 1.0] and median == [2.0, 2.0]  # each plan's fastest launch median
    # rounds (dp, rep): (1, 2) (3, 3) (2, 5) (1.5, 2) (2.5, 6) (2, 1): data parallel's ratio to the
    # geometric mean is sqrt(dp / rep) per round: 1/sqrt(2), 1, sqrt(.4), sqrt(.75), sqrt(5/12), sqrt(2),
    # whose median (of the logs: the geometric mean of the middle two) is (0.5 x 0.75)^(1/4)
    ratios = sorted([0.5 ** 0.5, 1.0, 0.4 ** 0.5, 0.75 ** 0.5, (2.5 / 6) ** 0.5, 2 ** 0.5])
    assert rel[0] == pytest.approx((ratios[2] * ratios[3]) ** 0.5) == pytest.approx((0.5 * 0.75) ** 0.25)
    with pytest.raises(SystemExit, match="no field 'jitter'"):
        reprice.overrides(["jitter=1"])
