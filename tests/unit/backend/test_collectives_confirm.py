"""A collective's blame checked against the other ranks of its group (pivot.confirm_comm), read
from each rank's collectives (pivot.collective_rows: what a pool worker sends back of them)."""

from __future__ import annotations

from types import SimpleNamespace

import polars as pl

from bitguard.backend.pivot import collective_rows, confirm_comm

GROUP = "comm.all_reduce#0-2"


def _rank(rank: int, collectives: list[tuple], pivot_seq: int | None = None):
    """A rank of `collectives` (seq, issue, paired, input differs, input unobserved), all at step 1
    of GROUP; its pivot the one of `pivot_seq` (blamed: source, comm), if given."""
    events = pl.DataFrame({"seq": [0] + [c[0] for c in collectives], "phase": ["forward"] + ["comm"] * len(collectives),
                           "step": [1] * (len(collectives) + 1), "boundary": ["model"] + [GROUP] * len(collectives)})
    tensors = pl.DataFrame([(c[0], role, f"[0]@{c[1]}") for c in collectives for role in ("input", "output")],
                           schema={"seq": pl.Int64, "role": pl.String, "path": pl.String}, orient="row")
    pairs = pl.DataFrame({"a_seq": [0] + [c[0] for c in collectives if c[2]]}, schema={"a_seq": pl.Int64})
    diffs = pl.DataFrame([(c[0], role, role == "input" and c[3], False, role == "input" and c[4])
                          for c in collectives if c[2] for role in ("input", "output")],
                         schema={"a_seq": pl.Int64, "role": pl.String, "differs": pl.Boolean, "ignored": pl.Boolean,
                                 "unknown": pl.Boolean}, orient="row")
    pivot = blame = None
    if pivot_seq is not None:
        pivot = {"seq": pivot_seq, "step": 1, "boundary": GROUP}
        blame = {"blame": "source", "fault_class": "comm", "blame_window": {"module": GROUP, "detail": "as seen here"}}
    return SimpleNamespace(rank=rank, pivot=pivot, blame=blame,
                           summary=SimpleNamespace(comm=collective_rows(events, tensors, pairs, diffs)))


def test_the_rows_say_issue_pairing_and_inputs():
    rows = _rank(0, [(5, 0, True, False, False), (9, 1, True, True, False), (12, 2, False, False, False)]).summary.comm
    assert rows.select("seq", "issue", "paired", "input_differs", "input_unknown").rows() == [
        (5, "0", True, False, False), (9, "1", True, True, False), (12, "2", False, False, False)]


def test_an_input_that_differed_on_another_rank_makes_this_one_its_consumer():
    ranks = {0: _rank(0, [(5, 0, True, False, False)], pivot_seq=5), 1: _rank(1, [(5, 0, True, True, False)]),
             2: _rank(2, [(5, 0, True, False, False)])}
    confirm_comm(ranks, rank_selected=False)
    assert ranks[0].blame["blame"] == "consumer"
    assert "rank(s) 1 of its group fed it a different input" in ranks[0].blame["blame_window"]["detail"]


def test_the_same_collective_is_the_one_of_the_same_issue_order():
    # rank 1's second all-reduce of the step (issue 1) had a differing input, its first (the pivot's) did not
    ranks = {0: _rank(0, [(5, 0, True, False, False), (6, 1, True, False, False)], pivot_seq=5),
             1: _rank(1, [(5, 0, True, False, False), (6, 1, True, True, False)]),
             2: _rank(2, [(5, 0, True, False, False), (6, 1, True, False, False)])}
    confirm_comm(ranks, rank_selected=False)
    assert ranks[0].blame["blame"] == "source"
    assert "matched on every rank of its group (0, 1, 2)" in ranks[0].blame["blame_window"]["detail"]


def test_ranks_unpaired_unobserved_or_not_compared_are_named():
    ranks = {0: _rank(0, [(5, 0, True, False, False)], pivot_seq=5), 1: _rank(1, [(5, 0, False, False, False)])}
    confirm_comm(ranks, rank_selected=True)  # rank 2 not compared, rank 1's counterpart unpaired
    detail = ranks[0].blame["blame_window"]["detail"]
    assert ranks[0].blame["blame"] == "source"
    assert detail.startswith("as seen here; rank(s) 1, 2 of the group were not compared (--rank)"), detail
    ranks = {0: _rank(0, [(5, 0, True, False, False)], pivot_seq=5), 1: _rank(1, [(5, 0, True, False, True)]),
             2: _rank(2, [(5, 0, True, False, False)])}
    confirm_comm(ranks, rank_selected=False)
    assert "rank(s) 1 of the group have no observed counterpart" in ranks[0].blame["blame_window"]["detail"]


def test_the_first_pivot_is_the_rank_that_fed_the_collective_not_its_consumer():
    """Rank 1's input to the all-reduce differed (its pivot, here a forward before it, ends later
    than rank 0's view of the collective): rank 0's pivot is only the consequence, so the
    comparison's first divergence is rank 1's, whatever the clocks say."""
    from bitguard.backend.compare import _first_pivot

    ranks = {0: _rank(0, [(5, 0, True, False, False)], pivot_seq=5), 1: _rank(1, [(5, 0, True, True, False)]),
             2: _rank(2, [(5, 0, True, False, False)])}
    ranks[0].pivot["t_end_ns"] = 100
    ranks[1].pivot, ranks[1].blame = {"seq": 3, "step": 1, "boundary": "out_proj", "t_end_ns": 200}, \
        {"blame": "source", "fault_class": "forward"}
    for rc in ranks.values():
        rc.fed_by = []
    assert _first_pivot(ranks) is ranks[0]  # by the clocks alone
    confirm_comm(ranks, rank_selected=False)
    assert ranks[0].fed_by == [1] and _first_pivot(ranks) is ranks[1]
