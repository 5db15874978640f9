"""Running a stack script plain and recorded, and reading what bitguard says about it.

The stacks tier holds every real training stack (eager, torch.compile, DDP, FSDP1/2, activation
checkpointing, autocast, the HF Trainer) to the same four claims: it records unedited, recording
leaves its numbers bitwise (plain result == recorded result, tests/stacks/scripts/_result.py), a
rerun compares identical, and an injected fault (env `STACK_FAULT`, script-specific) is
localized to its step, rank, boundary and blame. Everything runs through the documented CLI, as a
user would: the recordings in subprocesses (`bitguard record`, `torchrun -m bitguard record`),
`bitguard compare --json` and `bitguard check --json` through the CLI's own `main` in the test's
process (tests/incli.py: the same parser, exit code and printed document, without a fresh
Python's start per call).

A result is {rank: {"losses": [...], "params": {name: sha256}}}, one entry per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from incli import cli_json

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT = 900
# Runs of a fixture started at once: most tiny runs keep one core busy at most (start-up, the
# writer's waits), so two at a time roughly halve the tier's time on this 2-core machine.
JOBS = int(os.environ.get("BITGUARD_STACKS_JOBS", "2"))


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join(p for p in (str(SCRIPTS), env.get("PYTHONPATH", "")) if p)})
    env.update(extra or {})
    return env


def _script(script) -> str:
    path = Path(script)
    return str(path if path.is_absolute() else SCRIPTS / path)


def _launch(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def _run(cmd: list[str], env: dict, log: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=str(ROOT))
    log.write_text(proc.stderr)
    assert proc.returncode == 0, (f"{' '.join(cmd)} exited {proc.returncode}:\n"
                                  f"{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}")
    return proc


def _read(result: Path, nproc: int) -> dict[int, dict]:
    out = {}
    for rank in range(nproc):
        path = result if rank == 0 else result.with_name(f"{result.name}.r{rank}")
        assert path.is_file(), f"rank {rank} wrote no result ({path})"
        out[rank] = json.loads(path.read_text())
    return out


def plain(script, tmp, *args, env: dict | None = None, nproc: int = 1, name: str = "plain") -> dict[int, dict]:
    """Run `script` without bitguard; its result per rank."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    result = tmp / f"{name}.result.json"
    cmd = [*_launch(nproc), _script(script), *args]
    _run(cmd, _env({**(env or {}), "STACK_RESULT": str(result)}), tmp / f"{name}.stderr")
    return _read(result, nproc)


def recorded(script, out, *args, env: dict | None = None, nproc: int = 1,
             record_args=()) -> tuple[Path, dict[int, dict]]:
    """Run `script` under `bitguard record --out OUT` (torchrun when nproc > 1); the run directory
    and the result per rank. The recording's stderr is kept in `stderr_of(out)`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = out.parent / f"{out.name}.result.json"
    if nproc == 1:
        cmd = [sys.executable, "-m", "bitguard", "record", "--out", str(out), *record_args, "--",
               sys.executable, _script(script), *args]
    else:
        cmd = [*_launch(nproc), "-m", "bitguard", "record", "--out", str(out), *record_args, "--",
               _script(script), *args]
    _run(cmd, _env({**(env or {}), "STACK_RESULT": str(result)}), stderr_of(out))
    return out, _read(result, nproc)


def together(jobs: dict[str, Callable]) -> dict:
    """Run the zero-argument calls of `jobs` (e.g. `lambda: recorded(...)`), JOBS at a time; their
    results by name. Each run is its own subprocess with its own files, so their order is free."""
    with ThreadPoolExecutor(max_workers=max(1, JOBS)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def stderr_of(out) -> Path:
    out = Path(out)
    return out.parent / f"{out.name}.stderr"


def compare(a, b, *args) -> tuple[int, dict]:
    """`bitguard compare A B --json`: its exit code and document (see `cli_json`)."""
    return cli_json("compare", a, b, "--json", *args)


def check(run) -> tuple[int, dict]:
    """`bitguard check RUN --json`: its exit code and document (see `cli_json`)."""
    return cli_json("check", run, "--json")


def manifest(run) -> dict:
    return json.loads((Path(run) / "manifest.json").read_text())


def assert_localized(doc: dict, step: int, rank: int, boundary, blame: str | None = None,
                     fault_class: str | None = None) -> dict:
    """The verdict is `diverged` and the first divergence is at `step`, `rank`, `boundary` (a name,
    or a tuple of acceptable names), with `blame` and `fault_class` when given. Returns it."""
    fd = doc.get("first_divergence")
    where = (f"verdict {doc.get('verdict')}, first divergence "
             + ("none" if not fd else f"rank {fd['rank']} step {fd['step']} {fd['phase']}/{fd['kind']} "
                f"{fd['boundary']} blame {fd['blame']} ({fd['fault_class']}): {fd.get('blame_window')}"))
    assert doc.get("verdict") == "diverged" and fd, where
    names = (boundary,) if isinstance(boundary, str) else tuple(boundary)
    assert (fd["step"], fd["rank"]) == (step, rank), where
    assert fd["boundary"] in names, where
    if blame is not None:
        assert fd["blame"] == blame, where
    if fault_class is not None:
        assert fd["fault_class"] == fault_class, where
    return fd


def assert_identical(a, b, *args) -> dict:
    """`bitguard compare A B` says identical, exit 0. Returns the document."""
    code, doc = compare(a, b, *args)
    assert (code, doc.get("verdict")) == (0, "identical"), doc.get("inconclusive") or doc.get("first_divergence") or doc
    return doc


def assert_compare_localizes(a, b, step: int, rank: int, boundary, blame: str | None = None,
                             fault_class: str | None = None) -> dict:
    """`bitguard compare A B` exits 1 (diverged) with the first divergence `assert_localized` checks."""
    code, doc = compare(a, b)
    assert code == 1, doc.get("inconclusive") or doc.get("error") or doc.get("verdict")
    return assert_localized(doc, step=step, rank=rank, boundary=boundary, blame=blame, fault_class=fault_class)


def assert_unchanged(plain_result: dict, recorded_result: dict) -> None:
    """Recording left every loss and every final parameter bitwise as the plain run's."""
    assert plain_result.keys() == recorded_result.keys()
    for rank in plain_result:
        p, r = plain_result[rank], recorded_result[rank]
        assert p["losses"] == r["losses"], f"rank {rank}: losses changed by recording: {p['losses']} vs {r['losses']}"
        changed = sorted(n for n in p["params"] if p["params"][n] != r["params"].get(n))
        assert not changed and p["params"].keys() == r["params"].keys(), \
            f"rank {rank}: parameters changed by recording: {changed[:8]}"
