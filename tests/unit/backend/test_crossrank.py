"""The cross-rank check (backend/crossrank.py) on made-up comm events: who is named, and when it
cannot tell."""

import polars as pl
import pytest

from bitguard.backend.check import LoadedRun
from bitguard.backend.collectives import function_of, group_of, issue_of
from bitguard.backend.crossrank import check_crossrank
from bitguard.collectors.comm import group_label

EVENT_SCHEMA = {"seq": pl.Int64, "step": pl.Int32, "phase": pl.String, "kind": pl.String, "boundary": pl.String,
                "module_type": pl.String, "call": pl.Int32}
TENSOR_SCHEMA = {"seq": pl.Int64, "role": pl.String, "idx": pl.Int32, "path": pl.String, "shape": pl.List(pl.Int64),
                 "dtype": pl.String, "xor": pl.UInt64, "pos": pl.UInt64, "storage": pl.Int64, "nbytes": pl.Int64,
                 "unobserved": pl.String}


def _run(per_rank: dict[int, list[tuple]]) -> LoadedRun:
    """per_rank: rank -> [(boundary, issue, output xor, storage, unobserved)] in event order, step 0."""
    frames = {}
    for rank, collectives in per_rank.items():
        events, tensors = [], []
        for seq, (boundary, issue, xor, storage, unobserved) in enumerate(collectives):
            events.append((seq, 0, "comm", "collective", boundary, "sum", 0))
            tensors.append((seq, "input", 0, f"@{issue}", [4], "float32", 100 + rank, 7, storage, 16, None))
            tensors.append((seq, "output", 0, f"@{issue}", [4], "float32", xor, xor, storage, 16, unobserved))
        frames[rank] = (pl.DataFrame(events, schema=EVENT_SCHEMA, orient="row"),
                        pl.DataFrame(tensors, schema=TENSOR_SCHEMA, orient="row"))
    return LoadedRun(info=None, ranks=sorted(per_rank), frames=frames)


def test_boundaries_read_back():
    for ranks in ([0, 1], [0, 1, 2, 3], [0, 2, 5], [3]):
        assert group_of(f"comm.all_reduce#{group_label(ranks)}") == ranks
    assert function_of("comm.ddp_bucket3#0-1") == "ddp_bucket3" and function_of("model.layers.0") is None
    assert group_of("model.layers.0") is None and group_of("comm.all_reduce#x") is None
    assert (issue_of("[1]@12"), issue_of("@0"), issue_of("[0]"), issue_of(None)) == ("12", "0", None, None)


def test_a_majority_names_the_rank_that_disagrees():
    ar = "comm.all_reduce#0-2"
    out = check_crossrank(_run({0: [(ar, 0, 5, 1, None)], 1: [(ar, 0, 5, 1, None)], 2: [(ar, 0, 6, 1, None)]}))
    assert out.compared == 1 and [(f.rank, f.against.rank) for f in out.findings] == [(2, 0)]
    assert "than to rank(s) 0, 1, which agree" in out.findings[0].detail


def test_two_ranks_that_disagree_are_both_named_when_the_run_cannot_tell():
    ar = "comm.all_reduce#0-1"
    out = check_crossrank(_run({0: [(ar, 0, 5, 1, None)], 1: [(ar, 0, 6, 1, None)]}))
    assert sorted(f.rank for f in out.findings) == [0, 1]
    assert all("cannot be told" in f.detail for f in out.findings)


def test_a_buffer_changed_after_a_collective_that_agreed_breaks_the_tie():
    """A DDP comm hook all-reduces the bucket (all ranks agree), then rank 1 edits it."""
    ar, bucket = "comm.all_reduce#0-1", "comm.ddp_bucket0#0-1"
    out = check_crossrank(_run({0: [(ar, 0, 5, 9, None), (bucket, 1, 5, 9, None)],
                                1: [(ar, 0, 5, 8, None), (bucket, 1, 6, 8, None)]}))
    assert out.compared == 2 and [(f.rank, f.boundary, f.against.rank) for f in out.findings] == [(1, bucket, 0)]
    # another buffer (storage) is not the bucket's source: no tie-break
    out = check_crossrank(_run({0: [(ar, 0, 5, 9, None), (bucket, 1, 5, 9, None)],
                                1: [(ar, 0, 5, 8, None), (bucket, 1, 6, 7, None)]}))
    assert sorted(f.rank for f in out.findings) == [0, 1]


@pytest.mark.parametrize("boundary", ["comm.reduce_scatter_tensor#0-1", "comm.reduce_scatter#0-1"])
def test_a_reduce_scatter_gives_each_rank_its_own_shard(boundary):
    out = check_crossrank(_run({0: [(boundary, 0, 5, 1, None)], 1: [(boundary, 0, 6, 1, None)]}))
    assert (out.compared, out.findings) == (0, [])


def test_what_cannot_be_compared_is_said():
    ar = "comm.all_reduce#0-1"
    out = check_crossrank(_run({0: [(ar, 0, 5, 1, None)], 1: [(ar, 0, 0, 1, "not digested")]}))
    assert (out.compared, out.findings) == (0, [])
    assert any("could not be observed" in n for n in out.notes) and any("fewer than two" in n for n in out.notes)
    out = check_crossrank(_run({0: [(ar, 0, 5, 1, None)]}))
    assert out.compared == 0 and any("one rank" in n for n in out.notes)
    # issue order pairs the collectives: rank 1's first all-reduce is not rank 0's second
    out = check_crossrank(_run({0: [(ar, 0, 5, 1, None), (ar, 1, 6, 1, None)], 1: [(ar, 1, 6, 1, None)]}))
    assert out.compared == 1 and out.findings == []
