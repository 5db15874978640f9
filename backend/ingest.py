"""Ingest: check that a folder is a readable bitguard run and load its events for analysis.

`open_run` validates a run directory (manifest, schema version, every rank file) and says in
one line what is wrong when it is not usable. `load_rank` reads one rank's events and tensor
digests into polars frames, with the alignment key of each event. Nothing here compares runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import polars as pl

from bitguard.errors import CorruptRun, NotARun, SchemaMismatch
from bitguard.schema import EVENTS, MANIFEST_NAME, SCHEMA_VERSION, TENSORS

_RANK_FILE = re.compile(r"^rank-(\d+)\.duckdb$")


@dataclass
class RunInfo:
    path: Path
    manifest: dict
    ranks: dict[int, Path]  # rank -> rank file
    world_size: int
    rank_meta: dict[int, dict] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def complete(self) -> bool:
        return self.manifest.get("status") == "complete" and all(
            m.get("status") == "complete" for m in self.rank_meta.values())

    def incomplete_reason(self) -> str | None:
        if self.complete:
            return None
        status = self.manifest.get("status", "unknown")
        bits = [f"status {status}"]
        if self.manifest.get("exit_status") not in (None, 0):
            bits.append(f"exit status {self.manifest['exit_status']}")
        if self.manifest.get("signal"):
            bits.append(f"killed by {self.manifest['signal']}")
        unfinished = [r for r, m in self.rank_meta.items() if m.get("status") != "complete"]
        if unfinished:
            bits.append("rank(s) " + ", ".join(map(str, unfinished)) + " did not finish writing")
        return "; ".join(bits)


def _in_use(path: Path) -> CorruptRun:
    return CorruptRun(f"{path} is open in another process (is that recording still running?); "
                      f"wait for it to finish or stop it, then compare again")


def _attach(con: duckdb.DuckDBPyConnection, path: Path, alias: str) -> None:
    try:
        con.execute(f"ATTACH '{path.as_posix()}' AS {alias} (READ_ONLY)")
    except duckdb.Error as exc:
        text = str(exc)
        if "lock" in text.lower():
            raise _in_use(path) from None
        raise CorruptRun(f"{path} is truncated or not a DuckDB file (was the run killed while writing, or the "
                         f"file cut short in a copy?); re-record it or copy it again ({text.splitlines()[0]})") from None


def _fold_journal(path: Path) -> None:
    """Fold what a killed recording left in `rank-N.journal` into its rank file (see store.py)."""
    from bitguard.collectors.store import journal_path, recover

    journal = journal_path(path)
    if not journal.exists():
        return
    try:
        recover(path)
    except duckdb.Error as exc:
        if "lock" in str(exc).lower():
            raise _in_use(path) from None
        raise CorruptRun(f"{path} cannot take back the events its recording left in {journal.name} "
                         f"({str(exc).splitlines()[0]}); re-record the run") from None
    except OSError as exc:
        raise CorruptRun(f"{journal} holds the last events of a killed recording and cannot be folded into "
                         f"{path.name} ({exc.strerror or exc}); copy the run directory somewhere writable and "
                         f"open it from there") from None


def _rank_meta(con: duckdb.DuckDBPyConnection, alias: str, path: Path) -> dict:
    try:
        tables = {r[0] for r in con.sql(
            f"SELECT table_name FROM information_schema.tables WHERE table_catalog = '{alias}'").fetchall()}
        missing = {EVENTS.name, TENSORS.name, "meta"} - tables
        if missing:
            raise CorruptRun(f"{path} lacks table(s) {', '.join(sorted(missing))}: not a bitguard rank file; "
                             f"re-record the run")
        return {k: json.loads(v) for k, v in con.sql(f"SELECT key, value FROM {alias}.meta").fetchall()}
    except duckdb.Error as exc:
        raise CorruptRun(f"{path} cannot be read ({str(exc).splitlines()[0]}); it may be truncated or corrupt: "
                         f"re-record it") from None


def open_run(path: str | Path) -> RunInfo:
    """Validate a run directory; raise a one-line NotARun/SchemaMismatch/CorruptRun when it is unusable."""
    path = Path(path)
    if not path.exists():
        raise NotARun(f"{path} does not exist; give a run directory written by 'bitguard record --out'")
    if not path.is_dir():
        raise NotARun(f"{path} is a file, not a run directory; give the folder that holds manifest.json")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise NotARun(f"{path} has no {MANIFEST_NAME}: it is not a bitguard run directory; record one with "
                      f"'bitguard record --out {path} -- python train.py'")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise CorruptRun(f"{manifest_path} is not valid JSON ({exc}); the run directory is damaged: re-record it") from None
    if not isinstance(manifest, dict) or manifest.get("tool") != "bitguard":
        raise NotARun(f"{manifest_path} was not written by bitguard; give a run directory from 'bitguard record'")
    version = manifest.get("schema_version")
    if not isinstance(version, int):
        raise CorruptRun(f"{manifest_path} has no schema_version; the run directory is damaged: re-record it")
    if version > SCHEMA_VERSION:
        raise SchemaMismatch(f"{path} was recorded with schema version {version}, newer than this bitguard reads "
                             f"({SCHEMA_VERSION}); upgrade bitguard (pip install -U bitguard)")
    if version < 1:
        raise SchemaMismatch(f"{path} has unknown schema version {version}; re-record it with this bitguard")
    ranks = {}
    for p in path.iterdir():
        m = _RANK_FILE.match(p.name)
        if m:
            ranks[int(m.group(1))] = p
    if not ranks:
        raise NotARun(f"{path} has a manifest but no rank-N.duckdb files: the recording wrote no events "
                      f"(did the script fail before training?); re-record it")
    info = RunInfo(path, manifest, dict(sorted(ranks.items())), int(manifest.get("world_size") or len(ranks)))
    con = duckdb.connect(":memory:")
    try:
        for rank, rank_path in info.ranks.items():
            alias = f"r{rank}"
            _fold_journal(rank_path)
            _attach(con, rank_path, alias)
            meta = _rank_meta(con, alias, rank_path)
            rank_version = meta.get("schema_version", version)
            if rank_version > SCHEMA_VERSION:
                raise SchemaMismatch(f"{rank_path} was recorded with schema version {rank_version}, newer than this "
                                     f"bitguard reads ({SCHEMA_VERSION}); upgrade bitguard")
            info.rank_meta[rank] = meta
    finally:
        con.close()
    return info


def load_rank(run: RunInfo, rank: int) -> tuple[pl.DataFrame, pl.DataFrame, dict[int, list[str]]]:
    """(events, tensors, stacks) of one rank. events are in seq order with a uint64 `key` column:
    the alignment key hash(step, phase, kind, boundary, module_type, tensor roles/shapes/dtypes),
    and `loose_key`, the same without module type and dtypes (to pair a retyped boundary)."""
    path = run.ranks[rank]
    con = duckdb.connect(":memory:")
    try:
        _attach(con, path, "r")
        try:
            events = con.sql(f"""
                WITH sig AS (
                  SELECT seq, string_agg(role || ':' || CAST(shape AS VARCHAR) || ':' || dtype, ';'
                                         ORDER BY role, idx) AS sig,
                         string_agg(role || ':' || CAST(shape AS VARCHAR), ';' ORDER BY role, idx) AS shapes
                  FROM r.{TENSORS.name} GROUP BY seq)
                SELECT e.*, hash(e.step, e.phase, e.kind, e.boundary, e.module_type, coalesce(s.sig, ''))
                       AS key,
                       hash(e.step, e.phase, e.kind, e.boundary, coalesce(s.shapes, '')) AS loose_key
                FROM r.{EVENTS.name} e LEFT JOIN sig s USING (seq)
                ORDER BY e.seq""").pl()
            tensors = con.sql(f"SELECT * FROM r.{TENSORS.name} ORDER BY seq, role, idx").pl()
            stacks = {sid: json.loads(frames) for sid, frames in con.sql(
                "SELECT stack_id, frames FROM r.stacks").fetchall()}
        except duckdb.Error as exc:
            raise CorruptRun(f"{path} cannot be read ({str(exc).splitlines()[0]}); it may be truncated or "
                             f"corrupt: re-record it") from None
    finally:
        con.close()
    return events, tensors, stacks
