"""Edges of the propagation graph (backend/propagation.py) on small hand-made event streams."""

from __future__ import annotations

import polars as pl

from bitguard.backend.propagation import graph


def _events(rows: list[tuple]) -> pl.DataFrame:
    seq, step, phase, kind, boundary, depth = zip(*rows)
    return pl.DataFrame({"seq": list(seq), "step": list(step), "phase": list(phase), "kind": list(kind),
                         "boundary": list(boundary), "module_type": ["M"] * len(rows), "depth": list(depth),
                         "t_start_ns": [10 * s for s in seq], "t_end_ns": [10 * s + 5 for s in seq]},
                        schema_overrides={"seq": pl.Int64, "step": pl.Int32, "depth": pl.Int32})


def test_parameters_that_differ_from_the_start_reach_the_step_that_first_reads_them():
    """helper 14 (peft, an adapter used from step 3 on): the params events of the steps before that
    differ too, but led nowhere, and the propagation ended at the pivot."""
    events = _events([(0, 0, "optimizer", "params", "M", 0), (5, 0, "forward", "module", "M.used", 1),
                      (10, 1, "optimizer", "params", "M", 0), (20, 2, "optimizer", "params", "M", 0),
                      (21, 2, "forward", "module", "M.adapter", 1), (22, 2, "forward", "module", "M", 0)])
    tensors = pl.DataFrame({"seq": [5], "role": ["output"], "tid": [7]}, schema={"seq": pl.Int64, "role": pl.String,
                                                                                  "tid": pl.Int64})
    g = graph(events, tensors, [0, 10, 20, 21, 22])
    edges = set(g.edges.select("src", "dst").iter_rows())
    assert {(0, 10), (10, 20), (20, 21)} <= edges, edges
