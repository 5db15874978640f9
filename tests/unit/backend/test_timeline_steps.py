"""Step boundaries and per-bin step ranges of a timeline window (backend/timeline_steps.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bitguard.backend.timeline_steps import StepIndex, thinning


def test_a_step_begins_where_the_step_number_changes():
    idx = StepIndex.from_steps([0, 0, 0, 1, 1, 2, 2, 2, 3])
    assert idx.starts.tolist() == [0, 3, 5, 8]
    m = idx.marks("seq", 0, 9, None, None)
    assert m["every"] == 1
    assert [(k["step"], k["x"]) for k in m["marks"]] == [(0, 0.0), (1, 3.0), (2, 5.0), (3, 8.0)]
    # a window shows only the boundaries inside it, end excluded
    assert [k["step"] for k in idx.marks("seq", 3, 8, None, None)["marks"]] == [1, 2]


def test_a_missing_step_takes_the_one_before_it():
    idx = StepIndex.from_steps([np.nan, 0, np.nan, 1, np.nan])
    assert idx.step.tolist() == [0, 0, 0, 1, 1]
    assert idx.starts.tolist() == [0, 3]
    assert StepIndex.from_steps([]).starts.tolist() == []


@pytest.mark.parametrize(("n", "every"), [(0, 1), (24, 1), (25, 2), (48, 2), (49, 5), (120, 5), (121, 10),
                                          (2400, 100), (2401, 200)])
def test_thinning_keeps_at_most_24_marks(n, every):
    assert thinning(n) == every
    assert thinning(n, max_marks=40) == thinning(n * 24 / 40)


def test_many_steps_are_thinned_to_round_numbers():
    idx = StepIndex.from_steps(np.repeat(np.arange(100), 3))
    m = idx.marks("seq", 0, 300, None, None)
    assert m["every"] == 5 and [k["step"] for k in m["marks"]][:3] == [0, 5, 10] and len(m["marks"]) == 20
    assert idx.marks("seq", 0, 60, None, None)["every"] == 1  # 20 steps in view: each one


def test_by_time_a_step_begins_at_its_earliest_event_on_each_side():
    idx = StepIndex.from_steps([0, 0, 1, 1, 1])
    a_x = np.array([5.0, 0.0, 30.0, 20.0, 40.0])  # a parent starts before the child that completes first
    b_x = np.array([6.0, 1.0, np.nan, 25.0, 45.0])  # B lacks position 2
    m = idx.marks("time", 0, 100, a_x, b_x)
    assert [(k["step"], k["x"], k["b_x"]) for k in m["marks"]] == [(0, 0.0, 1.0), (1, 20.0, 25.0)]
    assert [k["step"] for k in idx.marks("time", 10, 100, a_x, b_x)["marks"]] == [1]
    only_b = idx.marks("time", 0, 100, np.full(5, np.nan), b_x)["marks"]
    assert [(k["x"], k["b_x"]) for k in only_b] == [(None, 1.0), (None, 25.0)]


def test_each_bin_gives_the_first_and_last_step_of_its_events_on_either_side():
    idx = StepIndex.from_steps([0, 0, 1, 1, 2, 2])
    pos_a, bins_a = np.array([0, 1, 2, 3]), np.array([0, 0, 1, 1])
    pos_b, bins_b = np.array([1, 4, 5]), np.array([0, 1, 3])
    lo, hi = idx.bin_ranges(4, [(pos_a, bins_a), (pos_b, bins_b)])
    assert lo == [0, 1, None, 2] and hi == [0, 2, None, 2]
