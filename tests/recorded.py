"""Real recorded run pairs: tiny GPT trained under `bitguard record`, reference and suspect.

Each scenario records its two runs concurrently, forked from a warm recorder (tests/warm.py: the
CLI's in-process recording, without the 4-s start of a fresh Python), into
`root/<scenario>/reference` and `root/<scenario>/suspect`, and returns the two paths. `shared`
records a scenario once for the whole pytest session, its xdist workers included (the pair is
only read: the readers open rank files read-only, an upload copies them); session fixtures
(tests/unit/backend/conftest.py) and tests of other folders that need the same pair call it. The
synthetic pairs in fixtures_runs.py are the fast alternative when a test needs no real model.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import warm

ROOT = Path(__file__).resolve().parents[1]
TINYGPT = ROOT / "sample_traces" / "tinygpt.py"
STEPS = ("--steps", "3")  # three steps: a clean step 0, the fault at step 1, its spread at step 2


def record_pair(root, name: str, suspect_args: list[str], reference_args: list[str] = ()) -> tuple[Path, Path]:
    """Record `root/name/reference` and `root/name/suspect` at once; return their paths."""
    base = Path(root) / name
    runs = {"reference": [*STEPS, *reference_args], "suspect": [*STEPS, *suspect_args]}
    warm.record_all(*(dict(out=base / side, script=TINYGPT, args=args) for side, args in runs.items()))
    return base / "reference", base / "suspect"


def forward_bitflip(root) -> tuple[Path, Path]:
    """One bit of blocks.0.mlp.fc's output flips at step 1: the pivot is that forward (blame: source)."""
    return record_pair(root, "forward_bitflip", ["--fault", "forward-bitflip", "--fault-step", "1"])


def identical(root) -> tuple[Path, Path]:
    """The same training twice: no pivot."""
    return record_pair(root, "identical", [])


def shared_root(tmp_path_factory) -> Path:
    """The session's folder for recordings its xdist workers share (the parent of each worker's
    basetemp, which is the session's; the basetemp itself without xdist)."""
    basetemp = tmp_path_factory.getbasetemp()
    root = (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "bitguard-shared-pairs"
    root.mkdir(exist_ok=True)
    return root


def scenario_runs(tmp_path_factory) -> Path:
    """The folder of the scenarios' plain recordings (evaluation.pairs(..., "plain", this, ...)), shared
    by the session's workers: tests/scenarios and tests/drill record them there with `record_jobs`."""
    return shared_root(tmp_path_factory) / "scenarios"


def shared(tmp_path_factory, scenario) -> tuple[Path, Path]:
    """`scenario(root)` (forward_bitflip, identical) recorded once per pytest session: the first
    worker to ask records it under a lock, in a folder its sibling workers share (`shared_root`),
    the others wait for it and read the same pair."""
    root = shared_root(tmp_path_factory)
    name = scenario.__name__
    done = root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(root / name, ignore_errors=True)  # a recording that failed on another worker
            scenario(root)
            done.touch()
    return root / name / "reference", root / name / "suspect"


def record_jobs(jobs, workers: int = 2) -> None:
    """Record the sample-script jobs `jobs` (sample_traces.recordings.Job), `workers` at a time on the
    scenario pool, each once per session: a job's `out` is locked while it is recorded and marked
    done after (`OUT.lock`, `OUT.done`), so a job whose `out` is under `shared_root` and that another
    xdist worker is recording is waited for, and one it recorded is read, not recorded again (the
    scenarios' pairs, which tests/scenarios and tests/drill both read: they only read them; a drill
    copies its pair first, as it replays beside the runs). Asserts every recording ran to the end."""
    from bitguard.sample_traces.recordings import run_jobs

    def mark(job, suffix) -> Path:
        out = Path(job.out).resolve()
        return out.with_name(out.name + suffix)

    mine, theirs, held = [], [], []
    for job in dict.fromkeys(jobs):
        mark(job, "").parent.mkdir(parents=True, exist_ok=True)
        lock = open(mark(job, ".lock"), "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            theirs.append((job, lock))  # another worker is recording it
            continue
        if mark(job, ".done").exists():
            lock.close()
        else:
            mine.append(job)
            held.append(lock)
    try:
        outcomes = run_jobs(mine, workers=workers, reuse=False)
        for job, outcome in zip(mine, outcomes):
            if not outcome.exit_status:
                mark(job, ".done").touch()
    finally:
        for lock in held:
            lock.close()
    for job, lock in theirs:
        fcntl.flock(lock, fcntl.LOCK_EX)  # returns when the worker recording it has finished
        lock.close()
        if not mark(job, ".done").exists():  # it failed there: record it here, to say why
            outcomes += run_jobs([job], workers=1, reuse=False)
    failed = [o for o in outcomes if o.exit_status]
    assert not failed, "\n\n".join(f"{o.job.shell()} exited {o.exit_status}:\n{o.log}" for o in failed)


def copy_run(run, to) -> Path:
    """A copy of the run directory `run` at `to` (for a test that writes beside a shared run)."""
    shutil.copytree(run, to)
    return Path(to)


def collector_errors(run_dir) -> list[str]:
    """The collector errors a recording reports, its manifest's and its ranks'."""
    from bitguard.backend.ingest import open_run

    run = open_run(run_dir)
    return list(run.manifest.get("collector_errors") or []) + [
        e for meta in run.rank_meta.values() for e in meta.get("collector_errors") or []]
