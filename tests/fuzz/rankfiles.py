"""The fuzz family of hostile rank-file content: valid DuckDB files whose tables lie.

Each case edits a copy of the complete base run's rank-0.duckdb with SQL (bad JSON in meta or in
the stack frames, a schema version stored as a string, columns of another type, NULLs, duplicated
or missing rows, a view where a table belongs that reads /etc/passwd or the environment) or puts
another kind of database in its place (SQLite). A case is judged as a mutated run is
(families.judge_damage, against what the ingest reads of it), except that rows deleted by the edit
are not "data lost" (the edit removed them, not bitguard), and /etc/passwd's content must never
appear. The edits are ours and trusted: they run in the harness process; bitguard reads the result
only in the worker. EDITS is shared with the upload family (api_family.py).
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import duckdb

from .families import _compare, _named, judge_damage
from .harness import PASSWD, Context, Result

_VIEW_OVER = ("ALTER TABLE events RENAME TO events_real; "
              "CREATE VIEW events AS SELECT e.* REPLACE ({expr} AS boundary) FROM events_real e")

EDITS: list[tuple[str, str]] = [  # (case, SQL run on the rank file; "sqlite" replaces the file)
    ("meta-schema_version-string", "UPDATE meta SET value = '\"2\"' WHERE key = 'schema_version'"),
    ("meta-schema_version-newer", "UPDATE meta SET value = '99' WHERE key = 'schema_version'"),
    ("meta-schema_version-not-json", "UPDATE meta SET value = 'two' WHERE key = 'schema_version'"),
    ("meta-status-object", "UPDATE meta SET value = '{}' WHERE key = 'status'"),
    ("meta-status-running", "UPDATE meta SET value = '\"running\"' WHERE key = 'status'"),
    ("meta-world_size-string", "UPDATE meta SET value = '\"abc\"' WHERE key = 'world_size'"),
    ("meta-world_size-2", "UPDATE meta SET value = '2' WHERE key = 'world_size'"),
    ("meta-rank-7", "UPDATE meta SET value = '7' WHERE key = 'rank'"),
    ("meta-deep-json", "UPDATE meta SET value = repeat('[', 100000) || repeat(']', 100000) WHERE key = 'determinism'"),
    ("meta-huge-value", "UPDATE meta SET value = '\"' || repeat('x', 16000000) || '\"' WHERE key = 'mode'"),
    ("meta-collector-errors", "UPDATE meta SET value = '[\"boom\"]' WHERE key = 'collector_errors'"),
    ("meta-empty", "DELETE FROM meta"),
    ("meta-duplicate-key", "INSERT INTO meta VALUES ('status', '\"failed\"')"),
    ("stacks-not-json", "UPDATE stacks SET frames = 'not json'"),
    ("stacks-deep-json", "UPDATE stacks SET frames = repeat('[', 100000) || repeat(']', 100000)"),
    ("stacks-number", "UPDATE stacks SET frames = '123'"),
    ("stacks-null", "UPDATE stacks SET frames = NULL"),
    ("tensors-xor-varchar", "ALTER TABLE tensors ALTER xor TYPE VARCHAR"),
    ("tensors-xor-null", "UPDATE tensors SET xor = NULL WHERE seq % 7 = 3"),
    ("tensors-shape-null", "UPDATE tensors SET shape = NULL WHERE seq = 5"),
    ("tensors-xor-changed", "UPDATE tensors SET xor = xor(xor, 1::UBIGINT) WHERE seq = 40"),
    ("tensors-duplicated", "INSERT INTO tensors SELECT * FROM tensors WHERE seq = 10"),
    ("tensors-orphan-rows", "INSERT INTO tensors SELECT * REPLACE (seq + 100000 AS seq) FROM tensors"),
    ("tensors-dropped", "DROP TABLE tensors"),
    ("events-step-varchar", "ALTER TABLE events ALTER step TYPE VARCHAR; UPDATE events SET step = 'abc' WHERE seq = 3"),
    ("events-phase-null", "UPDATE events SET phase = NULL WHERE seq = 4"),
    ("events-step-negative", "UPDATE events SET step = -5 WHERE seq = 6"),
    ("events-duplicate-seq", "INSERT INTO events SELECT * FROM events WHERE seq = 2"),
    ("events-one-deleted", "DELETE FROM events WHERE seq = 20"),
    ("events-all-deleted", "DELETE FROM events"),
    ("events-column-dropped", "ALTER TABLE events DROP COLUMN boundary"),
    ("events-extra-column", "ALTER TABLE events ADD COLUMN extra INTEGER DEFAULT 1"),
    ("extra-table", "CREATE TABLE notes AS SELECT 1 AS x"),
    ("events-view-of-passwd", _VIEW_OVER.format(expr="(SELECT content FROM read_text('/etc/passwd'))")),
    ("events-view-of-a-listing", _VIEW_OVER.format(expr="(SELECT string_agg(file, ',') FROM glob('/etc/*'))")),
    ("events-view-of-csv", _VIEW_OVER.format(expr="(SELECT string_agg(column0, ',') FROM read_csv('/etc/passwd', "
                                                  "header = false, sep = ':'))")),
    ("events-macro-shadow", "CREATE MACRO hash(a, b, c, d, e, f) AS 42"),
    ("sqlite-file", "sqlite"),
]


LEAKS = (PASSWD, "/etc/hostname")  # what the views above would bring into a report


def make(rank_file: Path, sql: str) -> None:
    """Apply one edit to `rank_file` in place."""
    if sql == "sqlite":
        rank_file.unlink()
        con = sqlite3.connect(rank_file)
        con.execute("CREATE TABLE events (seq INTEGER)")
        con.commit()
        con.close()
        return
    con = duckdb.connect(str(rank_file), config={"autoinstall_known_extensions": False,
                                                  "autoload_known_extensions": False})
    try:
        for statement in sql.split("; "):
            con.execute(statement)
    finally:
        con.close()


def rankfile(ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    results = []
    for i, (case, sql) in enumerate(EDITS):
        if only is not None and only not in case:
            continue
        d = ctx.scratch("rankfile")
        mutant = ctx.copy("complete", d / "mutant")
        make(mutant / "rank-0.duckdb", sql)
        shutil.copytree(mutant, d / "oracle")
        read = ctx.read(d / "oracle")
        answer = ctx.cli(_compare(ctx.copy("complete", d / "original"), mutant, other_first=i % 2 == 1))
        r = judge_damage(answer, read, ctx.reads["complete"], False, ctx.root, count_lost=False)
        if isinstance(answer, dict) and any(s in answer["stdout"] + answer["stderr"] for s in LEAKS):
            r = Result("", "", "unsafe", "the output shows /etc/passwd's content or a listing of /etc")
        results.append(_named(case, r))
    return results
