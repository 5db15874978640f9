"""Ingest against hostile and broken run directories: every case is one line naming the user's path
and what to do (a BitguardError), never a traceback, a hang, a download, SQL run from a folder
name, or a write into the run; and what the reader cannot vouch for (missing ranks) is said."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import duckdb
import fixtures_runs
import polars as pl
import pyarrow as pa
import pytest

import bitguard
from bitguard import db
from bitguard.backend.ingest import DICTIONARY, _read_compact, load_rank, open_run
from bitguard.collectors import store
from bitguard.errors import BadInput, BitguardError, CorruptRun, NotARun
from bitguard.schema import EVENTS, SCHEMA_VERSION


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A valid two-rank run, copied by each test that changes it."""
    return fixtures_runs.write_run(str(tmp_path_factory.mktemp("pristine") / "run"), steps=2, world_size=2)


@pytest.fixture
def run(pristine, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(pristine, out)
    return out


def _refused(path, kind=BitguardError, *words) -> str:
    with pytest.raises(kind) as err:
        info = open_run(path)
        for rank in info.ranks:
            load_rank(info, rank)
    message = str(err.value)
    assert "\n" not in message and "Traceback" not in message, message
    for word in words:
        assert word in message, message
    return message


def _edit_manifest(run, **fields):
    manifest = json.loads((run / "manifest.json").read_text())
    manifest.update(fields)
    (run / "manifest.json").write_text(json.dumps(manifest))


def _sql(path, statement, params=()):
    con = duckdb.connect(str(path))
    try:
        con.execute(statement, list(params))
    finally:
        con.close()


# -- what the reader says it cannot vouch for ---------------------------------------------------

def test_a_rank_of_the_world_size_without_a_file_is_listed_missing(run):
    (run / "rank-1.duckdb").unlink()
    info = open_run(run)
    assert info.world_size == 2 and info.missing_ranks == [1] and list(info.ranks) == [0]
    assert open_run(run).event_counts[0] == len(load_rank(info, 0)[0])
    with pytest.raises(BadInput, match="no rank 1"):
        load_rank(info, 1)


def test_a_rank_file_from_another_recording_is_refused(run):
    shutil.copy(run / "rank-0.duckdb", run / "rank-5.duckdb")
    _refused(run, CorruptRun, "rank-5.duckdb", "world size 2")
    (run / "rank-5.duckdb").unlink()
    shutil.copy(run / "rank-0.duckdb", run / "rank-1.duckdb")  # rank 0's events under rank 1's name
    _refused(run, CorruptRun, "rank-1.duckdb", "rank 0's events")


# -- files that are not regular files ---------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["manifest.json", "rank-0.duckdb", "rank-0.journal", "rank-0.duckdb.wal"])
def test_a_named_pipe_is_refused_without_waiting_on_it(run, name):
    (run / name).unlink(missing_ok=True)
    os.mkfifo(run / name)
    _refused(run, CorruptRun, name, "named pipe")


@pytest.mark.parametrize("name", ["rank-0.journal", "rank-0.duckdb"])
def test_a_folder_or_socket_in_place_of_a_file_is_refused(run, name, tmp_path):
    (run / name).unlink(missing_ok=True)
    (run / name).mkdir()
    _refused(run, CorruptRun, name, "a folder")
    (run / name).rmdir()
    sock = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(run)  # a socket path must be short
    try:
        sock.bind(name)
    finally:
        os.chdir(cwd)
    try:
        _refused(run, CorruptRun, name, "a socket")
    finally:
        sock.close()


def test_a_link_out_of_the_run_directory_is_refused_and_one_inside_it_read(run, tmp_path):
    outside = tmp_path / "elsewhere.duckdb"
    shutil.move(run / "rank-0.duckdb", outside)
    (run / "rank-0.duckdb").symlink_to(outside)
    _refused(run, CorruptRun, "rank-0.duckdb", "outside the run directory")
    (run / "rank-0.duckdb").unlink()
    (run / "manifest.json").rename(run / "m.json")
    os.symlink("/dev/zero", run / "manifest.json")
    _refused(run, CorruptRun, "manifest.json", "outside the run directory")
    (run / "manifest.json").unlink()
    (run / "manifest.json").symlink_to("m.json")  # inside: fine
    shutil.move(outside, run / "data.duckdb")
    (run / "rank-0.duckdb").symlink_to("data.duckdb")
    assert len(load_rank(open_run(run), 0)[0]) > 0
    (run / "rank-0.journal").symlink_to("missing")
    _refused(run, CorruptRun, "rank-0.journal", "a link to nothing")


# -- rank files that are not DuckDB's -----------------------------------------------------------

@pytest.mark.parametrize("content, words", [
    (b"SQLite format 3\x00" + bytes(4096), "SQLite"),
    (b"", "empty"),
    (b"DUCK", "too short"),
    (os.urandom(8192), "not a DuckDB file"),
])
def test_a_rank_file_that_is_not_duckdb_is_refused_before_duckdb_reads_it(run, monkeypatch, content, words):
    (run / "rank-0.duckdb").write_bytes(content)

    def never(*args, **kw):  # DuckDB would autoload the sqlite extension, from the network
        raise AssertionError("DuckDB was handed a file that is not a DuckDB file")

    monkeypatch.setattr(db.duckdb, "connect", never)
    _refused(run, CorruptRun, "rank-0.duckdb", words)


def test_every_connection_refuses_extensions_and_file_access():
    con = db.connect(":memory:")
    try:
        settings = con.execute("SELECT current_setting('autoinstall_known_extensions'), "
                               "current_setting('autoload_known_extensions'), "
                               "current_setting('enable_external_access')").fetchall()[0]
        assert settings == (False, False, False)
        with pytest.raises(duckdb.Error):
            con.execute("COPY (SELECT 1) TO 'pwned.csv'")
        with pytest.raises(duckdb.Error):
            con.execute("SET enable_external_access = true")
    finally:
        con.close()
    assert not os.path.exists("pwned.csv")


def test_no_connection_prints_a_progress_bar(tmp_path):
    """DuckDB prints a progress bar to stdout once a query has run 2 s: the fold process's reply line
    became `100% ▕██...` under load (a `--dump` step of 20 MB: "folding ... failed (Extra data: line 1
    column 5)"), and it would land in a training's output and in `compare --json`'s document. (Under
    pytest DuckDB turns it off itself: a fresh Python is what users run.)"""
    probe = ("import sys; from bitguard import db\n"
             "for path, read_only in ((':memory:', False), (sys.argv[1], False), (sys.argv[1], True)):\n"
             "    con = db.connect(path, read_only=read_only)\n"
             "    print(con.execute(\"SELECT current_setting('enable_progress_bar')\").fetchall()[0][0])\n"
             "    con.close()\n")
    got = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "w.duckdb")], capture_output=True, text=True,
                         timeout=120)
    assert got.stdout.split() == ["False"] * 3, got.stdout + got.stderr


def test_only_a_real_lock_conflict_reads_as_open_in_another_process(run):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys; c = duckdb.connect(sys.argv[1]); print('held', flush=True); "
                               "sys.stdin.read()", str(run / "rank-0.duckdb")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        _refused(run, CorruptRun, "rank-0.duckdb", "open in another process")
    finally:
        holder.communicate("", timeout=60)
    data = bytearray((run / "rank-0.duckdb").read_bytes())
    for block in range(1, len(data) // 262144):  # every data block: DuckDB's checksum catches it
        data[block * 262144 + 500: block * 262144 + 508] = b"\xff" * 8
    (run / "rank-0.duckdb").write_bytes(bytes(data))
    message = _refused(run, CorruptRun, "rank-0.duckdb", "corrupt")
    assert "another process" not in message
    lock = duckdb.IOException('IO Error: Could not set lock on file "/x/rank-0.duckdb": Conflicting lock is held '
                              'in python (PID 1)')
    assert db.is_lock_error(lock)
    assert db.is_lock_error(duckdb.IOException("IO Error: Conflicting lock is held in python (PID 7)"))
    assert not db.is_lock_error(duckdb.IOException("Corrupt database file: computed checksum 1 does not match "
                                                   "stored checksum 2 in block at location 262144"))


# -- folder names are never SQL ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["q'dir", "x' AS z; COPY (SELECT 1) TO 'pwned.csv'; --", "a b;c\"d", "rün ☃ 數",
                                  "back\\slash"])
def test_a_folder_name_with_quotes_or_sql_compares_normally_and_runs_nothing(pristine, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / name
    shutil.copytree(pristine, copy)
    info = open_run(copy)
    assert info.path == copy and not info.damage and info.missing_ranks == []
    assert bitguard.compare(pristine, str(copy)).verdict == "identical"
    assert not list(tmp_path.rglob("pwned.csv")) and not os.path.exists("pwned.csv")


def test_duckdb_never_gets_a_path_with_a_backslash_it_would_read_as_a_separator(pristine, tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)  # where DuckDB would go for "a\\b"
    with pytest.raises(BadInput, match="backslash"):
        db.connect(tmp_path / "a\\b" / "rank-0.duckdb")
    assert not list((tmp_path / "a" / "b").iterdir())
    shutil.copytree(pristine, tmp_path / "a\\b" / "run")
    assert len(load_rank(open_run(tmp_path / "a\\b" / "run"), 0)[0]) > 0


# -- the manifest, through its model ----------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("world_size", "abc"), ("world_size", [2]), ("world_size", "1" * 5000), ("world_size", 0),
    ("world_size", 70000), ("world_size", True), ("world_size", 2.0),
    ("determinism", "on"), ("versions", []), ("versions", {"torch": 5}), ("status", {}),
    ("command", 7), ("steps", "0:3"), ("exit_status", "0"), ("devices", "cpu"),
])
def test_a_manifest_field_of_the_wrong_type_is_named(run, field, value):
    _edit_manifest(run, **{field: value})
    message = _refused(run, CorruptRun, "manifest.json", f"'{field}", "must be")
    assert len(message) < 400, message


def test_a_manifest_world_size_message_says_what_it_must_be(run):
    _edit_manifest(run, world_size="abc")
    message = _refused(run, CorruptRun)
    assert message == (f"{run}/manifest.json: field 'world_size' must be an integer between 1 and 65536 "
                       f"(got \"abc\"); re-record the run or fix the file")
    _edit_manifest(run, world_size=None)  # without it a missing rank could not be told from a smaller job
    _refused(run, CorruptRun, "'world_size' must be")
    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["world_size"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    _refused(run, CorruptRun, "'world_size' must be", "(missing)")


@pytest.mark.parametrize("text, words", [
    ('{"tool": "bitguard", "schema_version": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests deeper"),
    ('{"tool": "bitguard", "schema_version": 2, "world_size": ' + "1" * 5000 + "}", "not valid JSON"),
    ('{"tool": "bitguard", "schema_version": "1"}', "schema_version"),
    ('{"tool": "bitguard", "schema_version": 2, "pad": "' + "x" * (1 << 20) + '"}', "more than"),
    ("[1, 2]", "not written by bitguard"),
    ('{"schema_version": 1}', "not written by bitguard"),
])
def test_a_manifest_that_is_not_one_gets_one_line(run, text, words):
    (run / "manifest.json").write_text(text)
    _refused(run, BitguardError, "manifest.json", words)


def test_a_manifest_that_is_not_utf8_gets_one_line(run):
    (run / "manifest.json").write_bytes(b'{"tool": "bitguard", "schema_version": 2, "cwd": "\xff\xfe"}')
    _refused(run, CorruptRun, "manifest.json", "not valid JSON")


def test_fields_this_version_does_not_know_are_kept(run):
    _edit_manifest(run, from_the_future={"nested": [1, 2, {"three": 3}]})
    assert open_run(run).manifest["from_the_future"]["nested"][2] == {"three": 3}


def test_the_writer_builds_its_manifest_through_the_model():
    from bitguard import manifest

    built = manifest.new(["python", "train.py"], "full", 2, {"enabled": True}, (0, None), {"dump": False})
    assert manifest.Manifest.model_validate(built).world_size == 2 and built["steps"] == [0, None]
    with pytest.raises(ValueError, match="world_size"):
        manifest.new(["python"], "full", "2", {}, None)


def test_no_journal_means_no_surprise(run):
    assert not (run / "rank-0.journal").exists() and open_run(run).damage == {}


# -- the meta table, stacks and column types ---------------------------------------------------

@pytest.mark.parametrize("key, value, words", [
    ("schema_version", '"1"', "'schema_version' must be"),
    ("status", "5", "'status' must be"),
    ("status", "{not json", "not valid JSON"),
    ("journal_folded", "true", "'journal_folded' must be"),
    ("determinism", "[" * 200 + "]" * 200, "nests deeper"),
    ("status", None, "NULL"),
])
def test_a_meta_value_that_is_not_what_bitguard_writes_is_named(run, key, value, words):
    _sql(run / "rank-0.duckdb", "DELETE FROM meta WHERE key = ?", [key])
    _sql(run / "rank-0.duckdb", "INSERT INTO meta VALUES (?, ?)", [key, value])
    _refused(run, CorruptRun, "rank-0.duckdb", words)


def test_a_newer_rank_schema_is_a_schema_mismatch(run):
    from bitguard.errors import SchemaMismatch

    _sql(run / "rank-0.duckdb", "UPDATE meta SET value = ? WHERE key = 'schema_version'", [str(SCHEMA_VERSION + 1)])
    _refused(run, SchemaMismatch, "rank-0.duckdb", "upgrade bitguard")


def test_a_manifest_edited_to_an_older_schema_than_its_rank_files_is_refused(run):
    """The manifest's schema version decides what a comparison leaves out of both sides (events an
    older bitguard did not record): one edited to look older than its rank files would hide them."""
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "schema_version": SCHEMA_VERSION - 1}))
    _refused(run, CorruptRun, "rank-0.duckdb", f"schema version {SCHEMA_VERSION}, not the {SCHEMA_VERSION - 1}")


@pytest.mark.parametrize("frames, words", [("not json", "not valid JSON"), ('{"a": 1}', "not a JSON list of strings"),
                                           ("[1, 2]", "not a JSON list of strings")])
def test_a_call_stack_that_is_not_a_list_of_frames_is_named(run, frames, words):
    _sql(run / "rank-0.duckdb", "UPDATE stacks SET frames = ? WHERE stack_id = 1", [frames])
    _refused(run, CorruptRun, "rank-0.duckdb", "stacks.frames of stack 1", words)


@pytest.mark.parametrize("table, column, sql", [("tensors", "xor", "VARCHAR"), ("events", "step", "BIGINT"),
                                                ("tensors", "shape", "VARCHAR")])
def test_a_column_of_another_type_is_named(run, table, column, sql):
    _sql(run / "rank-0.duckdb", f"ALTER TABLE {table} ALTER {column} TYPE {sql}")
    _refused(run, CorruptRun, "rank-0.duckdb", f"{table}.{column}", sql)


def test_a_missing_table_or_column_is_named(run):
    _sql(run / "rank-0.duckdb", "ALTER TABLE events DROP COLUMN boundary")
    _refused(run, CorruptRun, "rank-0.duckdb", "events.boundary")
    _sql(run / "rank-1.duckdb", "DROP TABLE stacks")
    (run / "rank-0.duckdb").unlink()
    _refused(run, CorruptRun, "rank-1.duckdb", "lacks table(s) stacks")


def test_not_a_run_at_all(tmp_path):
    _refused(tmp_path / "nope", NotARun, "does not exist")
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", NotARun, "no manifest.json")


# -- readers at once, never writing -------------------------------------------------------------

def _killed_run(folder):
    """A run whose recorder died before folding: a rank file with a few events and a journal with more."""
    folder.mkdir()
    fixtures_runs.write_manifest(str(folder), 1, status="failed", complete=False)
    s = store.RankStore(str(folder / "rank-0.duckdb"), {"rank": 0, "world_size": 1})
    s._queue.put(None)
    s._thread.join()
    for step in range(4):
        events = [(10 * step + i, 0, 1, step, "forward", f"m{i}", "Linear", "module", 0, 1, "MainThread", "cpu",
                   None, 0, 1, 0) for i in range(3)]
        tensors = [[e[0], "output", 0, "", [2], "float32", [1], 8, e[0], e[0], e[0], 0, None] for e in events]
        s._write(events, tensors, [], [], ends_step=True)
        if step == 1:
            s._fold()  # steps 0 and 1 in the rank file, 2 and 3 in the journal
    os.close(s._journal)
    s._con.close()
    return folder


def _snapshot(folder):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_two_readers_at_once_both_read_a_killed_run_and_leave_it_as_it_was(tmp_path):
    run = _killed_run(tmp_path / "killed")
    assert (run / "rank-0.journal").stat().st_size > 0
    before = _snapshot(run)
    expected = list(range(0, 3)) + list(range(10, 13)) + list(range(20, 23)) + list(range(30, 33))
    for _ in range(5):
        results, errors = [], []

        def read():
            try:
                info = open_run(run)
                events, tensors, _ = load_rank(info, 0)
                results.append((events["seq"].to_list(), tensors["seq"].to_list(), info.event_counts[0]))
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                errors.append(exc)

        threads = [threading.Thread(target=read) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert results == [(expected, expected, 12)] * 2
    assert _snapshot(run) == before


def test_the_journal_is_read_in_the_events_the_counts_and_the_keys(tmp_path):
    run = _killed_run(tmp_path / "killed")
    events, tensors, _ = load_rank(open_run(run), 0)
    assert events.filter(events["step"] == 3)["key"].null_count() == 0
    by_step = events.group_by("step").agg(pl.col("key").n_unique()).sort("step")["key"].to_list()
    assert by_step == [3, 3, 3, 3]  # journal rows get the same alignment keys as rank-file rows
    assert set(EVENTS.names) <= set(events.columns) and tensors.columns[-2:] == ["unobserved", "shard"]


def test_a_column_of_one_value_is_never_read_and_reads_as_before():
    """A column of one value (NULL counted as one) is held as that value, not read from DuckDB: a column
    dropped after the read kept its memory (each of DuckDB's batches frees its columns together)."""
    n = 10_000
    frame = pl.DataFrame({"seq": range(n), "thread": ["MainThread-of-a-long-name"] * n,
                          "device": ["cpu"] * (n - 1) + ["cuda:0"], "shard": [None] * n},
                         schema={"seq": pl.Int64, "thread": pl.String, "device": pl.String, "shard": pl.String})
    con = duckdb.connect()
    try:
        con.register("frame", frame.to_arrow())
        read = con.sql("SELECT * FROM frame").pl()
        out = _read_compact(con, "SELECT * FROM frame", ("thread", "device", "shard", "absent"))
        assert out.estimated_size() < read.estimated_size() - n * 16, (out.estimated_size(), read.estimated_size())
        assert out.equals(frame) and out.schema == read.schema
        assert out.filter(pl.col("seq") >= n - 2).equals(frame.filter(pl.col("seq") >= n - 2))
        mixed = pl.DataFrame({"seq": [0, 1, 2], "thread": ["a", None, "a"]})  # a NULL is another value
        con.register("mixed", mixed.to_arrow())
        assert _read_compact(con, "SELECT * FROM mixed", ("thread",)).equals(mixed)
    finally:
        con.close()


def test_the_strings_of_few_values_read_as_categoricals_of_the_same_values():
    """ingest.DICTIONARY's columns come as Categoricals whatever they hold: many values (read as a
    DuckDB ENUM DuckDB makes from the column: a value with a quote or a semicolon is only a value),
    one value, NULLs, a single row; every value reads back as written."""
    n = 5_000
    odd = ["model.layer'); DROP TABLE events; --", "a\"b", "", "模块.0"]
    frames = {
        "many": pl.DataFrame({"seq": range(n), "boundary": [odd[i % 4] for i in range(n)],
                              "phase": ["forward"] * n, "kind": [None] * n}),
        "nulls": pl.DataFrame({"seq": range(3), "boundary": ["x", None, "x"], "phase": [None, "b", "a"],
                               "kind": ["m", "m", "m"]}),
        "one row": pl.DataFrame({"seq": [0], "boundary": ["x"], "phase": ["forward"], "kind": [None]},
                                schema={"seq": pl.Int64, "boundary": pl.String, "phase": pl.String, "kind": pl.String}),
    }
    con = duckdb.connect()
    try:
        for name, frame in frames.items():
            con.register("frame", frame.to_arrow())
            out = _read_compact(con, "SELECT * FROM frame", (), ("boundary", "phase", "kind", "absent"))
            assert all(out.schema[c] == pl.Categorical for c in ("boundary", "phase", "kind")), (name, out.schema)
            back = out.with_columns(pl.col(c).cast(pl.String) for c in ("boundary", "phase", "kind"))
            assert back.equals(frame.with_columns(pl.col("kind").cast(pl.String)), null_equal=True), name
            con.unregister("frame")
        assert con.sql("SELECT count(*) FROM duckdb_tables()").fetchall()[0][0] == 0
    finally:
        con.close()


def test_a_readers_strings_come_as_views_and_read_as_duckdb_writes_them(pristine):
    """A reader's results hold Arrow string views (polars' own layout, taken without a copy:
    bitguard/db.py READ_CONFIG); every column of a rank read is what DuckDB's plain output gives,
    the strings of few values (ingest.DICTIONARY) as Categoricals of the same values."""
    info = open_run(pristine)
    events, tensors, _ = load_rank(info, 0)
    con = db.connect(info.ranks[0], read_only=True)
    try:
        types = con.sql("SELECT boundary, role FROM events JOIN tensors USING (seq) LIMIT 1").to_arrow_table().schema.types
    finally:
        con.close()
    assert all(pa.types.is_string_view(t) for t in types), types
    plain = duckdb.connect(str(info.ranks[0]), read_only=True)  # DuckDB's defaults: strings as offsets and bytes
    try:
        assert plain.sql("SELECT boundary FROM events LIMIT 1").to_arrow_table().schema.types == [pa.string()]
        for frame, table in ((events, "events"), (tensors, "tensors")):
            columns = [c for c in frame.columns if c not in ("key", "loose_key", "place_key")]
            want = plain.sql(f"SELECT {', '.join(columns)} FROM {table}").pl().with_columns(
                pl.col(c).cast(pl.Categorical) for c in DICTIONARY[table])
            assert frame.select(columns).equals(want, null_equal=True) and frame.select(columns).schema == want.schema
    finally:
        plain.close()


def test_a_held_connection_serves_the_first_read_is_never_pickled_and_is_released(pristine, monkeypatch):
    """open_run(hold=True) (compare's) keeps the connection it checked each rank file through for that rank's
    first load_rank: one DuckDB database opened per rank file, not two. A worker process gets none (it opens
    its own), and release() closes what no read took."""
    import pickle

    opened, real = [], db.connect
    monkeypatch.setattr(db, "connect", lambda path, *args, **kw: opened.append(os.path.basename(path))
                        or real(path, *args, **kw))
    info = open_run(pristine, hold=True)
    assert sorted(info.held) == [0, 1] and sorted(opened) == ["rank-0.duckdb", "rank-1.duckdb"]
    assert pickle.loads(pickle.dumps(info)).held == {} and info.held
    events, _, _ = load_rank(info, 0)
    assert events.height and sorted(info.held) == [1] and len(opened) == 2  # (rank 0 read through the held one)
    left = info.held[1]
    info.release()
    assert info.held == {}
    with pytest.raises(duckdb.ConnectionException):
        left.execute("SELECT 1")
    load_rank(info, 1)  # (a read after the release opens the file again)
    assert opened.count("rank-1.duckdb") == 2
