"""The rank file writer: events go from the training thread to DuckDB on a writer thread.

The training thread appends rows to a small batch; full batches go through a bounded queue
(back-pressure: a full queue makes the training thread wait, memory never grows without
bound) to one writer thread. The writer resolves pending GPU digests, turns each batch into
Arrow tables and appends them, in one write, to the rank's journal (`rank-N.journal`): that is
what makes a batch durable against a killed process, at the cost of a file append. Every five
seconds, or once the journal passes two megabytes, it folds what the journal holds into
`rank-N.duckdb` in one transaction, reading the journal back from the file (the writer keeps no
rows in memory), checks that the rank file gained exactly the rows the folded groups hold, and
only then empties the journal. A DuckDB statement costs about a millisecond whatever
its size, and a fold has a fixed cost of a few milliseconds: too much to pay per step (online
mode, whose rows are few, folds every 30 s: `fold_seconds`). Folds cost a recorded step 2-3 points
of its time on a 2-core machine, their CPU beside torch's threads (docs/PERFORMANCE.md, "Folds" and
"The fold process"); rarer, bigger folds cost less CPU a row, but DuckDB holds about 1.4 times a
fold's journal in memory until it commits. With BITGUARD_FOLD_PROCESS=1 (not the default:
docs/PERFORMANCE.md), from the first fold on, the writer hands the rank file to a fold process
(folder.py: DuckDB's memory and native code out of the training's process) and only asks it to fold the journal's first whole groups (at most FOLD_CHUNK bytes a time); once
a fold is verified the writer drops those bytes from the journal itself, since it alone appends to
it. Online mode, whose budget charges the writer's CPU, keeps its folds here. The writer counts its own CPU time
(`writer_cpu_s`, thread time of its journal writes and folds), which online mode's budget charges.
`step_barrier()`, called at the end of each training step, waits for the previous step's journal
write only (the writer marks a step done before it folds): a killed run keeps every step before its
last completed one, and the training thread rarely waits for the writer.

A journal left behind by a killed process is folded by `recover()` (the `bitguard record`
launcher calls it when its child dies; readers never write: ingest reads what is left in the
journal beside the rank file). The fold records the last journal group it holds in the meta
table (`journal_folded`) in the same transaction, so a crash between the fold and the journal's
truncation never duplicates rows. Every group is checksummed (format in journal.py); a fold that
meets a bad group folds the good ones, records in the same transaction what may be lost
(`journal_damage`: from which step, why, and the name the journal is kept under), and keeps the
journal as `rank-N.journal.damaged` instead of emptying it: nothing recorded is thrown away.

A failing write is reported (stderr and `errors`), never raised into training. This module knows
the schema's tables but nothing about torch modules or hooks.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from bitguard import db, runfiles
from bitguard.collectors import journal as journal_format
from bitguard.collectors.folder import FoldProcess, FolderGone
from bitguard.collectors.journal import ROW_TABLES as _ROW_TABLES
from bitguard.collectors.journal import SCHEMAS as _SCHEMAS
from bitguard.collectors.journal import arrow_schema, encode_group  # noqa: F401 - arrow_schema: public here
from bitguard.schema import EVENTS, META, SCHEMA_VERSION, STACKS, TABLES, TENSORS, DUMPS

_XOR = TENSORS.names.index("xor")
_POS = TENSORS.names.index("pos")

FOLD_SECONDS = 5.0  # fold the journal into DuckDB at least this often ...
FOLD_BYTES = 2 << 20  # ... or once the journal holds this many bytes
FOLD_CHUNK = 4 << 20  # the fold process folds at most this much journal at a time (whole groups; at least one) ...
JOURNAL_HIGH = 32 << 20  # ... and while the journal holds more than this, the writer waits for it (back-pressure)
FOLDED_KEY = "journal_folded"
DAMAGE_KEY = "journal_damage"
MAX_REPORTED_ERRORS = 20  # the store's and the collector's failures share one list (store.errors)
# The recording's connection to its rank file (the writer's, or the fold process's). One DuckDB
# thread and a small buffer pool: a guest beside the training's own threads and memory (collector
# memory must stay bounded whatever the run length). Rows not yet checkpointed stay in memory until
# the write-ahead log reaches the checkpoint threshold: 4 MB instead of DuckDB's 16 MB takes about
# 4 MiB off the collector's peak. (8 MB of buffer pool is too little: a checkpoint then fails,
# fatally for the connection.)
RANK_DB_CONFIG = {"threads": 1, "memory_limit": "16MB", "checkpoint_threshold": "4MB"}
# `--dump` folds the tensors' bytes: a step's group of them did not fit that pool ("failed to pin block"),
# so every fold failed and identical reruns compared inconclusive (helper 46). A cap, not an allocation.
DUMP_MEMORY_LIMIT = "256MB"


def rank_db_config(memory_limit: str | None = None) -> dict:
    """The rank file's connection settings, with the dump mode's buffer pool when it is given."""
    return {**RANK_DB_CONFIG, "memory_limit": memory_limit} if memory_limit else RANK_DB_CONFIG
_COUNTS = "SELECT " + ", ".join(f"(SELECT count(*) FROM {t.name})" for t in _ROW_TABLES)


class FoldNotVerified(RuntimeError):
    """The rank file did not gain the rows a fold put in: the journal must be kept."""


@dataclass
class Fold:
    """What one fold did."""

    groups: int  # groups folded
    last: int  # the last group the rank file now holds (journal_folded)
    damage: dict | None  # what the journal lost, as recorded in meta (journal_damage), or None
    keep_as: str | None  # the journal holds something that is not a whole group: keep it under this name


def journal_path(rank_path: str | os.PathLike) -> Path:
    """`rank-N.journal` beside `rank-N.duckdb`."""
    return Path(rank_path).with_suffix(".journal")


def _spare(journal: Path) -> Path:
    """Where the writer copies what follows the groups a fold process folded (RankStore._drop_folded)."""
    return journal.with_name(f".{journal.name}.rest")


def kept_name(journal: Path) -> str:
    """A free name for a damaged journal: rank-N.journal.damaged, then .damaged.2, ..."""
    name, n = journal.name + ".damaged", 1
    while (journal.parent / name).exists():
        n += 1
        name = f"{journal.name}.damaged.{n}"
    return name


def _to_arrow(rows: list, schema: pa.Schema) -> pa.Table:
    width = len(schema.types)
    if any(len(r) < width for r in rows):  # a row made before the last columns (tensors.shard): NULL there
        rows = [r if len(r) >= width else [*r, *[None] * (width - len(r))] for r in rows]
    columns = list(zip(*rows)) if rows else [[] for _ in schema.types]
    return pa.Table.from_arrays([pa.array(c, type=t) for c, t in zip(columns, schema.types)], schema=schema)


def _resolve_digests(tensor_rows: list[list]) -> None:
    """Replace pending GPU digests by their values, in place, in one batch."""
    pending = [r for r in tensor_rows if not isinstance(r[_XOR], int)]
    if not pending:
        return
    from bitguard.cuda.fingerprint import resolve

    values = resolve([r[_XOR] for r in pending])
    for row, (x, p) in zip(pending, values):
        row[_XOR], row[_POS] = x, p


def _last_step(con: duckdb.DuckDBPyConnection) -> int | None:
    return con.execute(f"SELECT max(step) FROM {EVENTS.name}").fetchall()[0][0]


def fold_journal(con: duckdb.DuckDBPyConnection, journal: Path, upto: int, written: int | None = None,
                 limit: int | None = None) -> Fold:
    """Insert the journal's whole groups numbered above `upto` into `con`, in one transaction that
    also records the last one's number as `journal_folded` (and, when groups are lost, what and
    from which step as `journal_damage`), then check the rank file gained exactly their rows.
    When groups are lost, journal_folded also covers them (and `written`, the last group the
    writer wrote, when it says): their loss is on record, and a later fold must not report it again.
    `limit`: read only the journal's first bytes (the fold process: the writer appends meanwhile)."""
    data = runfiles.read(journal.parent, journal) if limit is None else runfiles.head(journal.parent, journal, limit)
    if data is None:  # (not an empty journal: what it held would be taken as folded, and the journal emptied)
        raise FileNotFoundError(f"{journal} is gone; nothing was folded")
    decoded = journal_format.decode(data)
    groups = [g for g in decoded.groups if g.number > upto]
    damage = decoded.damage(upto, lambda: _last_step(con))
    keep_as = kept_name(journal) if decoded.bad else None
    if damage is not None:
        damage = _merge_damage(_get_meta(con, DAMAGE_KEY), {**damage, "reason": f"{journal.name}: {damage['reason']}",
                                                            "kept_as": keep_as})
    if not groups and damage is None:
        return Fold(0, upto, None, keep_as)
    last = max([upto, *(g.number for g in groups)])
    if damage is not None:
        last = max([last, *(b.number for b in decoded.bad if b.number is not None), written or 0])
    _commit(con, {t.name: [g.tables[t.name] for g in groups if t.name in g.tables] for t in _ROW_TABLES}, last,
            {DAMAGE_KEY: damage} if damage is not None else {})
    return Fold(len(groups), last, damage, keep_as)


def _merge_damage(old, new: dict) -> dict:
    """One journal_damage from an earlier fold's and this one's: the earlier step, both reasons."""
    if not isinstance(old, dict):
        return new
    steps = [s for s in (old.get("from_step"), new["from_step"]) if isinstance(s, int)]
    from_step = None if old.get("from_step") is None or new["from_step"] is None else min(steps)
    kept = ", ".join(k for k in (old.get("kept_as"), new.get("kept_as")) if k)
    return {"from_step": from_step, "reason": f"{old.get('reason')}; {new['reason']}"[:4000], "kept_as": kept or None}


def _get_meta(con: duckdb.DuckDBPyConnection, key: str):
    rows = con.execute(f"SELECT value FROM {META.name} WHERE key = ?", [key]).fetchall()
    return json.loads(rows[0][0]) if rows and rows[0][0] is not None else None


def folded_upto(con: duckdb.DuckDBPyConnection) -> int:
    """The last journal group the rank file holds (-1: none)."""
    folded = _get_meta(con, FOLDED_KEY)
    if folded is None:
        return -1
    if not isinstance(folded, int) or isinstance(folded, bool):
        raise ValueError(f"meta {FOLDED_KEY!r} is {folded!r}, not a group number")
    return folded


def _insert(con: duckdb.DuckDBPyConnection, tables: dict[str, list[pa.Table]]) -> dict[str, int]:
    """Insert each table's parts, by column name (a journal from before a column was added lacks it:
    NULL); the rows inserted per table."""
    added = {}
    for name, parts in tables.items():
        if parts:
            rows = pa.concat_tables(parts, promote_options="default")
            con.register("_journal_rows", rows)
            try:
                con.execute(f"INSERT INTO {name} BY NAME SELECT * FROM _journal_rows")
            finally:
                con.unregister("_journal_rows")
            added[name] = rows.num_rows
    return added


def _commit(con: duckdb.DuckDBPyConnection, parts: dict[str, list[pa.Table]], last_group: int,
            meta: dict | None = None) -> None:
    """Insert the tables and record `last_group` as folded (and `meta`), in one transaction: all or
    nothing (on failure the journal still holds every row). Then check that each table gained the
    rows inserted and that journal_folded reads back: FoldNotVerified when not."""
    before = con.execute(_COUNTS).fetchall()[0]
    con.execute("BEGIN")
    try:
        added = _insert(con, parts)
        _set_meta(con, {FOLDED_KEY: last_group, **(meta or {})})
        con.execute("COMMIT")
    except Exception:
        try:
            con.execute("ROLLBACK")
        except duckdb.Error:  # (a COMMIT that failed ended the transaction: its own error is the one to say)
            pass
        raise
    after = con.execute(_COUNTS).fetchall()[0]
    expected = tuple(b + added.get(t.name, 0) for b, t in zip(before, _ROW_TABLES))
    if after != expected or folded_upto(con) != last_group:
        raise FoldNotVerified(f"after folding groups up to {last_group} the rank file holds {after} rows of "
                              f"{', '.join(t.name for t in _ROW_TABLES)}, not {expected}")


def _set_meta(con: duckdb.DuckDBPyConnection, items: dict) -> None:
    rows = [(k, json.dumps(v, default=str)) for k, v in items.items()]
    con.executemany(f"DELETE FROM {META.name} WHERE key = ?", [(k,) for k, _ in rows])
    con.executemany(f"INSERT INTO {META.name} VALUES (?, ?)", rows)


def recover(rank_path: str | os.PathLike) -> int:
    """Fold a journal left by a killed recording into its rank file; the number of groups folded.
    The journal is removed once the fold is verified, or kept as rank-N.journal.damaged when it
    holds a bad group (what it lost is then in the rank file's meta, `journal_damage`).

    Raises duckdb.Error when the rank file is open in another process (a recording still
    running), CorruptRun when the journal or rank file is not a regular file or the rank file is
    not DuckDB, and OSError when the directory cannot be written.
    """
    from bitguard.errors import CorruptRun

    rank_path = Path(rank_path)
    journal = journal_path(rank_path)
    spare = _spare(journal)  # a copy of the journal's end a killed writer had not put in its place yet
    if runfiles.member(spare.parent, spare) is not None and runfiles.member(journal.parent, journal) is not None:
        spare.unlink()
    if runfiles.member(journal.parent, journal) is None:
        return 0
    head = runfiles.head(rank_path.parent, rank_path, db.HEADER_BYTES)
    if head is None:  # no rank file to fold into: leave the journal as it is
        return 0
    problem = db.header_problem(head)
    if problem:
        raise CorruptRun(f"{rank_path} is {problem}; its journal {journal.name} is left as it is")
    con = db.connect(rank_path, config={"threads": 1})
    try:
        for table in _ROW_TABLES:  # a rank file opened before the writer made every table (or an older one)
            con.execute(table.ddl())
        fold = fold_journal(con, journal, folded_upto(con))
        con.execute("CHECKPOINT")
    finally:
        con.close()
    if fold.keep_as:
        os.replace(journal, journal.parent / fold.keep_as)
    else:
        journal.unlink()
    return fold.groups


class RankStore:
    """Owns `rank-N.duckdb` and its journal for the life of a recording."""

    def __init__(self, path: str, meta: dict, batch_events: int = 256, queue_batches: int = 32,
                 fold_seconds: float | None = None, fold_process: bool | None = None):
        self.path = path
        self._fold_seconds = fold_seconds  # None: FOLD_SECONDS
        # folds in another process once the recording first folds (folder.py); None: when
        # BITGUARD_FOLD_PROCESS=1 (not the default: docs/PERFORMANCE.md, "The fold process"). False,
        # or a folder that cannot start or dies: on the writer thread
        self._fold_process = (os.name == "posix" and os.environ.get("BITGUARD_FOLD_PROCESS", "0") == "1"
                              if fold_process is None else fold_process)
        self._folder: FoldProcess | None = None
        self._asked = 0  # the journal bytes the request out covers
        self.folder_pid: int | None = None  # the fold process's pid, once started
        self.writer_cpu_s = 0.0  # the writer thread's CPU time so far (written by it alone)
        self.errors: list[str] = []
        self._batch_events = batch_events
        self._events: list[tuple] = []
        self._tensors: list[list] = []
        self._stacks: list[tuple] = []
        self._dumps: list[tuple] = []
        self._rows: dict[str, list] = {}  # add_rows: further row tables (alerts, sensor_stats), by name
        self._queue: queue.Queue = queue.Queue(maxsize=queue_batches)
        self._memory_limit = DUMP_MEMORY_LIMIT if meta.get("dump") else None
        self._con = db.connect(path, config=rank_db_config(self._memory_limit))
        for table in TABLES:
            self._con.execute(table.ddl())
        self.set_meta({"schema_version": SCHEMA_VERSION, "status": "running", **meta})
        self._journal_path = journal_path(path)
        self._journal = os.open(self._journal_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._group = 0
        self._journal_bytes = 0  # what the journal file holds
        self._ends: list[int] = []  # where each group the journal holds ends (what a fold request may cover)
        self._folded = -1  # the last group in DuckDB
        self._folded_at = time.monotonic()
        self._fold_failed = False
        self.folds = 0
        self._closed = False
        self._previous_step: threading.Event | None = None
        self._thread = threading.Thread(target=self._run, name="bitguard-writer", daemon=True)
        self._thread.start()

    # -- training thread -------------------------------------------------------------------
    def add(self, event: tuple, tensors: list[list], stacks: list[tuple], dumps: list[tuple] = ()) -> None:
        self._events.append(event)
        self._tensors.extend(tensors)
        if stacks:
            self._stacks.extend(stacks)
        if dumps:
            self._dumps.extend(dumps)
        if len(self._events) >= self._batch_events:
            self._push()

    def add_rows(self, table_name: str, rows: list) -> None:
        """Queue rows of another journaled table (alerts, sensor_stats: online mode), each a dict by
        column name (absent columns NULL) or a sequence in the schema's column order. Training thread
        only (like add); they go out with the next batch, at the latest at the next step_barrier()."""
        if table_name not in _SCHEMAS or table_name in (EVENTS.name, TENSORS.name, STACKS.name, DUMPS.name):
            raise ValueError(f"add_rows: {table_name!r} is not a row table add_rows writes")
        names = _SCHEMAS[table_name].names
        self._rows.setdefault(table_name, []).extend(
            [r.get(n) for n in names] if isinstance(r, dict) else list(r) for r in rows)

    def _push(self, marker: threading.Event | None = None) -> None:
        batch = (self._events, self._tensors, self._stacks, self._dumps, self._rows, marker)
        self._events, self._tensors, self._stacks, self._dumps, self._rows = [], [], [], [], {}
        self._queue.put(batch)  # blocks when the writer is behind: back-pressure

    def step_barrier(self, timeout: float = 30.0) -> bool:
        """End of a training step: queue a commit point and wait for the previous step's one.

        The writer journals step k while step k+1 trains, so the training thread rarely waits;
        when step k+1 ends, everything of step k and before is durable. False on timeout.
        """
        if self._closed:
            return True
        done = threading.Event()
        self._push(done)
        previous, self._previous_step = self._previous_step, done
        return previous is None or previous.wait(timeout)

    def set_meta(self, items: dict) -> None:
        """Write facts into the meta table (called before the writer starts or after it stops)."""
        self._con.execute("BEGIN")
        _set_meta(self._con, items)
        self._con.execute("COMMIT")

    def close(self, status: str, extra_meta: dict | None = None) -> None:
        """Flush, fold the journal, stop the writer, write the final status. Safe to call twice."""
        if self._closed:
            return
        self._push()
        self._queue.put(None)
        self._thread.join(timeout=120)
        self._closed = True
        self._take_back()
        if self._fold_failed or self._con is None:  # the journal holds the run: leave it, and the rank file,
            if self._con is not None:  # for recover()
                self._con.close()
            return
        try:
            self._fold()
            self.set_meta({"status": status, "collector_errors": self.errors, **(extra_meta or {})})
            self._con.execute("CHECKPOINT")
            os.close(self._journal)
            self._journal_path.unlink()
        except Exception as exc:  # noqa: BLE001 - report, never raise into the user's exit path
            self._report(f"could not finish {self.path}: {exc}")
        finally:
            self._con.close()

    # -- writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            events, tensors, stacks, dumps, rows, marker = batch
            started = time.thread_time()
            try:
                if events or stacks or rows:
                    self._write(events, tensors, stacks, dumps, ends_step=marker is not None, rows=rows)
            except Exception as exc:  # noqa: BLE001
                self._report(f"writing {len(events)} events to {self.path} failed: {exc}")
                traceback.print_exc(file=sys.stderr)
            finally:
                # The step is durable once journaled: the training thread's barrier waits for that,
                # not for a fold (tens of ms, and a DuckDB checkpoint's hundreds, that it once waited
                # for whenever the fold followed a step's last batch).
                if marker is not None:
                    marker.set()
            try:
                if self._folder is not None and self._folder.busy:  # (waits when the fold process lags far behind)
                    self._answered(120.0 if self._journal_bytes > JOURNAL_HIGH else 0.0)
                every = FOLD_SECONDS if self._fold_seconds is None else self._fold_seconds
                if time.monotonic() - self._folded_at >= every or self._journal_bytes >= FOLD_BYTES:
                    if not self._fold_elsewhere():
                        self._fold()
            except Exception as exc:  # noqa: BLE001
                self._report(f"folding {self._journal_path.name} into {self.path} failed ({exc}); the journal keeps "
                             f"every batch from here on (readers read it as it is; the launcher folds it)")
            finally:
                self.writer_cpu_s += time.thread_time() - started

    def _write(self, events: list[tuple], tensors: list[list], stacks: list[tuple], dumps: list[tuple],
               ends_step: bool = False, rows: dict[str, list] | None = None) -> None:
        """Journal one batch (`ends_step`: the last of a training step; `rows`: add_rows' tables): one
        append, and the batch is durable once it returns."""
        _resolve_digests(tensors)
        lists = {EVENTS.name: events, TENSORS.name: tensors, STACKS.name: stacks, DUMPS.name: dumps, **(rows or {})}
        # empty tables are not journaled (encode_group drops them): not converted either (online mode's batches
        # carry no events, and four empty tables cost about 0.16 ms of interpreter time a batch)
        tables = {name: _to_arrow(r, _SCHEMAS[name]) for name, r in lists.items() if r}
        self._group += 1
        group = encode_group(self._group, tables, ends_step)
        try:
            if os.write(self._journal, group) != len(group):
                raise OSError(f"short write ({len(group)} bytes asked)")
            self._journal_bytes += len(group)
            self._ends.append(self._journal_bytes)
        except OSError as exc:  # disk full, ...: commit this batch to DuckDB directly instead
            self._report(f"cannot append to {self._journal_path} ({getattr(exc, 'strerror', None) or exc}); "
                         f"committing to {self.path} directly")
            self._fold_process = False
            self._take_back()
            try:
                os.ftruncate(self._journal, self._journal_bytes)  # a group cut short would hide later ones
            except OSError:
                pass
            self._fold()  # what the journal holds first, then this batch, as the group after it
            if self._fold_failed:  # committing it alone would mark the journal's groups as folded
                raise
            _commit(self._con, {name: [t] for name, t in tables.items() if t.num_rows}, self._group)
            self._folded = self._group

    def _fold(self) -> None:
        """Fold what the journal holds into DuckDB (one verified transaction), then empty the journal,
        or, when it holds a bad group, keep it as rank-N.journal.damaged and start a new one. After a
        failed fold nothing more is folded: a DuckDB connection that failed may be unusable for good,
        and the journal alone keeps the run whole (`recover()` folds it after the run)."""
        self._folded_at = time.monotonic()
        if not self._journal_bytes or self._fold_failed:
            return
        try:
            fold = fold_journal(self._con, self._journal_path, self._folded, self._group)
        except Exception:
            self._fold_failed = True
            raise
        self._folded = fold.last
        self.folds += 1
        if fold.damage is not None:
            self._report(f"{fold.damage['reason']} (events from step {fold.damage['from_step']} on may be missing)")
        if fold.keep_as:
            self._keep_journal(fold.keep_as)
            return
        try:
            os.ftruncate(self._journal, 0)  # O_APPEND: the next group starts the file again
            self._journal_bytes, self._ends = 0, []
        except OSError:
            pass  # harmless: the groups it holds are at most `_folded` (and `journal_folded`): skipped

    def _keep_journal(self, name: str, done: int | None = None) -> None:
        """Set the journal aside under `name` (it holds a bad group) and go on in a new one; with
        `done` (the fold process folded the first `done` bytes), the new one starts with what was
        appended after those, and the journal is set aside by a link first: at every moment one of
        the two names holds what is not folded yet."""
        if done is not None and done < self._journal_bytes:
            try:
                os.link(self._journal_path, self._journal_path.parent / name)
            except OSError as exc:
                self._report(f"could not keep {self._journal_path.name} as {name} ({exc.strerror or exc})")
            self._drop_folded(done)
            return
        os.close(self._journal)
        try:
            os.replace(self._journal_path, self._journal_path.parent / name)
        except OSError as exc:  # the journal stays as it is: its good groups are folded, never taken twice
            self._report(f"could not keep {self._journal_path.name} as {name} ({exc.strerror or exc})")
        self._journal = os.open(self._journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._journal_bytes = os.fstat(self._journal).st_size
        self._ends = [self._journal_bytes] if self._journal_bytes else []  # (whole groups)

    # -- the fold process (folder.py) ---------------------------------------------------------
    def _fold_elsewhere(self) -> bool:
        """Ask the fold process to fold what the journal holds (started at the first fold; the
        writer closes its own connection for it): False when folding stays on this thread."""
        if not self._fold_process or self._fold_failed:
            return False
        self._folded_at = time.monotonic()
        if self._folder is None:
            try:
                self._con.close()
                self._con = None
                self._folder = FoldProcess(self.path, self._memory_limit)
                self.folder_pid = self._folder.pid
            except Exception as exc:  # noqa: BLE001 - fold here, as before
                print(f"bitguard: folding on the writer thread: the fold process did not start ({exc})",
                      file=sys.stderr)
                self._fold_process = False
                self._reconnect()
                return False
        if self._folder.busy or not self._journal_bytes:
            return True
        fits = [end for end in self._ends if end <= FOLD_CHUNK]
        self._asked = fits[-1] if fits else self._ends[0] if self._ends else self._journal_bytes
        try:
            self._folder.request(self._asked, self._folded, self._group)
        except FolderGone as exc:
            self._folder_gone(exc)
            return False
        return True

    def _answered(self, timeout: float) -> None:
        """Apply the fold process's reply when it has come: drop the folded bytes from the journal."""
        try:
            reply = self._folder.poll(timeout)
        except FolderGone as exc:
            self._folder_gone(exc)
            return
        if reply is not None:
            self._folded_by_folder(reply)

    def _folded_by_folder(self, reply: dict) -> None:
        if "error" in reply:  # as a failed fold on this thread: the journal keeps the run from here on
            self._fold_failed = True
            raise RuntimeError(reply["error"])
        self._folded = reply["last"]
        self.folds += 1
        if reply["damage"] is not None:
            damage = reply["damage"]
            self._report(f"{damage['reason']} (events from step {damage['from_step']} on may be missing)")
        if reply["keep_as"]:
            self._keep_journal(reply["keep_as"], self._asked)
        else:
            self._drop_folded(self._asked)

    def _read_journal(self, start: int) -> bytes:
        """The journal's bytes from `start` to its end (what the writer appended since)."""
        fd = os.open(self._journal_path, os.O_RDONLY)
        try:
            return os.pread(fd, self._journal_bytes - start, start)
        finally:
            os.close(fd)

    def _drop_folded(self, done: int) -> None:
        """The journal's first `done` bytes are folded: keep what was appended after them only. A
        copy of the rest replaces the journal at once (os.replace); a process killed before that
        leaves a journal whose folded groups every fold skips (journal_folded)."""
        try:
            if done >= self._journal_bytes:
                os.ftruncate(self._journal, 0)  # O_APPEND: the next group starts the file again
                self._journal_bytes, self._ends = 0, []
                return
            tail = self._read_journal(done)
            spare = _spare(self._journal_path)
            fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            try:  # (the new journal's descriptor, opened before it takes the journal's name)
                if os.write(fd, tail) != len(tail):
                    raise OSError(f"short write to {spare.name}")
                os.replace(spare, self._journal_path)
            except OSError:
                os.close(fd)
                raise
            os.close(self._journal)
            self._journal = fd
            self._journal_bytes = len(tail)
            self._ends = [end - done for end in self._ends if end > done]
        except OSError:
            pass  # harmless: the groups it holds are at most `_folded` (and `journal_folded`): skipped

    def _folder_gone(self, exc: BaseException) -> None:
        """The fold process died: take the rank file back (its last fold, if it committed, is in
        journal_folded) and fold on this thread from now on."""
        print(f"bitguard: folding on the writer thread from now on: {exc}", file=sys.stderr)
        self._fold_process = False
        try:
            self._folder.stop(timeout=10)
        except Exception:  # noqa: BLE001 - it is gone already
            pass
        self._folder = None
        self._reconnect()

    def _reconnect(self) -> None:
        try:
            self._con = db.connect(self.path, config=rank_db_config(self._memory_limit))
            self._folded = folded_upto(self._con)
        except Exception:
            self._fold_failed = True  # the journal keeps the run; recover() folds it after the run
            raise

    def _take_back(self) -> None:
        """Stop the fold process (after its fold in hand) and own the rank file again."""
        if self._folder is None:
            return
        folder, self._folder = self._folder, None
        try:
            reply = folder.stop()
        except FolderGone as exc:  # what it folded is on record (journal_folded); the rest is still journaled
            print(f"bitguard: folding on the writer thread from now on: {exc}", file=sys.stderr)
            reply = None
        try:
            if reply is not None:
                self._folded_by_folder(reply)
        except Exception as exc:  # noqa: BLE001 - the journal keeps every batch
            self._report(f"folding {self._journal_path.name} into {self.path} failed ({exc}); the journal keeps "
                         f"every batch (readers read it as it is; the launcher folds it)")
        try:
            self._reconnect()
        except Exception as exc:  # noqa: BLE001
            self._report(f"could not reopen {self.path} after the fold process ({exc}); the journal keeps "
                         f"every batch (the launcher folds it)")

    def _report(self, message: str) -> None:
        """Record and print a failure, each message once and at most MAX_REPORTED_ERRORS of them."""
        if message in self.errors or len(self.errors) > MAX_REPORTED_ERRORS:
            return
        if len(self.errors) == MAX_REPORTED_ERRORS:
            message = "more collector errors followed; they are not recorded"
        self.errors.append(message)
        print(f"bitguard: collector error: {message}", file=sys.stderr)
