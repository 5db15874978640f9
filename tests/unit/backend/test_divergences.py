"""The divergences table (backend/divergences.py) on synthetic pairs: grouped rows, filters, pages."""

from __future__ import annotations

import polars as pl
import pytest

from bitguard.backend import divergences
from bitguard.backend.timelines import Result
from bitguard.errors import BadInput


@pytest.fixture(scope="module")
def result(gap_then_divergence):
    return Result(gap_then_divergence, 1)


def test_rows_cover_every_non_identical_event_once_in_rank_then_position_order(result, gap_then_divergence):
    page = divergences.page(result, limit=500)
    events = gap_then_divergence.events()
    assert page["schema"] == "bitguard.divergences/1"
    assert page["events"] == page["all_events"] == events.filter(pl.col("status") != "identical").height
    assert sum(r["count"] for r in page["rows"]) == page["events"]
    keys = [(r["rank"], r["first_pos"]) for r in page["rows"]]
    assert keys == sorted(keys)
    # one row per (rank, step, phase, boundary, module type, status)
    assert len({tuple(r[k] for k in divergences.KEYS) for r in page["rows"]}) == len(page["rows"])


def test_a_row_names_its_first_event_as_the_event_route_reads_it(result, gap_then_divergence):
    rows = divergences.page(result, rank=1, status="diverged", limit=1)["rows"]
    r = rows[0]
    assert (r["step"], r["boundary"], r["phase"], r["cause"]) == (1, "model.layers.1", "forward", "digest")
    d = gap_then_divergence.event_detail(r["rank"], r["side"], r["seq"])
    assert d["event"]["boundary"] == r["boundary"] and d["status"] == "diverged"
    assert result.timeline(1).locate(r["side"], r["seq"]) == r["first_pos"]


def test_an_allowed_gap_says_which_rule_allowed_it(result):
    rows = divergences.page(result, status="only_a")["rows"]
    assert rows and all(r["rules"] == ["no-probe"] and r["cause"] == "structure: only in A, allowed by rule no-probe"
                        for r in rows)


def test_filters_combine_and_pages_slice_the_filtered_rows(result):
    every = divergences.page(result, rank=1, phase="backward", module_type="Linear", limit=500)
    assert every["total"] > 2
    assert all(r["rank"] == 1 and r["phase"] == "backward" and r["module_type"] == "Linear" for r in every["rows"])
    second = divergences.page(result, rank=1, phase="backward", module_type="Linear", offset=1, limit=2)
    assert second["rows"] == every["rows"][1:3] and second["total"] == every["total"]
    assert divergences.page(result, status="only_b")["total"] == 0
    both = divergences.page(result, status="only_a,diverged")
    assert both["events"] == divergences.page(result)["events"]
    # the facets describe the whole table whatever the filters
    assert {f["value"] for f in every["facets"]["rank"]} == {0, 1}


def test_an_unknown_status_is_refused_in_one_line(result):
    with pytest.raises(BadInput, match="not a divergence status"):
        divergences.page(result, status="identical")
    with pytest.raises(BadInput, match="nonsense"):
        divergences.page(result, status="diverged,nonsense")


def test_identical_runs_have_an_empty_table(identical_runs):
    page = divergences.page(Result(identical_runs, 1))
    assert (page["total"], page["events"], page["rows"]) == (0, 0, [])
