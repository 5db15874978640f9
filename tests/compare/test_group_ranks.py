"""Ranks that a run's collectives name as members of their groups but that it has no rank file
for are not compared, and say so (helper 15: Lightning's own DDP launch re-runs the script for its
other ranks in a plain Python; rank 0's manifest said world size 1 and compare said identical)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import duckdb

import bitguard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fixtures_runs import RunSpec, write_run  # noqa: E402


def _one_rank_of_two(path) -> str:
    run = write_run(str(path), RunSpec(layers=2, steps=2))
    con = duckdb.connect(os.path.join(run, "rank-0.duckdb"))
    try:  # one event made a collective of the group of ranks 0 and 1
        con.execute("UPDATE events SET phase = 'comm', kind = 'collective', boundary = 'comm.all_reduce#0-1', "
                    "module_type = 'sum' WHERE seq = (SELECT min(seq) FROM events WHERE phase = 'forward')")
        con.execute("CHECKPOINT")
    finally:
        con.close()
    return run


def test_a_rank_the_collectives_name_without_a_rank_file_makes_the_run_inconclusive(tmp_path):
    a, b = _one_rank_of_two(tmp_path / "a"), _one_rank_of_two(tmp_path / "b")
    comparison = bitguard.compare(a, b)
    assert comparison.verdict == "inconclusive", comparison.verdict
    said = [r["message"] for r in comparison.certification_reasons() if r["code"] == "missing_ranks"]
    assert len(said) == 2 and all("name rank(s) 1 of their groups" in m for m in said), said
    assert bitguard.compare(a, b, rank=0).verdict == "identical"  # (one rank asked for: the others are not)
