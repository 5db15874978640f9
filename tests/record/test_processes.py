"""Processes the training starts (collectors/processes.py): one that may train is reported (its
numbers are not recorded: never "identical"), the DataLoader's workers are not, and a forked
child neither waits for the parent's writer nor ends the parent's run."""

import json

import pytest

from incli import run_cli

from .conftest import SCRIPTS, record

pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "child_processes.py"


def _errors(run_dir) -> list[str]:
    return json.loads((run_dir / "manifest.json").read_text())["collector_errors"]


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_training_in_a_child_process_is_never_certified(tmp_path, start):
    """A child that trains with another learning rate compared identical: nothing of it was
    recorded, and nothing said so. With fork, the child also waited 30 s at each step for a
    writer thread it does not have."""
    procs = [record(tmp_path / name, "train", start, lr, script=SCRIPT, cli=True) for name, lr in
             (("a", "0.1"), ("b", "0.5"))]
    assert all("step barrier" not in p.stderr for p in procs), [p.stderr for p in procs]
    assert procs[0].stdout != procs[1].stdout  # the children computed differently
    for name in "ab":
        errors = _errors(tmp_path / name)
        assert len(errors) == 1 and errors[0].startswith(
            f"child process: NotSupported: __main__.child ran in another process ({start}), not observed: what it "
            f"computed is not compared; to record training that runs in several processes, launch them with "
            f"'torchrun --nproc-per-node N -m bitguard record"), errors
    proc = run_cli("compare", tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 3 and "__main__.child ran in another process" in proc.stdout, proc.stdout
    # (quoted whole: it was cut at 200 characters, mid-word, before the advice: helper 33)
    assert "launch them with 'torchrun --nproc-per-node N -m bitguard record --out DIR -- SCRIPT'" in proc.stdout


def test_a_forked_child_ends_on_sigterm_as_without_the_recording(tmp_path):
    """The recording turns SIGTERM into SystemExit to close its run; a forked child inherited that
    handler: a terminated child's exit code was 143, not -15, and a pool worker waiting on the pool's
    lock when the pool was terminated was once seen never to end (the test suite hung)."""
    proc = record(tmp_path / "run", "terminated", script=SCRIPT)
    assert "exitcode -15" in proc.stdout, proc.stdout + proc.stderr


def test_pool_tasks_and_a_raw_fork_are_never_certified_but_dataloader_workers_are_fine(tmp_path):
    """A pool's worker runs whatever the script submits (a training, here); os.fork() runs the rest
    of the script in the child: both were first let through, and compared identical."""
    record(tmp_path / "loader", "loader", script=SCRIPT, cli=True)
    assert _errors(tmp_path / "loader") == []
    # (helper 24: HF datasets' map with num_proc forks through `multiprocess`: it prepares batches, which are compared)
    record(tmp_path / "prepared", "prepared", script=SCRIPT)  # (forked from the warm recorder: no launcher under test)
    assert _errors(tmp_path / "prepared") == []
    record(tmp_path / "pool", "pool", script=SCRIPT, cli=True)
    (error,) = _errors(tmp_path / "pool")
    assert error.startswith("child process: NotSupported: a process pool's tasks ran in another process (fork), not "
                            "observed: what it computed is not compared; "), error
    proc = record(tmp_path / "forked", "forked", script=SCRIPT, cli=True)
    manifest = json.loads((tmp_path / "forked" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["collector_errors"] == [
        "child process: NotSupported: the script forked (os.fork): what the child computes is not observed nor "
        "compared"], proc.stderr
    assert manifest["steps_completed"] == 2  # the parent's two steps; the child's is not the run's
