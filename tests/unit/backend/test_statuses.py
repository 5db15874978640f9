"""The timeline's status vocabulary and the worst status per bin (backend/statuses.py), and the
server's binned windows built on them (backend/timelines.py), on a synthetic frame."""

from __future__ import annotations

import numpy as np
import polars as pl

from bitguard.backend.result import EVENT_STATUSES
from bitguard.backend.statuses import CODE_OF_EVENT, STATUS_CODES, STATUS_OF_EVENT, bin_counts, worst
from bitguard.backend.timelines import RankTimeline


def test_every_event_status_has_a_code_and_one_sided_events_are_gaps():
    assert set(STATUS_OF_EVENT) == set(EVENT_STATUSES)
    assert set(STATUS_OF_EVENT.values()) <= set(STATUS_CODES)
    assert STATUS_OF_EVENT["only_a"] == STATUS_OF_EVENT["only_b"] == "gap"
    # severity: diverged is the worst, then a gap, then what cannot be certified, identical the least
    order = [STATUS_CODES.index(s) for s in ("empty", "identical", "benign", "follows", "unobserved", "gap", "diverged")]
    assert order == sorted(order)


def test_a_bin_shows_the_worst_status_it_holds_and_empty_when_it_holds_nothing():
    code = np.array([CODE_OF_EVENT[s] for s in ("identical", "diverged", "benign", "only_b", "identical")])
    counts = bin_counts(np.array([0, 0, 1, 1, 3]), code, 4)
    assert counts.shape == (4, len(STATUS_CODES))
    assert counts.sum(axis=1).tolist() == [2, 2, 0, 1]
    assert [STATUS_CODES[c] for c in worst(counts)] == ["diverged", "gap", "empty", "identical"]
    # along the last axis of any shape (the server bins lanes x bins at once)
    assert worst(counts.reshape(2, 2, -1)).tolist() == worst(counts).reshape(2, 2).tolist()


def _frame(statuses: list[str]) -> pl.DataFrame:
    """One forward event per status, ten to a step, A's 1 us apart and B's 1.5 us; A lacks only_b
    events and B only_a ones."""
    n = len(statuses)
    a_seq = [None if s == "only_b" else i for i, s in enumerate(statuses)]
    b_seq = [None if s == "only_a" else i for i, s in enumerate(statuses)]
    return pl.DataFrame({
        "row": list(range(n)), "status": statuses, "phase": ["forward"] * n, "step": [i // 10 for i in range(n)],
        "boundary": [f"model.layers.{i % 10}" for i in range(n)], "module_type": ["Linear"] * n,
        "a_seq": a_seq, "b_seq": b_seq, "a_t_start_ns": [1_000 * i for i in range(n)],
        "b_t_start_ns": [1_500 * i + 7 for i in range(n)], "is_pivot": [s == "diverged" for s in statuses],
        "in_prefix": [i < 25 for i in range(n)]}, schema_overrides={"a_seq": pl.Int64, "b_seq": pl.Int64})


def test_a_window_of_many_events_is_binned_by_worst_status_with_counts_and_step_ranges():
    statuses = ["identical"] * 100
    statuses[25], statuses[26], statuses[60] = "diverged", "only_a", "only_b"
    tl = RankTimeline.from_frame(_frame(statuses))
    w = tl.window("seq", 0, 100, bins=10, raw_limit=5)
    assert w["mode"] == "bins" and w["status_codes"] == list(STATUS_CODES)
    lanes = {ln["side"]: ln for ln in w["bins"]["lanes"]}
    names = {side: [STATUS_CODES[c] for c in ln["status"]] for side, ln in lanes.items()}
    assert names["a"][2] == "diverged" and names["b"][2] == "diverged"
    assert names["a"][6] == "identical" and names["b"][6] == "gap"  # only B has event 60
    assert lanes["a"]["n"][2] == 10 and lanes["b"]["n"][2] == 9  # B lacks the only_a event 26
    assert lanes["a"]["diverged"][2] == 1 and sum(lanes["a"]["diverged"]) == 1
    assert sum(lanes["a"]["n"]) == 99 and sum(lanes["b"]["n"]) == 99
    assert w["bins"]["step_lo"][:3] == [0, 1, 2] and w["bins"]["step_hi"][:3] == [0, 1, 2]
    assert w["pivot"]["pos"] == 25 and w["prefix"]["a"] == [0.0, 25.0]


def test_a_window_of_few_events_is_sent_event_by_event_and_bounds_are_clamped():
    tl = RankTimeline.from_frame(_frame(["identical"] * 8 + ["diverged", "only_b"]))
    w = tl.window("seq", -5, 1e9, bins=10, raw_limit=50)
    assert w["mode"] == "events" and (w["start"], w["end"]) == (0.0, 10.0)
    assert [e["status"] for e in w["events"]][-2:] == ["diverged", "only_b"]
    assert w["events"][-1]["a_x"] is None and w["count_a"] == 9 and w["count_b"] == 10
    # by time: each side at its own clock (B's events 1.5 us apart, A's 1 us), from its first event
    t = tl.window("time", 2_500, 4_500, bins=10, raw_limit=50)
    assert [(e["pos"], e["a_x"], e["b_x"]) for e in t["events"]] == [(2, 2_000, 3_000), (3, 3_000, 4_500),
                                                                    (4, 4_000, 6_000)]
