"""The one way bitguard opens a DuckDB connection.

`connect(path, read_only=...)` takes the database path as a Python argument (never inside SQL),
with extension autoinstall and autoload off (DuckDB would otherwise fetch an extension from the
network when a file looks like SQLite), no file access beyond the database itself (`COPY ... TO`,
`read_csv` and the like are refused) and the configuration locked, so no statement can turn
these back on. `header_problem()` says whether a file's first bytes are a DuckDB database's, so
a caller can refuse anything else before DuckDB ever reads it; `is_lock_error()` tells a real
lock conflict (another process holds the file) from every other DuckDB failure. DuckDB takes a
backslash in a path for a folder separator, even on POSIX: such a file is read through a hard
link (or a copy) elsewhere, refused for writing, never handed to DuckDB as it is.

This module knows DuckDB and nothing about runs, ranks or what a message should tell the user.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import duckdb

from bitguard.errors import BadInput

SAFE_CONFIG = {
    "autoinstall_known_extensions": False,  # never download an extension
    "autoload_known_extensions": False,  # never load one because a file or a function asked for it
}
# A reader's results as Arrow string views, polars' own string layout: `.pl()` then takes DuckDB's
# strings as they are, where it copied each into a view of its own (a rank file read held both:
# 320 MB of a 3-million-event side, ~20% of its RSS; the frames are equal, dtypes included). Every
# read-only connection has it, so two in one process never differ in configuration.
READ_CONFIG = {"produce_arrow_string_view": True, "arrow_output_version": "1.4"}
# Set once the connection is open (DuckDB refuses a temp_directory in the same config as the first):
_LOCKDOWN = ("SET enable_external_access = false",  # no file or network access from SQL: only the database
             "SET lock_configuration = true")  # and no SET can undo any of this
# DuckDB prints a progress bar to stdout once a query has run 2 s: into a training's own output, `compare --json`'s
# document, the fold process's replies. A session setting (a second connection of this process to a database already
# locked down keeps DuckDB's default), set before the lockdown where DuckDB lets it be (in a Jupyter kernel without
# ipywidgets it refuses any change of it, and draws no bar on stdout there)
_NO_PROGRESS_BAR = "SET enable_progress_bar = false"
HEADER_BYTES = 12  # a DuckDB file: an 8-byte checksum, then the magic
_MAGIC, _MAGIC_AT = b"DUCK", 8
_SQLITE = b"SQLite format 3\x00"
# DuckDB's words when another process holds the file's lock (DuckDB 1.x and 2.x):
# 'IO Error: Could not set lock on file "...": Conflicting lock is held in ... (PID n)'
_LOCK_MESSAGES = ("Could not set lock on file", "Conflicting lock is held")
_OPENING = threading.Lock()  # connections of one process to one file share a database: lock it down once


def connect(path: str | os.PathLike, read_only: bool = False, config: dict | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection to `path` (":memory:" for none) with SAFE_CONFIG and `config` on top.

    A read-only connection spills to the system's temporary folder, never beside the file: a
    reader leaves the folder it reads untouched."""
    settings = dict(config or {})
    if read_only:
        settings.setdefault("temp_directory", os.path.join(tempfile.gettempdir(), "bitguard-duckdb"))
        settings.update(READ_CONFIG)
    settings.update(SAFE_CONFIG)
    name = os.fspath(path)
    if "\\" in name and name != ":memory:":
        return _through_links(name, read_only, settings)
    with _OPENING:
        return _locked_down(duckdb.connect(name, read_only=read_only, config=settings), path)


def _through_links(name: str, read_only: bool, settings: dict) -> duckdb.DuckDBPyConnection:
    """DuckDB reads a backslash in a path as a folder separator, even on POSIX (it would open, or
    create, another file), and resolves symbolic links before it does. A read-only connection opens
    a hard link of the file and its WAL in a private folder instead (a copy when the temporary
    folder is on another file system), removed once DuckDB holds the file open; a writer is refused."""
    if not read_only:
        raise BadInput(f"{name}: DuckDB reads the backslash in this path as a folder separator; "
                       f"use a folder name without one")
    folder = tempfile.mkdtemp(prefix="bitguard-link-")
    try:
        link = os.path.join(folder, "rank.duckdb")
        for source, target in ((name, link), (name + ".wal", link + ".wal")):
            if not os.path.exists(source):
                continue
            try:
                os.link(source, target)
            except OSError:
                shutil.copyfile(source, target)
        with _OPENING:
            return _locked_down(duckdb.connect(link, read_only=True, config=settings), name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _locked_down(con: duckdb.DuckDBPyConnection, path) -> duckdb.DuckDBPyConnection:
    try:
        locked, external = con.execute("SELECT current_setting('lock_configuration'), "
                                       "current_setting('enable_external_access')").fetchall()[0]
        if not locked:  # else another connection of this process already locked the same database
            try:
                con.execute(_NO_PROGRESS_BAR)
            except duckdb.Error:
                pass
            for statement in _LOCKDOWN:
                con.execute(statement)
        elif external:
            raise duckdb.InvalidInputException(f"{path} is already open in this process without bitguard's "
                                               f"safe settings")
    except duckdb.Error:
        con.close()
        raise
    return con


def header_problem(head: bytes) -> str | None:
    """None when `head` (a file's first HEADER_BYTES bytes or more) starts a DuckDB database; else
    what the file is instead, in a few words."""
    if not head:
        return "an empty file"
    if head.startswith(_SQLITE[: len(head)]) and len(head) >= 6:
        return "a SQLite database, not a DuckDB file"
    if len(head) < HEADER_BYTES:
        return f"only {len(head)} bytes long, too short for a DuckDB file"
    if head[_MAGIC_AT:_MAGIC_AT + len(_MAGIC)] != _MAGIC:
        return "not a DuckDB file (no DuckDB header)"
    return None


def is_lock_error(exc: BaseException) -> bool:
    """True only for DuckDB's refusal to open a file another process holds."""
    text = str(exc)
    return isinstance(exc, duckdb.Error) and any(m in text for m in _LOCK_MESSAGES)
