"""The rank file writer: events go from the training thread to DuckDB on a writer thread.

The training thread appends rows to a small batch; full batches go through a bounded queue
(back-pressure: a full queue makes the training thread wait, memory never grows without
bound) to one writer thread. The writer resolves pending GPU digests, turns each batch into
Arrow tables and appends them, in one write, to the rank's journal (`rank-N.journal`): that is
what makes a batch durable against a killed process, at the cost of a file append. Every five
seconds, or once the journal passes two megabytes, it folds what the journal holds into
`rank-N.duckdb` in one transaction, reading the journal back from the file (the writer keeps no
rows in memory), and empties the journal. A DuckDB statement costs about a millisecond whatever
its size, and a fold has a fixed cost of a few milliseconds: too much to pay per step.
`step_barrier()`, called at the end of each training step, waits for the previous step's journal
write only: a killed run keeps every step before its last completed one, and the training thread
rarely waits for the writer.

A journal left behind by a killed process is folded by `recover()` (the `bitguard record`
launcher calls it when its child dies, and every reader calls it through ingest). The fold
records the last journal group it holds in the meta table (`journal_folded`) in the same
transaction, so a crash between the fold and the journal's truncation never duplicates rows.

A failing write is reported (stderr and `errors`), never raised into training. This module knows
the schema's tables but nothing about torch modules or hooks.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import sys
import threading
import time
import traceback
from pathlib import Path

import duckdb
import pyarrow as pa

from bitguard.schema import DUMPS, EVENTS, META, SCHEMA_VERSION, STACKS, TABLES, TENSORS

_ARROW_TYPES = {
    "BIGINT": pa.int64(),
    "INTEGER": pa.int32(),
    "VARCHAR": pa.string(),
    "UBIGINT": pa.uint64(),
    "BIGINT[]": pa.list_(pa.int64()),
    "BLOB": pa.binary(),
}


def arrow_schema(table) -> pa.Schema:
    return pa.schema([(c.name, _ARROW_TYPES[c.sql]) for c in table.columns])


_ROW_TABLES = (EVENTS, TENSORS, STACKS, DUMPS)  # the tables a batch carries, in journal order
_SCHEMAS = {t.name: arrow_schema(t) for t in _ROW_TABLES}
_XOR = TENSORS.names.index("xor")
_POS = TENSORS.names.index("pos")

FOLD_SECONDS = 5.0  # fold the journal into DuckDB at least this often ...
FOLD_BYTES = 2 << 20  # ... or once the journal holds this many bytes (mapped, not read, to fold it)
_GROUP = struct.Struct("<4sQI")  # magic, group number, number of tables
_PART = struct.Struct("<BQ")  # table index in _ROW_TABLES, length of its Arrow IPC stream
_END = struct.Struct("<4sQ")  # magic, group number: the group is whole only when this follows it
_MAGIC, _END_MAGIC = b"BGJ1", b"BGJE"
FOLDED_KEY = "journal_folded"
MAX_REPORTED_ERRORS = 20  # the store's and the collector's failures share one list (store.errors)


def journal_path(rank_path: str | os.PathLike) -> Path:
    """`rank-N.journal` beside `rank-N.duckdb`."""
    return Path(rank_path).with_suffix(".journal")


def _to_arrow(rows: list, schema: pa.Schema) -> pa.Table:
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


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def encode_group(number: int, tables: dict[str, pa.Table]) -> bytes:
    """One journal group: the batch's non-empty tables, then the end mark that makes it whole."""
    parts = [(i, _ipc(tables[t.name])) for i, t in enumerate(_ROW_TABLES) if tables[t.name].num_rows]
    out = [_GROUP.pack(_MAGIC, number, len(parts))]
    for i, data in parts:
        out += [_PART.pack(i, len(data)), data]
    out.append(_END.pack(_END_MAGIC, number))
    return b"".join(out)


def decode_groups(data: bytes | pa.Buffer) -> list[tuple[int, dict[str, pa.Table]]]:
    """The whole groups of a journal, in order (their tables are views of `data`, not copies); a
    group cut short by a crash ends the list."""
    groups, at = [], 0
    data = pa.py_buffer(data) if isinstance(data, bytes) else data
    while at + _GROUP.size <= len(data):
        magic, number, count = _GROUP.unpack_from(data, at)
        if magic != _MAGIC:
            break
        at += _GROUP.size
        tables = {}
        try:
            for _ in range(count):
                index, length = _PART.unpack_from(data, at)
                at += _PART.size
                if at + length > len(data):
                    raise ValueError("cut short")
                table = _ROW_TABLES[index]
                tables[table.name] = pa.ipc.open_stream(data.slice(at, length)).read_all()
                at += length
            end, end_number = _END.unpack_from(data, at)
        except (ValueError, IndexError, struct.error, pa.ArrowInvalid):
            break
        if end != _END_MAGIC or end_number != number:
            break
        at += _END.size
        groups.append((number, tables))
    return groups


def fold_journal(con: duckdb.DuckDBPyConnection, journal: Path, upto: int) -> tuple[int, int]:
    """Insert the journal's whole groups numbered above `upto` into `con`, in one transaction that
    also records the last one's number as `journal_folded`: (groups folded, last group folded or
    `upto`). The file is mapped, not read into memory: the tables are views of the page cache,
    unmapped when the last of them goes."""
    with pa.memory_map(str(journal), "r") as source:
        groups = [(n, t) for n, t in decode_groups(source.read_buffer()) if n > upto]
    if not groups:
        return 0, upto
    _commit(con, {t.name: [g[t.name] for _, g in groups if t.name in g] for t in _ROW_TABLES}, groups[-1][0])
    return len(groups), groups[-1][0]


def folded_upto(con: duckdb.DuckDBPyConnection) -> int:
    """The last journal group the rank file holds (-1: none)."""
    folded = con.execute(f"SELECT value FROM {META.name} WHERE key = ?", [FOLDED_KEY]).fetchall()
    return json.loads(folded[0][0]) if folded else -1


def _insert(con: duckdb.DuckDBPyConnection, tables: dict[str, list[pa.Table]]) -> None:
    for name, parts in tables.items():
        if parts:
            con.from_arrow(pa.concat_tables(parts)).insert_into(name)


def _commit(con: duckdb.DuckDBPyConnection, parts: dict[str, list[pa.Table]], last_group: int) -> None:
    """Insert the tables and record `last_group` as folded, in one transaction: all or nothing (on
    failure the journal still holds every row)."""
    con.execute("BEGIN")
    try:
        _insert(con, parts)
        _set_meta(con, {FOLDED_KEY: last_group})
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
        raise


def _set_meta(con: duckdb.DuckDBPyConnection, items: dict) -> None:
    rows = [(k, json.dumps(v, default=str)) for k, v in items.items()]
    con.executemany(f"DELETE FROM {META.name} WHERE key = ?", [(k,) for k, _ in rows])
    con.executemany(f"INSERT INTO {META.name} VALUES (?, ?)", rows)


def recover(rank_path: str | os.PathLike) -> int:
    """Fold a journal left by a killed recording into its rank file; the number of groups folded.

    Raises duckdb.Error when the rank file is open in another process (a recording still
    running) and OSError when the directory cannot be written.
    """
    journal = journal_path(rank_path)
    if not journal.exists():
        return 0
    con = duckdb.connect(str(rank_path), config={"threads": 1})
    try:
        count, _ = fold_journal(con, journal, folded_upto(con))
        con.execute("CHECKPOINT")
    finally:
        con.close()
    journal.unlink()
    return count


class RankStore:
    """Owns `rank-N.duckdb` and its journal for the life of a recording."""

    def __init__(self, path: str, meta: dict, batch_events: int = 256, queue_batches: int = 32):
        self.path = path
        self.errors: list[str] = []
        self._batch_events = batch_events
        self._events: list[tuple] = []
        self._tensors: list[list] = []
        self._stacks: list[tuple] = []
        self._dumps: list[tuple] = []
        self._queue: queue.Queue = queue.Queue(maxsize=queue_batches)
        # One DuckDB thread and a small buffer pool: the writer is a guest beside the training's
        # own threads and memory (collector memory must stay bounded whatever the run length).
        # Rows not yet checkpointed stay in memory until the write-ahead log reaches the checkpoint
        # threshold: 4 MB instead of DuckDB's 16 MB takes about 4 MiB off the collector's peak.
        # (8 MB of buffer pool is too little: a checkpoint then fails, fatally for the connection.)
        self._con = duckdb.connect(path, config={"threads": 1, "memory_limit": "16MB", "checkpoint_threshold": "4MB"})
        for table in TABLES:
            self._con.execute(table.ddl())
        self.set_meta({"schema_version": SCHEMA_VERSION, "status": "running", **meta})
        self._journal_path = journal_path(path)
        self._journal = os.open(self._journal_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._group = 0
        self._journal_bytes = 0  # what the journal file holds
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

    def _push(self, marker: threading.Event | None = None) -> None:
        batch = (self._events, self._tensors, self._stacks, self._dumps, marker)
        self._events, self._tensors, self._stacks, self._dumps = [], [], [], []
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
        if self._fold_failed:  # the journal holds the run: leave it, and the rank file, for recover()
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
            events, tensors, stacks, dumps, marker = batch
            try:
                if events or stacks:
                    self._write(events, tensors, stacks, dumps)
            except Exception as exc:  # noqa: BLE001
                self._report(f"writing {len(events)} events to {self.path} failed: {exc}")
                traceback.print_exc(file=sys.stderr)
            try:
                if time.monotonic() - self._folded_at >= FOLD_SECONDS or self._journal_bytes >= FOLD_BYTES:
                    self._fold()
            except Exception as exc:  # noqa: BLE001
                self._report(f"folding {self._journal_path.name} into {self.path} failed ({exc}); the journal keeps "
                             f"every batch from here on and is folded when the run is next read")
            finally:
                if marker is not None:
                    marker.set()

    def _write(self, events: list[tuple], tensors: list[list], stacks: list[tuple], dumps: list[tuple]) -> None:
        """Journal one batch: one append, and the batch is durable once it returns."""
        _resolve_digests(tensors)
        tables = {EVENTS.name: _to_arrow(events, _SCHEMAS[EVENTS.name]),
                  TENSORS.name: _to_arrow(tensors, _SCHEMAS[TENSORS.name]),
                  STACKS.name: _to_arrow(stacks, _SCHEMAS[STACKS.name]),
                  DUMPS.name: _to_arrow(dumps, _SCHEMAS[DUMPS.name])}
        self._group += 1
        group = encode_group(self._group, tables)
        try:
            if os.write(self._journal, group) != len(group):
                raise OSError(f"short write ({len(group)} bytes asked)")
            self._journal_bytes += len(group)
        except OSError as exc:  # disk full, ...: commit this batch to DuckDB directly instead
            self._report(f"cannot append to {self._journal_path} ({getattr(exc, 'strerror', None) or exc}); "
                         f"committing to {self.path} directly")
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
        """Fold what the journal holds into DuckDB (one transaction), then empty the journal. After a
        failed fold nothing more is folded: a DuckDB connection that failed may be unusable for good,
        and the journal alone keeps the run whole (`recover()` folds it when the run is read)."""
        self._folded_at = time.monotonic()
        if not self._journal_bytes or self._fold_failed:
            return
        try:
            _, self._folded = fold_journal(self._con, self._journal_path, self._folded)
        except Exception:
            self._fold_failed = True
            raise
        self.folds += 1
        try:
            os.ftruncate(self._journal, 0)  # O_APPEND: the next group starts the file again
            self._journal_bytes = 0
        except OSError:
            pass  # harmless: the groups it holds are at most `_folded` (and `journal_folded`): skipped

    def _report(self, message: str) -> None:
        """Record and print a failure, each message once and at most MAX_REPORTED_ERRORS of them."""
        if message in self.errors or len(self.errors) > MAX_REPORTED_ERRORS:
            return
        if len(self.errors) == MAX_REPORTED_ERRORS:
            message = "more collector errors followed; they are not recorded"
        self.errors.append(message)
        print(f"bitguard: collector error: {message}", file=sys.stderr)
