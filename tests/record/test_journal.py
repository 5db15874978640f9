"""The rank journal: each batch is durable when journaled, DuckDB takes them in folds, and a journal
left by a killed process is folded back by whoever reads the run next, never twice."""

import os
import signal
import subprocess
import sys
import textwrap

import duckdb
import pyarrow as pa
import pytest

from bitguard.backend.ingest import load_rank, open_run
from bitguard.collectors import store
from bitguard.errors import CorruptRun
from bitguard.schema import EVENTS, TENSORS


def _tables(first_seq: int, n: int) -> dict[str, pa.Table]:
    events = [(s, 0, 1, 0, "forward", f"m{s}", "Linear", "module", 0, 1, "MainThread", "cpu", None, s, s + 1, 0)
              for s in range(first_seq, first_seq + n)]
    tensors = [[s, "output", 0, "", [2, 3], "float32", [3, 1], 24, s, s * 7, s, 0]
               for s in range(first_seq, first_seq + n)]
    return {EVENTS.name: store._to_arrow(events, store._SCHEMAS[EVENTS.name]),
            TENSORS.name: store._to_arrow(tensors, store._SCHEMAS[TENSORS.name]),
            "stacks": store._to_arrow([], store._SCHEMAS["stacks"]),
            "dumps": store._to_arrow([], store._SCHEMAS["dumps"])}


def _rows(first_seq: int, n: int):
    """`_write`'s arguments for n events with a tensor each."""
    t = _tables(first_seq, n)
    return ([tuple(r.values()) for r in t[EVENTS.name].to_pylist()],
            [list(r.values()) for r in t[TENSORS.name].to_pylist()], [], [])


def test_a_group_cut_short_is_dropped_whole_and_the_ones_before_it_kept():
    whole = store.encode_group(1, _tables(0, 3)) + store.encode_group(2, _tables(3, 2))
    last = store.encode_group(3, _tables(5, 4))
    assert [n for n, _ in store.decode_groups(whole + last)] == [1, 2, 3]
    for cut in range(len(last)):  # the process died while writing group 3, at every possible byte
        groups = store.decode_groups(whole + last[:cut])
        assert [n for n, _ in groups] == [1, 2]
    seqs = [t["events"]["seq"].to_pylist() for _, t in store.decode_groups(whole)]
    assert seqs == [[0, 1, 2], [3, 4]]


def _rank_file_with_journal(tmp_path, folded_groups: int, journaled: int):
    """A rank file holding `folded_groups` groups and a journal of groups 1..journaled, as a recorder
    killed between its fold and the journal's truncation leaves them."""
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {})
    s._queue.put(None)
    s._thread.join()
    for g in range(1, journaled + 1):
        data = store.encode_group(g, _tables(10 * g, 2))
        os.write(s._journal, data)
        s._group, s._journal_bytes = g, s._journal_bytes + len(data)
        if g == folded_groups:
            # the fold commits; the truncation hits another file, as if the process died in between
            journal = s._journal
            s._journal = os.open(tmp_path / "elsewhere", os.O_WRONLY | os.O_CREAT)
            s._fold()
            os.close(s._journal)
            s._journal = journal
    os.close(s._journal)
    s._con.close()
    return path


def _seqs(path):
    con = duckdb.connect(str(path), read_only=True)
    try:
        return [r[0] for r in con.sql("SELECT seq FROM events ORDER BY seq").fetchall()]
    finally:
        con.close()


def test_a_fold_whose_truncation_failed_is_not_applied_twice_by_the_writer(tmp_path):
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {})
    s._queue.put(None)
    s._thread.join()
    for g in (1, 2):
        s._write(*_rows(10 * g, 2))
        if g == 1:  # fold group 1, but the journal cannot be emptied (say, the file went read-only)
            journal = s._journal
            s._journal = os.open(tmp_path / "elsewhere", os.O_RDONLY | os.O_CREAT)
            s._fold()
            os.close(s._journal)
            s._journal = journal
    assert store.journal_path(path).stat().st_size > 0
    s._fold()  # the journal holds groups 1 and 2; only 2 is new
    assert store.journal_path(path).stat().st_size == 0
    s._con.close()
    os.close(s._journal)
    assert _seqs(path) == [10, 11, 20, 21]


def test_recover_folds_only_the_groups_the_rank_file_lacks(tmp_path):
    path = _rank_file_with_journal(tmp_path, folded_groups=2, journaled=3)
    assert _seqs(path) == [10, 11, 20, 21]
    assert store.recover(path) == 1
    assert _seqs(path) == [10, 11, 20, 21, 30, 31]
    assert not store.journal_path(path).exists()
    assert store.recover(path) == 0  # nothing left: a second reader changes nothing


KILLED = textwrap.dedent("""
    import os, signal, sys
    import torch
    import bitguard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(sys.argv[1], determinism=False):
        for step in range(6):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # no launcher survives to fold the journal
""")


@pytest.mark.slow
def test_a_killed_process_leaves_a_journal_that_the_next_reader_folds(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    journal = out / "rank-0.journal"
    assert journal.stat().st_size > 0  # a run this short is folded only when it ends: all of it is here
    run = open_run(out)
    assert not journal.exists()
    events, _, _ = load_rank(run, 0)
    per_step = events.group_by("step").len().sort("step")
    steps = dict(zip(per_step["step"].to_list(), per_step["len"].to_list()))
    # step 3 had ended when the process died, so steps 0..2 are whole (step 3's own write may be cut)
    assert steps[0] == steps[1] == steps[2] > 0 and steps.get(3, 0) <= steps[0], steps
    assert max(steps) <= 3


def test_a_journal_that_cannot_be_folded_gets_one_line_saying_what_to_do(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    path = _rank_file_with_journal(out, folded_groups=0, journaled=2)
    (out / "manifest.json").write_text('{"tool": "bitguard", "schema_version": 1, "status": "failed", "world_size": 1}')

    def read_only(_path):  # what a read-only copy of the run gives (tests run as root, who may write anyway)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(store, "recover", read_only)
    with pytest.raises(CorruptRun) as err:
        open_run(out)
    message = str(err.value)
    assert "\n" not in message and "rank-0.journal" in message and "writable" in message
    monkeypatch.undo()
    assert _seqs(path) == []  # nothing was lost: the journal is still there for a writable copy
    assert store.recover(path) == 2 and _seqs(path) == [10, 11, 20, 21]


def test_a_journal_that_cannot_be_written_falls_back_to_committing_each_batch(tmp_path):
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {})
    os.close(s._journal)
    s._journal = os.open(tmp_path / "read-only", os.O_RDONLY | os.O_CREAT)  # every append fails
    for step in range(3):
        s.add((step, 0, 1, step, "forward", "m", "Linear", "module", 0, 1, "MainThread", "cpu", None, 0, 1, 0), [], [])
        assert s.step_barrier()
    s.step_barrier()
    s.close("complete")
    assert _seqs(path) == [0, 1, 2]  # every event made it, through DuckDB commits
    assert any("cannot append" in e for e in s.errors)


def test_a_fold_that_fails_is_reported_once_and_the_journal_keeps_the_run(tmp_path, monkeypatch, capfd):
    import torch

    import bitguard

    real, failures = store.fold_journal, []

    def broken(*args):  # what a DuckDB connection invalidated by a fatal error does from then on
        failures.append(1)
        raise duckdb.FatalException("database has been invalidated because of a previous fatal error")

    monkeypatch.setattr(store, "FOLD_SECONDS", 0.0)  # fold after every batch
    monkeypatch.setattr(store, "fold_journal", broken)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run", determinism=False):
        for _ in range(5):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    monkeypatch.setattr(store, "fold_journal", real)
    assert len(failures) == 1  # no fold is tried after a failed one
    assert capfd.readouterr().err.count("failed (") == 1
    assert (tmp_path / "run" / "rank-0.journal").stat().st_size > 0
    events, _, _ = load_rank(open_run(tmp_path / "run"), 0)  # the reader folds the journal
    assert sorted(events["step"].unique().to_list()) == [0, 1, 2, 3, 4]
    assert not (tmp_path / "run" / "rank-0.journal").exists()


def test_after_a_failed_fold_a_failed_append_does_not_mark_the_journal_folded(tmp_path):
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {})
    s._queue.put(None)
    s._thread.join()
    s._write(*_rows(10, 2))  # journaled, not folded
    s._fold_failed = True  # DuckDB gave up earlier
    journal = s._journal
    s._journal = os.open(tmp_path / "read-only", os.O_RDONLY | os.O_CREAT)  # the next append fails
    with pytest.raises(OSError):
        s._write(*_rows(20, 2))  # reported by the writer loop; nothing may claim group 1 folded
    os.close(s._journal)
    os.close(journal)
    s._con.close()
    assert store.recover(path) == 1 and _seqs(path) == [10, 11]
