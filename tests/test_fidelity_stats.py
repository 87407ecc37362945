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
