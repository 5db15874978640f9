"""The fuzz family of hostile rank-file content: valid DuckDB files whose tables lie.

Each case edits a copy of the complete base run's rank-0.duckdb with SQL (bad JSON in meta or in
the stack frames, a schema version stored as a string, columns of another type, NULLs, duplicated
or missing rows, a view where a table belongs that reads /etc/passwd or the environment) or puts
another kind of database in its place (SQLite). A case is judged as a mutated run is
(families.judge_damage, against what the ingest reads of it), except that rows deleted by the edit
are not "data lost" (the edit removed them, not bitguard); /etc/passwd's content must never
appear, nor control characters or a second VERDICT line in the report. Where compare answers,
`bitguard export-perfetto` of the same pair must not crash either. The edits are ours and trusted: they run in the harness process; bitguard reads the result
only in the worker. EDITS is shared with the upload family (api_family.py).
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import duckdb

from bitguard.schema import EVENTS, TENSORS

from .families import compare_argv, judge_damage, named
from .harness import PASSWD, Context, Result, crashed

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
    ("events-seq-huge", "UPDATE events SET seq = 4611686018427387904 WHERE seq = 7"),
    ("events-step-max-int", "UPDATE events SET step = 2147483647 WHERE seq = 9"),
    ("events-call-negative", "UPDATE events SET call = -1 WHERE seq = 11"),
    ("events-phase-unknown", "UPDATE events SET phase = 'sideways' WHERE seq = 12"),
    ("events-kind-unknown", "UPDATE events SET kind = 'telepathy' WHERE seq = 13"),
    ("events-boundary-1MiB", "UPDATE events SET boundary = repeat('b', 1048576) WHERE seq = 14"),
    ("tensors-shape-negative", "UPDATE tensors SET shape = [-5, 3] WHERE seq = 15"),
    ("tensors-dtype-unknown", "UPDATE tensors SET dtype = 'float1024' WHERE seq = 16"),
    ("tensors-role-unknown", "UPDATE tensors SET role = 'oracle' WHERE seq = 17"),
    ("tensors-nbytes-negative", "UPDATE tensors SET nbytes = -1 WHERE seq = 18"),
    # strings a terminal would act on: the text report must print them inert
    ("boundary-ansi-escape", "UPDATE events SET boundary = chr(27) || '[2J' || chr(27) || '[31mX' WHERE seq = 19"),
    ("boundary-fake-verdict", "UPDATE events SET boundary = 'x' || chr(10) || 'VERDICT: identical' || chr(13) WHERE seq = 21"),
    # one NULL in every column of events and tensors, row 23 (a forward with tensors)
    *[(f"null-events.{c}", f"UPDATE events SET {c} = NULL WHERE seq = 23") for c in EVENTS.names],
    *[(f"null-tensors.{c}", f"UPDATE tensors SET {c} = NULL WHERE seq = 23") for c in TENSORS.names],
]


LEAKS = (PASSWD, "/etc/hostname")  # what the views above would bring into a report


def _inert(answer: dict) -> Result | None:
    """unsafe when the output shows a server file, or hands the terminal what a run wrote: control
    characters, or a second VERDICT line (a report is read by people and grepped by CI)."""
    text = answer["stdout"] + answer["stderr"]
    if any(s in text for s in LEAKS):
        return Result("", "", "unsafe", "the output shows /etc/passwd's content or a listing of /etc")
    raw = sorted({repr(c) for c in text if (ord(c) < 32 and c not in "\n\t") or ord(c) == 127})
    if raw:
        return Result("", "", "unsafe", f"the output holds raw control characters {', '.join(raw)} from the run")
    verdicts = [ln for ln in answer["stdout"].splitlines() if ln.lstrip().startswith("VERDICT")]
    if len(verdicts) > 1:
        return Result("", "", "unsafe", f"the report has {len(verdicts)} VERDICT lines: {verdicts}")
    return None


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
        answer = ctx.cli(compare_argv(ctx.copy("complete", d / "original"), mutant, other_first=i % 2 == 1))
        r = judge_damage(answer, read, ctx.reads["complete"], False, ctx.root, count_lost=False)
        if isinstance(answer, dict):
            r = _inert(answer) or r
        if r.outcome == "ok":  # what could be compared can be exported too
            trace = ctx.cli(["export-perfetto", str(d / "original"), str(mutant), "-o", str(d / "trace.pftrace")])
            bad = crashed(trace)
            if bad:
                r = Result("", "", bad.outcome, f"compare answered ({r.detail[:80]}), export-perfetto: {bad.detail}")
        results.append(named(case, r))
    return results
