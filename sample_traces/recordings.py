"""Recordings of the sample training scripts, many at a time, each in a process of its own.

A `Job` is one run of a script in this folder: recorded (exactly what `bitguard record --out DIR
-- python SCRIPT ARGS` does, through the same `run_script`) or plain (no collector, e.g. a long
run for the loss watcher). `run_jobs` runs them on a small process pool whose processes are
forked, one per job, from a server that has already imported torch and bitguard's recorder:
each job gets a fresh process, as on the command line, without paying those imports again.
Every job runs with one intra-op thread (OMP_NUM_THREADS=1), as `Job.shell()` says, and seeds
Python's, NumPy's and torch's RNGs from the OS as a fresh interpreter does. What a fork cannot
renew is Python's string-hash seed: jobs share the server's (PYTHONHASHSEED), so a script whose
results depend on the iteration order of a set of strings is more reproducible here than from
the shell.
Transformers is not preloaded, so a recording's manifest lists the same libraries as one made
by the CLI. A finished recording whose manifest shows the same command is reused, not redone.

This module knows nothing about scenarios or about comparing runs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRELOAD = ["bitguard.sample_traces.warm_recorder"]


@dataclass(frozen=True)
class Job:
    script: str  # a script in sample_traces/, e.g. "tinygpt.py"
    args: tuple[str, ...]  # its command-line arguments
    out: str  # run directory to write (recorded) or folder for the log and losses (plain)
    record: bool = True  # False: run the script without bitguard (e.g. for the loss watcher)
    determinism: bool = True  # bitguard record's determinism controls (--no-determinism turns off)
    dump: bool = False  # bitguard record --dump: keep every tensor's bytes too

    @property
    def script_path(self) -> Path:
        return HERE / self.script

    def training_command(self) -> list[str]:
        """The training command, as the manifest of a `bitguard record` made from the repository root says."""
        return ["python", f"sample_traces/{self.script}", *self.args]

    def shell(self) -> str:
        """The equivalent command line, to type from the repository root."""
        if not self.record:
            return " ".join(["OMP_NUM_THREADS=1", *self.training_command()])
        opts = ["OMP_NUM_THREADS=1", "bitguard", "record", "--out", self.out]
        opts += [] if self.determinism else ["--no-determinism"]
        opts += ["--dump"] if self.dump else []
        return " ".join([*opts, "--", *self.training_command()])


@dataclass
class Outcome:
    job: Job
    exit_status: int  # the script's exit status (0: trained to the end)
    seconds: float  # wall time of the run itself (imports excluded)
    reused: bool = False  # an earlier identical recording was kept
    log: str = ""  # the last lines of the script's output when it failed


def _finished(job: Job) -> bool:
    try:
        manifest = json.loads((Path(job.out) / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return (manifest.get("status") == "complete" and manifest.get("command") == job.training_command()
            and (manifest.get("determinism") or {}).get("enabled") == job.determinism
            and bool(manifest.get("dump")) == job.dump)


def _run(job: Job) -> tuple[int, float]:
    """In the worker process: run one job with stdout and stderr sent to its log."""
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    log = os.open(out.parent / f"{out.name}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    # One intra-op thread per job: the pool runs `workers` jobs side by side, and OpenMP threads
    # spinning against each other cost more than the tiny models gain from them.
    os.environ["OMP_NUM_THREADS"] = "1"
    import random

    import numpy as np
    import torch

    torch.set_num_threads(1)
    # A forked process inherits the server's RNG states; a fresh interpreter seeds each from the
    # OS. Do the same, or every unseeded job would draw the same numbers (and look reproducible).
    random.seed()
    np.random.seed()
    torch.seed()
    t0 = time.perf_counter()
    if job.record:
        from bitguard.recording import run_script

        code = run_script(str(job.script_path), list(job.args), out=job.out, mode="full", seed=0, steps=None,
                          force=True, determinism=job.determinism, warn_only=False, threads=None,
                          command=job.training_command(), dump=job.dump)
    else:
        import runpy

        sys.argv = [str(job.script_path), *job.args]
        code = 0
        try:
            runpy.run_path(str(job.script_path), run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    seconds = time.perf_counter() - t0
    sys.stdout.flush()
    sys.stderr.flush()
    return code, seconds


def _pool(workers: int) -> ProcessPoolExecutor:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx, max_tasks_per_child=1)


def run_jobs(jobs: list[Job], workers: int = 2, reuse: bool = True) -> list[Outcome]:
    """Run every job (at most `workers` at once); outcomes in the order of `jobs`."""
    outcomes: dict[int, Outcome] = {}
    todo = []
    jobs = [replace(job, out=str(Path(job.out).resolve())) for job in jobs]
    for i, job in enumerate(jobs):
        if job.record and reuse and _finished(job):
            outcomes[i] = Outcome(job, 0, 0.0, reused=True)
            continue
        if job.record and Path(job.out).exists():
            shutil.rmtree(job.out)
        todo.append(i)
    if todo:
        with _pool(min(workers, len(todo))) as pool:
            futures = {i: pool.submit(_run, jobs[i]) for i in todo}
            for i, future in futures.items():
                code, seconds = future.result()
                outcomes[i] = Outcome(jobs[i], code, seconds, log="" if code == 0 else _tail(jobs[i]))
    return [outcomes[i] for i in range(len(jobs))]


def _tail(job: Job, lines: int = 15) -> str:
    out = Path(job.out)
    try:
        return "\n".join((out.parent / f"{out.name}.log").read_text().splitlines()[-lines:])
    except OSError:
        return ""
