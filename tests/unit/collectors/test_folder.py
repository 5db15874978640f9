"""The fold process (collectors/folder.py): the rank file folded beside the training, nothing lost
whether it folds, dies, never starts, meets a damaged journal or outlives a killed training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import duckdb
import pytest

from bitguard.collectors import journal, store
from bitguard.collectors.folder import FoldProcess
from bitguard.schema import TENSORS


def _batch(first: int, n: int, step: int):
    """`_write`'s events and tensors for n events with a tensor each, all of one step."""
    events = [(s, 0, 1, step, "forward", f"m{s}", "Linear", "module", 0, 1, "MainThread", "cpu", None, s, s + 1, 0)
              for s in range(first, first + n)]
    tensors = [[s, "output", 0, "", [2, 3], "float32", [3, 1], 24, s, s * 7, s, 0]
               + [None] * (len(TENSORS.columns) - 12) for s in range(first, first + n)]
    return events, tensors


def _add(s: store.RankStore, first: int, n: int, step: int) -> None:
    events, tensors = _batch(first, n, step)
    for e, t in zip(events, tensors):
        s.add(e, [t], [])


def _seqs(path) -> list[int]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return [r[0] for r in con.sql("SELECT seq FROM events ORDER BY seq").fetchall()]
    finally:
        con.close()


def _until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(") ", 1)[1][0] != "Z"


def _steps(s: store.RankStore, steps: int, first_step: int = 0, per_step: int = 40) -> int:
    """Record `steps` steps of `per_step` events, 20 ms apart; the next seq."""
    seq = first_step * per_step
    for step in range(first_step, first_step + steps):
        _add(s, seq, per_step, step)
        seq += per_step
        assert s.step_barrier(timeout=30)
        time.sleep(0.02)
    return seq


def test_folds_run_in_the_fold_process_and_keep_every_row(tmp_path, monkeypatch):
    monkeypatch.setenv("BITGUARD_FOLD_PROCESS", "1")
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {}, batch_events=16, fold_seconds=0.05)
    seq = 0
    while s.folds < 3:  # the first fold starts the fold process; its replies count
        seq = _steps(s, 5, seq // 40)
    pid = s.folder_pid
    assert pid is not None and s._con is None  # the writer thread only journals: the fold process owns the file
    seq = _steps(s, 10, seq // 40)
    s.close("complete")
    assert not s.errors, s.errors
    assert _seqs(path) == list(range(seq))
    assert not store.journal_path(path).exists() and not list(tmp_path.glob(".*"))
    assert _until(lambda: not _alive(pid), 10), "the fold process outlived the recording"


def test_a_fold_process_that_dies_hands_the_rank_file_back(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("BITGUARD_FOLD_PROCESS", "1")
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {}, batch_events=16, fold_seconds=0.05)
    seq = 0
    while s.folds < 1:
        seq = _steps(s, 5, seq // 40)
    os.kill(s.folder_pid, signal.SIGKILL)  # a fold may be in hand: its transaction is all or nothing
    seq = _steps(s, 30, seq // 40)
    assert s._folder is None and not s._fold_process  # folding on the writer thread again
    s.close("complete")
    assert not s.errors, s.errors  # nothing was lost: not a collector error
    assert "folding on the writer thread from now on" in capfd.readouterr().err
    assert _seqs(path) == list(range(seq))


def test_a_fold_process_that_cannot_start_leaves_folding_here(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("BITGUARD_FOLD_PROCESS", "1")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {}, batch_events=16, fold_seconds=0.05)
    seq = _steps(s, 20)
    assert s.folds >= 1 and s.folder_pid is None
    s.close("complete")
    assert not s.errors and _seqs(path) == list(range(seq))
    assert "the fold process did not start" in capfd.readouterr().err


def test_a_damaged_group_is_kept_aside_and_what_follows_it_folded(tmp_path, monkeypatch):
    monkeypatch.setenv("BITGUARD_FOLD_PROCESS", "1")
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {}, fold_seconds=3600)
    s._queue.put(None)  # the writer thread stops: this test drives the writer's steps itself
    s._thread.join()
    s._write(*_batch(0, 3, 0), [], [], ends_step=True)
    s._group += 1  # group 2 is lost: its bytes are garbage
    bad = journal.encode_group(2, {"events": store._to_arrow(_batch(3, 3, 1)[0], store._SCHEMAS["events"])})
    os.write(s._journal, bad[:-3] + b"xyz")
    s._journal_bytes += len(bad)
    s._ends.append(s._journal_bytes)
    s._write(*_batch(6, 3, 2), [], [], ends_step=True)
    assert s._fold_elsewhere() and s._folder.busy
    asked = s._asked
    s._write(*_batch(9, 3, 3), [], [], ends_step=True)  # appended while the fold is in hand
    reply = s._folder.poll(60)
    assert reply is not None and reply["keep_as"] == "rank-0.journal.damaged", reply
    s._folded_by_folder(reply)
    kept = tmp_path / "rank-0.journal.damaged"
    assert kept.stat().st_size == asked + (s._journal_bytes)  # the folded bytes, and the copy of what followed
    assert [g.number for g in journal.decode(store.journal_path(path).read_bytes()).groups] == [4]
    s.close("complete")
    assert _seqs(path) == [0, 1, 2, 6, 7, 8, 9, 10, 11]
    assert any("may be missing" in e for e in s.errors), s.errors


def test_a_forked_child_closes_its_copies_of_the_pipes(tmp_path):
    folder = FoldProcess(tmp_path / "rank-0.duckdb")
    try:
        pid = os.fork()
        if pid == 0:  # the child: its copies closed at once (the folder must see the training end)
            os._exit(0 if folder._proc.stdin.closed and folder._proc.stdout.closed else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not folder._proc.stdin.closed  # the parent's stay open
    finally:
        folder.stop(timeout=30)


@pytest.mark.slow
@pytest.mark.extended  # (the fold process is off by default: BITGUARD_FOLD_PROCESS=1; 9 s of the suite)
def test_a_killed_training_leaves_nothing_the_launcher_cannot_fold(tmp_path):
    """SIGKILL while the fold process folds: the launcher's fold (`_fold_journals`, which waits for
    the fold in hand to end) leaves every journaled event in the rank file, no gap, no damage."""
    script = tmp_path / "writes.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_folder import _add
        from bitguard.collectors import store
        s = store.RankStore(sys.argv[1], {{}}, batch_events=16, fold_seconds=0.05)
        seq = step = 0
        while True:
            _add(s, seq, 40, step)
            seq, step = seq + 40, step + 1
            s.step_barrier()
            if s.folds >= 3:
                print(s.folder_pid, flush=True)
    """))
    path = tmp_path / "rank-0.duckdb"
    env = {**os.environ, "BITGUARD_FOLD_PROCESS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, env=env, text=True)
    folder_pid = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    from bitguard.cli import _fold_journals

    _fold_journals(tmp_path)
    seqs = _seqs(path)
    assert seqs == list(range(len(seqs))) and len(seqs) >= 40 * 3, seqs[-5:]
    assert not store.journal_path(path).exists()
    assert _until(lambda: not _alive(folder_pid), 10)


def test_recover_removes_a_copy_the_killed_writer_had_not_put_in_place(tmp_path):
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {}, fold_process=False)
    s._queue.put(None)
    s._thread.join()
    s._write(*_batch(0, 3, 0), [], [], ends_step=True)
    spare = tmp_path / ".rank-0.journal.rest"
    spare.write_bytes(store.journal_path(path).read_bytes())  # killed between the copy and os.replace
    s._con.close()
    os.close(s._journal)
    assert store.recover(path) == 1 and not spare.exists() and not store.journal_path(path).exists()
    assert _seqs(path) == [0, 1, 2]


def test_a_journal_that_vanished_is_an_error_not_an_empty_fold(tmp_path):
    """Helper 26: a script that changed its working directory under a relative run path made the
    journal's path point nowhere; the fold read nothing, called it folded, and emptied the journal
    through its open descriptor: every event lost. A journal that is gone is now an error."""
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {}, fold_process=False)
    s._queue.put(None)
    s._thread.join()
    s._write(*_batch(0, 3, 0), [], [], ends_step=True)
    store.journal_path(path).rename(tmp_path / "moved.journal")
    with pytest.raises(FileNotFoundError, match="is gone"):
        s._fold()
    assert (tmp_path / "moved.journal").stat().st_size > 0  # (not emptied through the descriptor)
    s._con.close()
    os.close(s._journal)


CHDIR = """
import os, sys, torch, bitguard
os.makedirs("elsewhere", exist_ok=True)
model, opt = torch.nn.Linear(4, 1), None
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with bitguard.record("runs/rel", determinism=False):
    os.chdir("elsewhere")  # (Hydra's @main does this)
    for _ in range(3):
        opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
print("ok")
"""


def test_a_relative_run_directory_survives_the_script_changing_its_working_directory(tmp_path):
    got = subprocess.run([sys.executable, "-c", CHDIR], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and "ok" in got.stdout, got.stderr[-2000:]
    manifest = (tmp_path / "runs" / "rel" / "manifest.json").read_text()
    assert '"status": "complete"' in manifest and '"collector_errors": []' in manifest, manifest
    assert len(_seqs(tmp_path / "runs" / "rel" / "rank-0.duckdb")) > 0
    assert not (tmp_path / "elsewhere" / "runs").exists()
