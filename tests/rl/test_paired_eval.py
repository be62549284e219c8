"""The paired held-out comparison (rl/evaluate.py::paired_difference): the change of pass@1 between
two evaluations on the same rollout seeds, its standard error over the tasks, against hand-worked
numbers and numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from composer_jax.rl.evaluate import format_paired, paired_difference


def test_paired_difference_hand_worked():
    start = {"a": [1.0, 0.0], "b": [0.0, 0.0], "c": [1.0, 1.0], "d": [0.0, None], "gone": [1.0, 1.0]}
    end = {"a": [1.0, 1.0], "b": [1.0, 0.0], "c": [0.0, 1.0], "d": [1.0, 1.0], "new": [0.0, 0.0]}
    p = paired_difference(start, end)
    # per task (end - start, pairs scored in both): a (0 + 1) / 2 = 0.5, b (1 + 0) / 2 = 0.5,
    # c (-1 + 0) / 2 = -0.5, d: its second start sample failed, so one pair: 1.0.
    # diff = 1.5 / 4 = 0.375; deviations 0.125, 0.125, -0.875, 0.625, squares sum 1.1875;
    # sample variance 1.1875 / 3, se = sqrt(1.1875 / 3 / 4) = 0.3145764...
    assert p["tasks"] == 4 and p["pairs"] == 7
    assert p["diff"] == pytest.approx(0.375)
    assert p["se"] == pytest.approx(0.31457643, abs=1e-8)
    assert p["z"] == pytest.approx(0.375 / 0.31457643, abs=1e-6)
    assert format_paired(p) == "+0.375 (se 0.315, z 1.19; 4 tasks, 7 pairs)"


def test_paired_difference_matches_numpy_and_differs_from_unpaired():
    rng = np.random.default_rng(7)
    n, k = 64, 2
    skill = rng.uniform(0.0, 1.0, size=n)  # a task's own difficulty: its samples move together
    start = (rng.uniform(size=(n, k)) < skill[:, None]).astype(float)
    end = np.where(rng.uniform(size=(n, k)) < 0.15, 1.0, start)  # some failures turn into successes
    p = paired_difference({f"t{i}": list(start[i]) for i in range(n)}, {f"t{i}": list(end[i]) for i in range(n)})
    d = (end - start).mean(axis=1)
    assert p["diff"] == pytest.approx((end - start).mean()) == pytest.approx(end.mean() - start.mean())
    assert p["se"] == pytest.approx(d.std(ddof=1) / math.sqrt(n))
    # the same rates compared as independent binomials have a larger std: pairing removes the tasks' spread
    unpaired = math.sqrt((start.mean() * (1 - start.mean()) + end.mean() * (1 - end.mean())) / (n * k))
    assert p["se"] < unpaired


def test_paired_difference_degenerate_cases():
    same = {"a": [1.0, 0.0], "b": [0.0, 0.0]}
    p = paired_difference(same, same)
    assert p["diff"] == 0.0 and p["se"] == 0.0 and "z" not in p  # no spread: z is undefined, not reported
    one = paired_difference({"a": [0.0, 0.0]}, {"a": [1.0, 0.0]})
    assert one == {"tasks": 1.0, "pairs": 2.0, "diff": 0.5}  # one task: no standard error
    assert format_paired(one) == "+0.500 (1 tasks, 2 pairs)"
    none = paired_difference({"a": [None]}, {"a": [1.0]})
    assert none == {"tasks": 0.0, "pairs": 0.0} and format_paired(none).startswith("n/a")
