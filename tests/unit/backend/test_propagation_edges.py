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


def test_a_part_s_backward_whose_gradient_the_root_made_hangs_off_the_root_s_forward():
    """Helper 61 (ultralytics' DetectionModel(batch) returns the loss it weights): a gain changed in the
    root's forward after its parts returned: the root's backward (its gradient the seed 1.0) is equal, its
    parts' backward differ, and nothing led there; propagation "reached 1 node"."""
    events = _events([(1, 0, "forward", "module", "M.net", 1), (2, 0, "forward", "module", "M", 0),
                      (3, 0, "backward", "module", "M", 0), (4, 0, "backward", "module", "M.net", 1),
                      (5, 0, "backward", "grad", "net.weight", 0), (6, 1, "forward", "module", "M", 0),
                      (7, 1, "backward", "module", "M.net", 1)])
    tensors = pl.DataFrame({"seq": [4, 4, 7], "role": ["grad_output", "grad_input", "grad_output"], "tid": [9, 8, 11]},
                           schema={"seq": pl.Int64, "role": pl.String, "tid": pl.Int64})
    edges = set(graph(events, tensors, [2, 4, 6, 7]).edges.select("src", "dst", "kind").iter_rows())
    assert (2, 4, "inferred") in edges and (6, 7, "inferred") in edges, edges
    assert not any(dst == 4 and src != 2 for src, dst, _ in edges), edges  # (only from its own step's root)
