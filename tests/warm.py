"""Recordings for tests that need a recorded run, not the launcher: forked from a warm recorder.

`bitguard record --out DIR -- python SCRIPT ARGS` starts a fresh Python that imports torch,
torch's inductor (the determinism controls pull it in) and the collectors before the script's
first line: 4 to 5 s here, most of a tiny recording's time. The tests below need the recording,
not that start: each call runs the CLI's in-process path (`bitguard record --out DIR [OPTIONS]
-- SCRIPT ARGS`, what every rank runs under torchrun) in a process of its own, forked from the
fork server of `sample_traces/recordings.py`, which has imported all of that once.

`record_ranks` forks one such recording per rank of a gloo group at once, with the variables
torchrun gives its ranks (RANK, WORLD_SIZE, MASTER_ADDR, ...): what each rank of `torchrun -m
bitguard record` runs, without the three fresh Pythons (the agent, two ranks) that import torch.

What this path does not do, and what the tests that need it use the real CLI for
(tests/record/test_record.py, the stacks tier): the launcher's interpreter check, its journal
fold after a killed child, and the manifest's `command` as typed (here it is `SCRIPT ARGS`,
without the interpreter) and `exit_status`. Environment variables are set before the script
runs, not before torch is imported: a variable torch reads at import time needs the real CLI.
Torch keeps its default intra-op threads, as in a fresh process (a test compares the numbers
with a plain run's).
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bitguard.sample_traces.recordings import _pool

WORKERS = 2
_executor: ProcessPoolExecutor | None = None


@dataclass
class Done:
    """What a recording left: as `subprocess.run(..., capture_output=True, text=True)` would."""

    returncode: int
    stdout: str
    stderr: str


def _job(argv: list[str], env: dict, cwd: str, logs: tuple[str, str]) -> int:
    """In the forked worker: `bitguard ARGV` through the CLI's main, output to the two log files."""
    for i, log in enumerate(logs, 1):
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, i)
        os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    for key in [k for k in os.environ if k not in env]:  # the caller's environment, as a subprocess gets it
        del os.environ[key]
    os.environ.update(env)
    os.chdir(cwd)
    import random

    import numpy as np
    import torch

    random.seed()  # a fresh interpreter seeds each RNG from the OS; a fork inherits the server's
    np.random.seed()
    torch.seed()
    from bitguard.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _pool_once() -> ProcessPoolExecutor:
    global _executor
    if _executor is None:
        # one fresh process per job (recordings._pool: max_tasks_per_child=1), from one fork server
        _executor = _pool(WORKERS)
        atexit.register(_executor.shutdown)
    return _executor


def submit(out, script, *args, options=(), env=None, cwd=None):
    """Start `bitguard record --out OUT OPTIONS -- SCRIPT ARGS`; a future of its `Done`."""
    fd, stdout = tempfile.mkstemp(prefix="bitguard-warm-", suffix=".out")
    os.close(fd)
    fd, stderr = tempfile.mkstemp(prefix="bitguard-warm-", suffix=".err")
    os.close(fd)
    argv = ["record", "--out", str(out), *map(str, options), "--", str(script), *map(str, args)]
    environ = {**os.environ, **{k: str(v) for k, v in (env or {}).items() if v is not None}}
    for key in [k for k, v in (env or {}).items() if v is None]:
        environ.pop(key, None)
    future = _pool_once().submit(_job, argv, environ, str(cwd or os.getcwd()), (stdout, stderr))

    def done() -> Done:
        code = future.result()
        texts = []
        for log in (stdout, stderr):
            texts.append(Path(log).read_text(errors="replace"))
            os.unlink(log)
        return Done(code, *texts)

    return done


def record(out, script, *args, options=(), env=None, cwd=None, check=True) -> Done:
    """`bitguard record --out OUT OPTIONS -- SCRIPT ARGS` in a warm fork; check: it must succeed."""
    got = submit(out, script, *args, options=options, env=env, cwd=cwd)()
    if check:
        assert got.returncode == 0, f"recording {out} exited {got.returncode}:\n{got.stderr[-3000:]}"
    return got


def record_all(*calls: dict, check=True) -> list[Done]:
    """Several `record(**call)` at once (`WORKERS` side by side); each call: out, script, args, options, env, cwd."""
    waits = [submit(c["out"], c["script"], *c.get("args", ()), options=c.get("options", ()), env=c.get("env"),
                    cwd=c.get("cwd")) for c in calls]
    got = [wait() for wait in waits]
    for call, done in zip(calls, got):
        if check:
            assert done.returncode == 0, f"recording {call['out']} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return got


def record_ranks(out, script, *args, nproc: int = 2, options=(), env=None, cwd=None, check=True) -> list[Done]:
    """`bitguard record --out OUT OPTIONS -- SCRIPT ARGS` on each of `nproc` ranks of one group (the
    variables torchrun sets, OMP_NUM_THREADS=1 as torchrun's default), forked at once; each rank's `Done`."""
    import socket

    assert nproc <= WORKERS, f"{nproc} ranks need {nproc} warm workers at once ({WORKERS})"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc,
             "GROUP_RANK": 0, "OMP_NUM_THREADS": 1}
    waits = [submit(out, script, *args, options=options, cwd=cwd,
                    env={**group, **(env or {}), "RANK": rank, "LOCAL_RANK": rank}) for rank in range(nproc)]
    got = [wait() for wait in waits]
    for rank, done in enumerate(got):
        if check:
            assert done.returncode == 0, f"rank {rank} of {out} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return got
