"""Search over one rank's aligned events (backend/search.py): filters, paging, next and previous."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from bitguard.backend.search import Finder, Query, boundary_matcher, finder, step_index
from bitguard.backend.timelines import RankTimeline
from bitguard.errors import BadInput


def _frame() -> pl.DataFrame:
    """3 steps of: blocks.0.mlp.fc, blocks.0.attn, blocks.5.mlp, blocks.5.mlp.fc (forward), a backward grad."""
    names = [("model.blocks.0.mlp.fc", "Linear", "forward"), ("model.blocks.0.attn", "Attention", "forward"),
             ("model.blocks.5.mlp", "MLP", "forward"), ("model.blocks.5.mlp.fc", "Linear", "forward"),
             ("model.blocks.5.mlp.fc.weight", "Linear", "backward")]
    rows = []
    for step in range(3):
        for b, t, p in names:
            rows.append({"step": step, "phase": p, "boundary": b, "module_type": t, "kind": "module"})
    status = ["identical"] * len(rows)
    status[7] = "diverged"
    status[8] = "only_b"
    status[12] = "diverged"
    frame = pl.DataFrame(rows).with_columns(pl.Series("status", status))
    return frame.with_row_index("pos").with_columns(
        a_seq=pl.when(pl.col("status") == "only_b").then(None).otherwise(pl.col("pos")),
        b_seq=pl.col("pos"), is_pivot=pl.col("pos") == 7)


def test_a_glob_matches_from_any_dotted_part_and_plain_text_anywhere():
    glob = boundary_matcher("blocks.5.mlp*")
    assert glob("model.blocks.5.mlp") and glob("model.blocks.5.mlp.fc") and glob("blocks.5.mlp")
    assert not glob("model.blocks.15.mlp") and not glob("model.blocks.0.mlp.fc")
    assert boundary_matcher("5.mlp")("model.blocks.15.mlp.fc")  # plain text: a substring
    assert not boundary_matcher("*.attn")("model.blocks.0.attn.proj")


def test_filters_combine_and_matches_come_in_aligned_order():
    f = Finder(_frame())
    assert f.matches(Query(boundary="blocks.5.mlp*")).tolist() == [2, 3, 4, 7, 8, 9, 12, 13, 14]
    assert f.matches(Query(boundary="blocks.5.mlp*", phase="forward", step_min=1, step_max=1)).tolist() == [7, 8]
    assert f.matches(Query(module_type="Linear", phase="backward")).tolist() == [4, 9, 14]
    assert f.matches(Query(module_type="Att*")).tolist() == [1, 6, 11]
    assert f.matches(Query(phase="backward,optimizer", step_min=2)).tolist() == [14]
    assert f.matches(Query(status="diverged")).tolist() == [7, 12]
    assert f.matches(Query(status="gap")).tolist() == [8]
    assert f.matches(Query(status="difference")).tolist() == [7, 8, 12]
    assert f.matches(Query(boundary="no.such.module")).size == 0
    assert f.matches(Query()).tolist() == list(range(15))


def test_next_and_previous_from_a_position_say_when_there_is_none():
    pos = np.array([7, 8, 12])
    assert step_index(pos, None, "next") == 0 and step_index(pos, None, "prev") == 2
    assert step_index(pos, 7, "next") == 1 and step_index(pos, 7, "prev") is None  # not the one it stands on
    assert step_index(pos, 10, "next") == 2 and step_index(pos, 10, "prev") == 1
    assert step_index(pos, 12, "next") is None
    assert step_index(np.array([], dtype=np.int64), 3, "next") is None


def test_a_search_page_and_its_hit():
    f = Finder(_frame())
    out = f.search(Query(module_type="Linear"), offset=2, limit=3, at=8, direction="next")
    assert out["total"] == 9 and [m["pos"] for m in out["matches"]] == [4, 5, 8]
    assert out["hit"]["index"] == 5 and out["hit"]["event"]["pos"] == 9
    assert set(out["matches"][0]) >= {"pos", "status", "step", "phase", "boundary", "module_type", "a_seq", "b_seq"}
    back = f.search(Query(status="diverged"), limit=0, at=12, direction="prev")
    assert back["matches"] == [] and back["hit"]["event"]["pos"] == 7 and back["hit"]["event"]["is_pivot"]
    assert f.search(Query(status="diverged"), at=12)["hit"] is None  # past the last one


def test_bad_filters_are_one_line_errors():
    with pytest.raises(BadInput, match="unknown status 'broken'"):
        Query(status="broken")
    with pytest.raises(BadInput, match="step_min 3 is after step_max 1"):
        Query(step_min=3, step_max=1)
    with pytest.raises(BadInput, match="direction"):
        Finder(_frame()).search(Query(), direction="sideways")


def test_a_real_comparisons_timeline(gap_then_divergence):
    """On the engine's own columns: rank 1's pivot is its first divergence, the skipped probe its gap."""
    c = gap_then_divergence
    tl = RankTimeline.from_frame(c.events().filter(pl.col("rank") == 1))
    f = finder(tl)
    assert finder(tl) is f  # kept with the timeline
    first = f.search(Query(status="diverged"), limit=0)["hit"]["event"]
    assert first["pos"] == tl.pivot and first["boundary"] == "model.layers.1" and first["step"] == 1
    gap = f.search(Query(status="gap"), limit=0)["hit"]["event"]
    assert gap["boundary"] == "model.probe" and gap["step"] == 0 and gap["b_seq"] is None
