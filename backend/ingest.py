"""Ingest: check that a folder is a readable bitguard run and load its events for analysis.

`open_run` validates a run directory (manifest, schema version, every rank file and journal) and
says in one line what is wrong when it is not usable. `load_rank` reads one rank's events and
tensor digests into polars frames, with the alignment key of each event; a column that holds one
value in every row (one thread, one device, nothing unobserved) is held as that value, and the
strings of few values and many rows (phase, kind, boundary, module type; a tensor's role and path:
`DICTIONARY`) as Categoricals, 4 bytes a row (`_read_compact`): code that uses `str.` on them casts
first, and a frame made to join them makes those columns Categorical too.

Reading never writes and never needs a write lock: a rank file is opened read-only (any number
of readers at once), and what a killed recording left in `rank-N.journal` is read beside it, in
memory (the groups above the rank file's `journal_folded`), not folded into it. Every file is
checked before anything opens it: only regular files inside the run directory (never a pipe,
which would block for ever), a rank file only when its header is DuckDB's, the manifest and the
meta table only as `bitguard.manifest` declares them, each table's columns only with the types
`bitguard.schema` gives them. No path or value from a run is ever part of an SQL text.

What the reader cannot vouch for is said, not hidden: `RunInfo.missing_ranks` (ranks of the
world size with no rank file) and `RunInfo.damage` (ranks whose journal lost a batch: from which
step their events cannot be trusted complete, and why). Nothing here compares runs.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
from pydantic import ValidationError

from bitguard import db, runfiles
from bitguard import manifest as manifest_model
from bitguard.backend.event_keys import with_keys
from bitguard.collectors import journal as journal_format
from bitguard.collectors.store import DAMAGE_KEY, FOLDED_KEY, journal_path
from bitguard.errors import BadInput, CorruptRun, NotARun, SchemaMismatch
from bitguard.backend.resumed import resume_cut, start_of_step
from bitguard.schema import API_EVENTS, EVENTS, KINDS, META, PHASES, REQUIRED, ROLES, SCHEMA_VERSION, STACKS, TENSORS, Column

# polars imports numpy on its first use through a proxy whose import is not thread-safe (polars
# 2.1: the proxy copies numpy's attributes over its own, numpy's `_globals` submodule among them,
# so a second thread inside the same import assigns into a module: TypeError). A comparison reads
# a rank's two sides in two threads, first thing in a spawned worker: the proxy is resolved here,
# on import, in one thread (a clean-clone CI hit the race once in test_rank_pool.py's pool).
pl.Series("warm", np.zeros(1))

_RANK_FILE = re.compile(r"^rank-(0|[1-9][0-9]{0,5})\.duckdb$")
MAX_META_ROWS = 10_000  # a rank's meta table holds a few dozen facts
MAX_VALUE_BYTES = 1 << 20  # one meta value or one call stack, as JSON text
_UNOBSERVED = Column("unobserved", "VARCHAR", "why the tensor could not be observed (NULL: observed)")


@dataclass
class RunInfo:
    path: Path
    manifest: dict
    ranks: dict[int, Path]  # rank -> rank file
    world_size: int
    rank_meta: dict[int, dict] = field(default_factory=dict)
    missing_ranks: list[int] = field(default_factory=list)  # ranks in range(world_size) without a rank file
    # rank -> {"from_step": first step whose events cannot be trusted complete (None: the whole rank),
    #          "reason": what was found}
    damage: dict[int, dict] = field(default_factory=dict)
    event_counts: dict[int, int] = field(default_factory=dict)  # rank -> events (rank file and journal)
    # added to every step number read from this run (`bitguard compare --resumed-at`): a process that
    # resumed a training from a checkpoint counted its own steps from 0
    step_shift: int = 0
    # `bitguard compare --resumed-at`: the step (after the shift) where the comparison of a resumed run
    # begins; each side's records before its first batch of that step are left out (resume_cut)
    resume_from: int | None = None
    # (rank, table, step_shift, resume_from) -> (rows,): a table `load_rank` read beside the events (rank_table)
    tables: dict = field(default_factory=dict, repr=False, compare=False)
    # rank -> the read-only connection `open_run(hold=True)` checked the rank file through, left open for the
    # first `load_rank` of it (a DuckDB database costs 16 ms of CPU to open: a third of a small comparison's
    # reading); never pickled (a worker process opens its own), closed by `release()`
    held: dict = field(default_factory=dict, repr=False, compare=False)

    def release(self) -> None:
        """Close the connections `open_run(hold=True)` left open that no `load_rank` took."""
        held = list(self.held.values())
        self.held.clear()  # (in place: a copy made by dataclasses.replace shares it)
        for con in held:
            con.close()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "held": {}}

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def complete(self) -> bool:
        return (self.manifest.get("status") == "complete" and self.manifest.get("complete", True) is True
                and all(m.get("status") == "complete" for m in self.rank_meta.values()))

    def incomplete_reason(self) -> str | None:
        if self.complete:
            return None
        status = self.manifest.get("status", "unknown")
        bits = [f"status {status}"]
        if self.manifest.get("exit_status") not in (None, 0):
            bits.append(f"exit status {self.manifest['exit_status']}")
        if self.manifest.get("signal"):
            bits.append(f"killed by {self.manifest['signal']}")
        if status == "complete" and self.manifest.get("complete", True) is not True:
            bits.append("its manifest says complete: false")
        by_status: dict[str, list[int]] = {}
        for r, m in self.rank_meta.items():
            if m.get("status") != "complete":
                by_status.setdefault(str(m.get("status")), []).append(r)
        for rank_status, ranks in by_status.items():
            which = "rank(s) " + ", ".join(map(str, ranks))
            # a rank still "running" was cut off while writing; a failed one closed its file when the script failed
            bits.append(f"{which} did not finish writing" if rank_status == "running" else f"{which} {rank_status}")
        return "; ".join(bits)


def _columns(table) -> list[Column]:
    """The columns load_rank returns for `table`, in order (tensors always end in `unobserved`, `shard`)."""
    columns = list(table.columns)
    if table is TENSORS and _UNOBSERVED.name not in table.names:
        columns.append(_UNOBSERVED)
    return columns


def _optional(table, column: str, rank_version: int) -> bool:
    """Whether a rank file of `rank_version` may lack `column` of `table` (it came later: NULL)."""
    return column in journal_format.LATER_COLUMNS.get(table.name, ()) and (
        column not in table.names or rank_version < SCHEMA_VERSION)


# -- opening a rank file -------------------------------------------------------------------------

def _in_use(path: Path) -> CorruptRun:
    return CorruptRun(f"{path} is open in another process (is that recording still running?); "
                      f"wait for it to finish or stop it, then run this command again")


def _first_line(exc: BaseException, path: Path) -> str:
    """DuckDB's first line, naming `path` as the user gave it (DuckDB writes the absolute path)."""
    text = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
    for spelled in {os.path.realpath(path), os.path.abspath(path)}:
        text = text.replace(spelled, str(path))
    return text


@contextmanager
def _reading(path: Path):
    """DuckDB failures while reading rank file `path` as one-line CorruptRuns: a lock conflict is
    "open in another process", anything else is damage."""
    try:
        yield
    except duckdb.Error as exc:
        if db.is_lock_error(exc) or "different configuration" in str(exc):
            raise _in_use(path) from None
        raise CorruptRun(f"{path} is corrupt or truncated ({_first_line(exc, path)}); was the run killed while writing, "
                         f"or the file damaged in a copy? Re-record it or copy it again") from None


def _connect(run_dir: Path, path: Path) -> duckdb.DuckDBPyConnection:
    """A read-only connection to rank file `path`, once it is known to be a regular DuckDB file."""
    head = runfiles.head(run_dir, path, db.HEADER_BYTES)
    if head is None:
        raise CorruptRun(f"{path} disappeared while the run was read; read the run again")
    problem = db.header_problem(head)
    if problem:
        raise CorruptRun(f"{path} is {problem}: not a bitguard rank file (was it cut short in a copy, or replaced?); "
                         f"re-record the run or copy it again")
    wal = path.with_name(path.name + ".wal")  # DuckDB opens it too
    runfiles.member(run_dir, wal)
    with _reading(path):
        return db.connect(path, read_only=True)


def _tables(con: duckdb.DuckDBPyConnection, path: Path) -> dict[str, dict[str, str]]:
    """table -> column -> DuckDB type, of the rank file; CorruptRun when a table bitguard reads is missing."""
    found: dict[str, dict[str, str]] = {}
    for table, column, sql in con.execute(
            "SELECT table_name, column_name, data_type FROM duckdb_columns() "
            "WHERE database_name = current_database() AND schema_name = 'main'").fetchall():
        found.setdefault(table, {})[column] = sql
    missing = [t.name for t in (EVENTS, TENSORS, STACKS, META) if t.name not in found]
    if missing:
        raise CorruptRun(f"{path} lacks table(s) {', '.join(missing)}: not a bitguard rank file; re-record the run")
    return found


def _check_columns(found: dict[str, dict[str, str]], path: Path, rank_version: int) -> dict[str, set[str]]:
    """The columns each table has; CorruptRun when one bitguard reads is missing or has another type
    than the schema's."""
    for table in (EVENTS, TENSORS, STACKS, META):
        have = found[table.name]
        for c in _columns(table):
            if c.name not in have:
                if _optional(table, c.name, rank_version):
                    continue
                raise CorruptRun(f"{path} lacks column {table.name}.{c.name}: not a bitguard rank file of schema "
                                 f"version {rank_version}; re-record the run")
            if have[c.name] != c.sql:
                raise CorruptRun(f"{path}: column {table.name}.{c.name} is {have[c.name]}, not {c.sql} as bitguard "
                                 f"writes it; the rank file is damaged: re-record the run")
    return {name: set(columns) for name, columns in found.items()}


def _read_rank(con: duckdb.DuckDBPyConnection, path: Path,
               default_version: int) -> tuple[dict, dict[str, set[str]], dict[str, dict[str, str]]]:
    """(meta, columns per table, column types per table) of an open rank file, checked."""
    found = _tables(con, path)
    meta = _meta(con, path)
    return meta, _check_columns(found, path, meta.get("schema_version", default_version)), found


def _meta(con: duckdb.DuckDBPyConnection, path: Path) -> dict:
    """The meta table's facts, each checked against `manifest.RankMeta`."""
    rows = con.execute(f"SELECT key, value FROM {META.name} LIMIT {MAX_META_ROWS + 1}").fetchall()
    if len(rows) > MAX_META_ROWS:
        raise CorruptRun(f"{path}: the meta table holds more than {MAX_META_ROWS:,} rows, which bitguard never "
                         f"writes; the rank file is damaged: re-record the run")
    meta = {}
    for key, value in rows:
        if key is None or value is None:
            raise CorruptRun(f"{path}: the meta table has a NULL {'key' if key is None else f'value for {key!r}'}; "
                             f"the rank file is damaged: re-record the run")
        if len(value) > MAX_VALUE_BYTES:
            raise CorruptRun(f"{path}: meta {key[:80]!r} is {len(value):,} characters, more than bitguard writes; "
                             f"re-record the run")
        try:
            meta[key] = runfiles.loads(value)
        except runfiles.JSONRefused as exc:
            raise CorruptRun(f"{path}: meta {key[:80]!r} is not valid JSON ({exc}); the rank file is damaged: "
                             f"re-record the run") from None
    version = meta.get("schema_version", 1)
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise SchemaMismatch(f"{path} was recorded with schema version {version}, newer than this bitguard reads "
                             f"({SCHEMA_VERSION}); upgrade bitguard")
    try:
        manifest_model.RankMeta.model_validate(meta)
    except ValidationError as exc:
        raise CorruptRun(f"{path}: {manifest_model.problem(manifest_model.RankMeta, exc, meta, 'meta')}; the rank "
                         f"file is damaged: re-record the run") from None
    return meta


# -- what the journal adds -----------------------------------------------------------------------

@dataclass
class _Leftover:
    """What rank-N.journal holds beyond the rank file: its whole groups above journal_folded."""

    tables: dict[str, list[pa.Table]]
    damage: dict | None


def _read_journal(run_dir: Path, path: Path) -> journal_format.Journal | None:
    data = runfiles.read(run_dir, journal_path(path))
    return None if data is None else journal_format.decode(data)


def _leftover(decoded: journal_format.Journal | None, folded: int, con: duckdb.DuckDBPyConnection,
              path: Path) -> _Leftover:
    if decoded is None:
        return _Leftover({}, None)
    tables: dict[str, list[pa.Table]] = {}
    for g in decoded.groups:
        if g.number > folded:
            for name, table in g.tables.items():
                tables.setdefault(name, []).append(table)

    def last_step():
        with _reading(path):
            return con.execute(f"SELECT max(step) FROM {EVENTS.name}").fetchall()[0][0]

    damage = decoded.damage(folded, last_step)
    if damage is not None:
        damage = {**damage, "reason": f"{journal_path(path).name}: {damage['reason']}"}
    return _Leftover(tables, damage)


def _journal_rows(leftover: _Leftover, table) -> pa.Table:
    """The leftover rows of `table` with exactly the columns `_columns(table)` (absent ones NULL)."""
    columns = _columns(table)
    schema = pa.schema([(c.name, journal_format.ARROW_TYPES[c.sql]) for c in columns])
    parts = leftover.tables.get(table.name, [])
    out = []
    for part in parts:
        arrays = [part.column(c.name) if c.name in part.schema.names else pa.nulls(part.num_rows, schema.field(i).type)
                  for i, c in enumerate(columns)]
        out.append(pa.Table.from_arrays(arrays, schema=schema))
    return pa.concat_tables(out) if out else schema.empty_table()


def _folded(meta: dict) -> int:
    folded = meta.get(FOLDED_KEY)
    return -1 if folded is None else folded


def _worst(*damages: dict | None) -> dict | None:
    """One damage record from several: the earliest step (None first), every reason."""
    found = [d for d in damages if d]
    if not found:
        return None
    steps = [d["from_step"] for d in found]
    return {"from_step": None if None in steps else min(steps), "reason": "; ".join(d["reason"] for d in found)}


def _recorded_damage(meta: dict) -> dict | None:
    """What an earlier fold recorded as lost from this rank's journal (meta journal_damage)."""
    damage = meta.get(DAMAGE_KEY)
    if not damage:
        return None
    kept = f" (kept as {damage['kept_as']})" if damage.get("kept_as") else ""
    return {"from_step": damage.get("from_step"), "reason": f"{damage['reason']}{kept}"}


# -- the run ---------------------------------------------------------------------------------------

def _rank_files(path: Path) -> dict[int, Path]:
    ranks = {}
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError as exc:
        raise NotARun(f"{path} cannot be listed ({exc.strerror or exc}); check its permissions") from None
    for name in names:
        m = _RANK_FILE.match(name)
        if m:
            ranks[int(m.group(1))] = path / name
    return dict(sorted(ranks.items()))


HOLD_RANKS = 2  # open_run(hold=True) keeps the connections of a run of at most this many ranks


def open_run(path: str | Path, hold: bool = False) -> RunInfo:
    """Validate a run directory; raise a one-line NotARun/SchemaMismatch/CorruptRun when it is unusable.
    `hold`: a run of at most HOLD_RANKS ranks keeps each rank file's connection open for its first
    `load_rank` (the caller then calls `release()` when done: compare.py does)."""
    path = Path(path)
    if not path.exists():
        raise NotARun(f"{path} does not exist; give a run directory written by 'bitguard record --out'")
    if not path.is_dir():
        raise NotARun(f"{path} is a file, not a run directory; give the folder that holds manifest.json")
    manifest = manifest_model.load(path)
    version = manifest["schema_version"]
    ranks = _rank_files(path)
    if not ranks:
        raise NotARun(f"{path} has a manifest but no rank-N.duckdb files: the recording wrote no events "
                      f"(did the script fail before training?); re-record it")
    world_size = manifest["world_size"]
    beyond = [r for r in ranks if r >= world_size]
    if beyond:
        raise CorruptRun(f"{ranks[beyond[0]]} is beyond the world size {world_size} of {path / 'manifest.json'}: "
                         f"a rank file from another recording? Remove it or re-record the run")
    info = RunInfo(path, manifest, ranks, world_size,
                   missing_ranks=[r for r in range(world_size) if r not in ranks])
    try:
        for rank, rank_path in ranks.items():
            _check_rank_file(info, rank, rank_path, version, hold and len(ranks) <= HOLD_RANKS)
    except BaseException:
        info.release()
        raise
    return info


def _check_rank_file(info: RunInfo, rank: int, rank_path: Path, version: int, hold: bool) -> None:
    """open_run's checks of one rank file; its meta, event count and damage into `info` (its connection
    into `info.held` when `hold`)."""
    path, world_size = info.path, info.world_size
    decoded = _read_journal(path, rank_path)  # before the rank file: a fold meanwhile is then seen there
    con = _connect(path, rank_path)
    try:
        with _reading(rank_path):
            meta = _read_rank(con, rank_path, version)[0]
            if meta.get("rank") not in (None, rank):
                raise CorruptRun(f"{rank_path} holds rank {meta['rank']}'s events, not rank {rank}'s: renamed "
                                 f"or copied over? Re-record the run")
            if meta.get("schema_version") not in (None, version):  # (a manifest edited to make a run look older)
                raise CorruptRun(f"{rank_path} was recorded with schema version {meta['schema_version']}, not the "
                                 f"{version} of {path / 'manifest.json'}: an edited manifest or a rank file from "
                                 f"another recording? Re-record the run")
            if meta.get("world_size") not in (None, world_size):
                raise CorruptRun(f"{rank_path} was recorded with world size {meta['world_size']}, not the "
                                 f"{world_size} of {path / 'manifest.json'}: a rank file from another "
                                 f"recording? Remove it or re-record the run")
            leftover = _leftover(decoded, _folded(meta), con, rank_path)
            count = con.execute(f"SELECT count(*) FROM {EVENTS.name}").fetchall()[0][0]
        if hold:
            info.held[rank], con = con, None
    finally:
        if con is not None:
            con.close()
    info.rank_meta[rank] = meta
    info.event_counts[rank] = count + _journal_rows(leftover, EVENTS).num_rows
    damage = _worst(_recorded_damage(meta), leftover.damage)
    if damage:
        info.damage[rank] = damage


def _select(table, present: set[str], source: str | None = None) -> str:
    """The SELECT list of `_columns(table)` from the rank file (`source` None: absent columns as
    NULL) or from a registered journal table. Names come from bitguard.schema only."""
    out = []
    for c in _columns(table):
        if source is None and c.name not in present:
            out.append(f"CAST(NULL AS {c.sql}) AS {c.name}")
        else:
            out.append(c.name)
    return f"SELECT {', '.join(out)} FROM {source or table.name}"


def _union(con: duckdb.DuckDBPyConnection, table, present: set[str], leftover: _Leftover) -> str:
    """The SELECT of `table`'s rows in the rank file and, registered on `con`, in its journal."""
    sql = _select(table, present)
    rows = _journal_rows(leftover, table)
    if rows.num_rows:
        con.register(f"_journal_{table.name}", rows)
        sql += f" UNION ALL {_select(table, present, f'_journal_{table.name}')}"
    return sql


def load_rank(run: RunInfo, rank: int) -> tuple[pl.DataFrame, pl.DataFrame, dict[int, list[str]]]:
    """(events, tensors, stacks) of one rank, rank file and journal together. events are in seq
    order with a uint64 `key` column: the alignment key hash(step, phase, kind, boundary,
    module_type, tensor roles/shapes/dtypes, and the part of a sharded tensor a rank holds: a
    shard is never paired with another part or with a whole tensor), `loose_key`, the same
    without module type and dtypes (to pair a retyped boundary), and `place_key`, only step,
    phase, kind, boundary and the shards held (to pair a re-signatured one: retype.py). tensors
    end in `unobserved` (NULL: observed) and `shard` (NULL: the digest covers the whole tensor)."""
    if rank not in run.ranks:
        raise BadInput(f"{run.path} has no rank {rank} (ranks present: {', '.join(map(str, run.ranks)) or 'none'}); "
                       f"compare a rank both runs hold")
    path = run.ranks[rank]
    decoded = _read_journal(run.path, path)
    # (a connection open_run held open since it checked the file: its shared lock kept a fold from writing meanwhile)
    con = run.held.pop(rank, None) or _connect(run.path, path)
    try:
        with _reading(path):
            meta, present, found = _read_rank(con, path, run.manifest.get("schema_version", 1))
            leftover = _leftover(decoded, _folded(meta), con, path)
            # (the API rows the comparison's result reads: from this snapshot, without opening the file again)
            run.tables[_table_key(run, rank, API_EVENTS)] = (_table_rows(con, run, path, API_EVENTS, found, leftover),)
            union = {t.name: _union(con, t, present[t.name], leftover) for t in (EVENTS, TENSORS, STACKS)}
            # no ORDER BY: the rows come in the order they were written, nearly always already in
            # order (DuckDB's sort cost more than reading); in_order sorts only what is not
            events = in_order(_shifted(_read_compact(con, union[EVENTS.name], _ONE_VALUE[EVENTS.name],
                                                     DICTIONARY[EVENTS.name]), run.step_shift), ("seq",))
            tensors = in_order(_read_compact(con, union[TENSORS.name], _ONE_VALUE[TENSORS.name],
                                             DICTIONARY[TENSORS.name]), ("seq", "role", "idx"))
            frames = con.sql(f"SELECT stack_id, frames FROM ({union[STACKS.name]})").fetchall()
    finally:
        con.close()
    _check_values(events, tensors, path)
    if run.resume_from is not None:
        seq, step, t_ns = resume_cut(events, run.resume_from)
        # (and a JSON file opened before it, whose event its step's end wrote: a checkpoint's config)
        kept = (pl.col("seq") >= seq) & ~((pl.col("step") == step) & (pl.col("t_start_ns") < (t_ns or 0)))
        events = events.filter(kept | start_of_step(events.filter(kept), step, "kind", "boundary"))
        tensors = tensors.filter(pl.col("seq").is_in(events["seq"].implode()))
    return with_keys(events, tensors), tensors, _stacks(frames, path)


def rank_table(run: RunInfo, rank: int, table) -> pl.DataFrame | None:
    """`table`'s rows of one rank, rank file and journal together, with the schema's columns; None
    when neither holds the table (a rank file written before schema version 4, or another mode).
    The API rows a `load_rank` of this run read with its events are those (`RunInfo.tables`)."""
    held = run.tables.get(_table_key(run, rank, table))
    if held is not None:
        return held[0]
    path = run.ranks[rank]
    decoded = _read_journal(run.path, path)
    # (a connection open_run held open since it checked the file: its shared lock kept a fold from writing meanwhile)
    con = run.held.pop(rank, None) or _connect(run.path, path)
    try:
        with _reading(path):
            found = _tables(con, path)
            leftover = _leftover(decoded, _folded(_meta(con, path)), con, path)
            return _table_rows(con, run, path, table, found, leftover)
    finally:
        con.close()


def _table_key(run: RunInfo, rank: int, table) -> tuple:
    return rank, table.name, run.step_shift, run.resume_from


def _table_rows(con: duckdb.DuckDBPyConnection, run: RunInfo, path: Path, table, found: dict[str, dict[str, str]],
                leftover: _Leftover) -> pl.DataFrame | None:
    """rank_table's rows, from an open rank file (`found`: its tables' columns) and its journal's `leftover`."""
    rows = _journal_rows(leftover, table)
    if table.name not in found and not leftover.tables.get(table.name):
        return None
    parts = []
    if table.name in found:
        have = found[table.name]
        for c in table.columns:
            if c.name in have and have[c.name] != c.sql:
                raise CorruptRun(f"{path}: column {table.name}.{c.name} is {have[c.name]}, not {c.sql} as "
                                 f"bitguard writes it; the rank file is damaged: re-record the run")
        parts.append(_select(table, set(have)))
    if rows.num_rows:
        con.register(f"_journal_{table.name}", rows)
        parts.append(_select(table, set(table.names), f"_journal_{table.name}"))
    frame = _shifted(con.sql(" UNION ALL ".join(parts)).pl(), run.step_shift) if parts else None
    if frame is not None and run.resume_from is not None and "step" in frame.columns:
        events = _shifted(con.sql(_union(con, EVENTS, set(found.get(EVENTS.name, ())), leftover)).pl(),
                          run.step_shift)
        step, t_ns = resume_cut(events, run.resume_from)[1:]
        kept = pl.col("step") >= step
        if t_ns is not None and "t_ns" in frame.columns:
            kept = (pl.col("step") > step) | (kept & (pl.col("t_ns") >= t_ns))
        kept = kept.fill_null(False)
        if "kind" in frame.columns and "target" in frame.columns:
            kept = kept | start_of_step(frame.filter(kept), step, "kind", "target")
        frame = frame.filter(kept)
    return frame


def _shifted(frame: pl.DataFrame, shift: int) -> pl.DataFrame:
    """`frame` with `shift` added to its `step` column (RunInfo.step_shift), as it is otherwise."""
    if not shift or "step" not in frame.columns:
        return frame
    return frame.with_columns(pl.col("step") + pl.lit(shift, dtype=frame.schema["step"]))


# Columns that hold one value in every row of most rank files (one rank, one thread and device, no
# stream on CPU, one dtype, every tensor observed, nothing sharded): `_read_compact` holds those as that value.
_ONE_VALUE = {EVENTS.name: ("rank", "world_size", "thread", "device", "stream"),
              TENSORS.name: ("dtype", "unobserved", "shard")}
# String columns of few values and many rows, held as polars Categoricals: 4 bytes a row, not a
# 16-byte string view (docs/PERFORMANCE.md, "Where a side's memory goes"). Every frame load_rank
# gives has these columns as Categorical, whatever the run holds.
DICTIONARY = {EVENTS.name: ("phase", "boundary", "module_type", "kind"), TENSORS.name: ("role", "path")}


def _read_compact(con: duckdb.DuckDBPyConnection, sql: str, columns: tuple[str, ...],
                  dictionary: tuple[str, ...] = ()) -> pl.DataFrame:
    """The rows of `sql`, each of `columns` and `dictionary` that holds the same value in every row
    (NULL counted as a value) held as that one value: polars keeps such a column as a scalar instead
    of a slot a row (16 bytes a row for a string), and every expression, filter, join and row reads
    it as before. (A column taken out as a Series, `frame[name]`, is made whole and kept so: read
    these through expressions.) Those columns are never read: one dropped from a frame DuckDB made
    keeps its memory (a batch's columns are freed together; docs/PERFORMANCE.md). DuckDB says first
    which they are. The other `dictionary` columns are read as a DuckDB ENUM of the values they
    hold (a temporary type, made by DuckDB from the column: no value is ever part of an SQL text),
    which polars takes as a Categorical without a string a row; all of them end Categorical."""
    schema = con.sql(f"SELECT * FROM ({sql}) LIMIT 0").pl().schema
    present = [c for c in (*columns, *dictionary) if c in schema]
    one = {}
    rows = 0
    if present:
        stats = con.sql(f"SELECT count(*), {', '.join(f'min({c}), max({c}), count({c})' for c in present)} "
                        f"FROM ({sql})").fetchall()[0]
        rows = stats[0]
        for i, c in enumerate(present):
            low, high, count = stats[1 + 3 * i:4 + 3 * i]
            if rows >= 2 and (count == 0 or (count == rows and low == high)):
                one[c] = None if count == 0 else low
    cast = [c for c in dictionary if c in schema and c not in one and rows >= 2]
    for c in cast:  # (names from bitguard.schema only; the values stay in DuckDB)
        con.execute(f"CREATE OR REPLACE TEMP TYPE _bg_{c} AS ENUM "
                    f"(SELECT DISTINCT {c} FROM ({sql}) WHERE {c} IS NOT NULL ORDER BY 1)")
    select = "SELECT *"
    if one:
        select += f" EXCLUDE ({', '.join(one)})"
    if cast:
        select += f" REPLACE ({', '.join(f'CAST({c} AS _bg_{c}) AS {c}' for c in cast)})"
    frame = con.sql(f"{select} FROM ({sql})").pl()
    kind = {c: pl.Categorical if c in dictionary else schema[c] for c in schema}
    return frame.with_columns(*(pl.lit(v, dtype=kind[c]).alias(c) for c, v in one.items()),
                              *(pl.col(c).cast(pl.Categorical) for c in dictionary if c in frame.columns)
                              ).select(list(schema))


def in_order(frame: pl.DataFrame, columns: tuple[str, ...]) -> pl.DataFrame:
    """`frame` sorted by `columns` (rows equal in all of them kept in their order): checked
    first, sorted only when it is not (strings compare bytewise, as DuckDB's ORDER BY does)."""
    if frame.height < 2:
        return frame
    ordered = pl.lit(True)
    for c in reversed(columns):  # lexicographic: c is greater, or equal and the rest in order
        ordered = (pl.col(c) > pl.col(c).shift()) | ((pl.col(c) == pl.col(c).shift()) & ordered)
    if frame.select(ordered.slice(1).all(ignore_nulls=False)).item():  # (a NULL: not known in order)
        return frame
    return frame.sort(list(columns), maintain_order=True)


def _check_values(events: pl.DataFrame, tensors: pl.DataFrame, path: Path) -> None:
    """CorruptRun when a column every row must hold is NULL, a vocabulary column holds a word bitguard
    never writes, or an event number repeats: a damaged (or hand-made) rank file, not a run to judge."""
    for frame, table in ((events, "events"), (tensors, "tensors")):
        for column in REQUIRED[table]:
            nulls = frame.select(pl.col(column).null_count()).item()
            if nulls:
                raise CorruptRun(f"{path}: column {table}.{column} is NULL in {nulls} row(s); the rank file is "
                                 f"damaged: re-record the run")
    for frame, table, column, words in ((events, "events", "phase", PHASES), (events, "events", "kind", KINDS),
                                        (tensors, "tensors", "role", ROLES)):
        odd = frame.filter(~pl.col(column).is_in(list(words)))[column].unique().head(3).to_list()
        if odd:
            raise CorruptRun(f"{path}: column {table}.{column} holds {', '.join(map(repr, odd))}, not one of "
                             f"{', '.join(words)}; the rank file is damaged: re-record the run")
    seq = events["seq"].to_numpy()  # in order (load_rank): a repeat is two equal neighbours
    if events.height > 1 and not (seq[1:] > seq[:-1]).all():
        raise CorruptRun(f"{path}: events.seq repeats an event number; the rank file is damaged: re-record the run")


def _stacks(rows: list[tuple], path: Path) -> dict[int, list[str]]:
    stacks = {}
    for sid, frames in rows:
        problem = None
        if frames is None or len(frames) > MAX_VALUE_BYTES:
            problem = "is NULL" if frames is None else f"is {len(frames):,} characters long"
        else:
            try:
                value = runfiles.loads(frames)
            except runfiles.JSONRefused as exc:
                problem = f"is not valid JSON ({exc})"
            else:
                if not isinstance(value, list) or not all(isinstance(f, str) for f in value):
                    problem = "is not a JSON list of strings"
        if problem:
            raise CorruptRun(f"{path}: stacks.frames of stack {sid} {problem}; the rank file is damaged: "
                             f"re-record the run")
        stacks[sid] = value
    return stacks
