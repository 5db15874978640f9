"""The rank file writer: events go from the training thread to DuckDB on a writer thread.

The training thread appends rows to a small batch; full batches go through a bounded queue
(back-pressure: a full queue makes the training thread wait, memory never grows without
bound) to one writer thread that resolves pending GPU digests and inserts each batch in one
transaction. `step_barrier()`, called at the end of each training step, waits for the previous
step's commit only: a killed run keeps every step before its last completed one, and the
training thread rarely waits for the writer. A failing write is reported (stderr and `errors`),
never raised into training. This module knows the schema's tables but nothing about torch
modules or hooks.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import traceback

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


_SCHEMAS = {t.name: arrow_schema(t) for t in (EVENTS, TENSORS, STACKS, DUMPS)}
_XOR = TENSORS.names.index("xor")
_POS = TENSORS.names.index("pos")


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


class RankStore:
    """Owns `rank-N.duckdb` for the life of a recording."""

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
        self._con = duckdb.connect(path, config={"threads": 1, "memory_limit": "16MB"})
        for table in TABLES:
            self._con.execute(table.ddl())
        self.set_meta({"schema_version": SCHEMA_VERSION, "status": "running", **meta})
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

        The writer commits step k while step k+1 trains, so the training thread rarely waits;
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
        rows = [(k, json.dumps(v, default=str)) for k, v in items.items()]
        self._con.execute("BEGIN")
        self._con.executemany(f"DELETE FROM {META.name} WHERE key = ?", [(k,) for k, _ in rows])
        self._con.executemany(f"INSERT INTO {META.name} VALUES (?, ?)", rows)
        self._con.execute("COMMIT")

    def close(self, status: str, extra_meta: dict | None = None) -> None:
        """Flush, stop the writer, write the final status. Safe to call twice."""
        if self._closed:
            return
        self._push()
        self._queue.put(None)
        self._thread.join(timeout=120)
        self._closed = True
        try:
            self.set_meta({"status": status, "collector_errors": self.errors, **(extra_meta or {})})
            self._con.execute("CHECKPOINT")
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
            finally:
                if marker is not None:
                    marker.set()

    def _write(self, events: list[tuple], tensors: list[list], stacks: list[tuple], dumps: list[tuple]) -> None:
        _resolve_digests(tensors)
        tables = {
            EVENTS.name: _to_arrow(events, _SCHEMAS[EVENTS.name]),
            TENSORS.name: _to_arrow(tensors, _SCHEMAS[TENSORS.name]),
            STACKS.name: _to_arrow(stacks, _SCHEMAS[STACKS.name]),
            DUMPS.name: _to_arrow(dumps, _SCHEMAS[DUMPS.name]),
        }
        con = self._con
        con.execute("BEGIN")
        for name, table in tables.items():
            if table.num_rows:
                con.register("_batch", table)
                con.execute(f"INSERT INTO {name} SELECT * FROM _batch")
                con.unregister("_batch")
        con.execute("COMMIT")

    def _report(self, message: str) -> None:
        self.errors.append(message)
        print(f"bitguard: collector error: {message}", file=sys.stderr)
