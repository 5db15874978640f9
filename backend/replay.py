"""Replaying a recorded run for one step, and checking that the replay reproduces the record.

A run directory's manifest holds what started it: the command, the working directory, the
interpreter, the determinism settings, the recording mode, the script's SHA-256 and the
environment variables that matter (bitguard/manifest.py `replay_facts`). `command()` turns those
into a `bitguard record --steps K:K+1` of the same script (under `torch.distributed.run
--standalone` for a multi-rank run: the recorded launcher itself is not known), `run()` starts
replays (side by side when the cores suffice) with a drill spec in `BITGUARD_DRILL` (the child's op tracer reads it:
collectors/drill.py) and `check()` holds each replayed boundary event of the step, up to a given
event, to the recorded one's digests: a replay that does not reproduce its record makes every
finding of the drill meaningless, and is a finding in itself (nondeterminism or a changed
environment).

This module knows manifests, processes and events; it does not know what the drill traces or
how op streams are compared (backend/opdiff.py, backend/drill.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from bitguard import manifest as manifest_mod
from bitguard.backend.ingest import RunInfo, load_rank, open_run
from bitguard.errors import BadInput, NotSupported

REPLAY_LOG = "replay.log"


@dataclass
class Replay:
    """One replay to start: its command line, working directory and environment."""

    side: str  # "a" | "b"
    run: RunInfo
    out: Path  # the replay's run directory
    argv: list[str]
    cwd: str
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)  # what differs from the recording's circumstances
    exit_status: int | None = None
    seconds: float = 0.0
    timed_out: bool = False


def _script_and_args(command) -> tuple[list[str], str, list[str]]:
    """(interpreter options, script, its arguments) of a recorded command."""
    if isinstance(command, str):
        command = command.split()
    if not isinstance(command, list) or not command:
        raise NotSupported("not supported yet: replaying a run whose manifest records no command; re-record it "
                           "with this bitguard")
    script = manifest_mod.script_of(command)
    if script is None:
        raise NotSupported(f"not supported yet: replaying {' '.join(command)!r}: bitguard replays a Python "
                           f"training script (a command with a .py file)")
    at = command.index(script)
    opts = [c for c in command[1:at] if c.startswith("-")] if at else []
    return opts, script, command[at + 1:]


def _record_options(m: dict, step: int) -> list[str]:
    det = m.get("determinism") or {}
    opts = ["--mode", str(m.get("mode") or "full"), "--seed", str(det.get("seed", 0)), "--steps", f"{step}:{step + 1}",
            "--force"]
    if det.get("enabled") is False:
        opts.append("--no-determinism")
    if det.get("deterministic_warn_only"):
        opts.append("--warn-only")
    if det.get("enabled") is not False and isinstance(det.get("torch_threads"), int):
        opts += ["--threads", str(det["torch_threads"])]
    if m.get("digest_cache") is False:
        opts.append("--no-digest-cache")
    return opts


def _environment(m: dict, notes: list[str]) -> dict[str, str]:
    """This process's environment with the recorded variables put back (and those of the recorded
    kinds that were not set then, removed)."""
    env = dict(os.environ)
    recorded = m.get("env")
    if recorded is None:
        notes.append("the manifest records no environment variables (recorded by an older bitguard): the replay "
                     "runs under this shell's")
        return env
    for name in list(env):
        if name not in recorded and manifest_mod.recorded_env({name: env[name]}):
            del env[name]
    set_by_bitguard = set((m.get("determinism") or {})) | {"TORCHINDUCTOR_CACHE_DIR"}  # not the user's
    changed = sorted(n for n, v in recorded.items() if os.environ.get(n) != v and n not in set_by_bitguard)
    env.update(recorded)
    if changed:
        notes.append(f"restored {len(changed)} recorded environment variable(s) that differ here: "
                     f"{', '.join(changed[:8])}")
    return env


def command(side: str, run: RunInfo, step: int, out: Path, spec_path: Path) -> Replay:
    """The replay of `run` for step `step` into `out`, as a command to start."""
    m = run.manifest
    py_opts, script, args = _script_and_args(m.get("command"))
    cwd = m.get("cwd")
    notes: list[str] = []
    if not isinstance(cwd, str) or not cwd:
        raise NotSupported(f"cannot replay {run.path}: its manifest records no working directory (recorded by an "
                           f"older bitguard?); re-record it with this bitguard")
    if not Path(cwd).is_dir():
        raise NotSupported(f"cannot replay {run.path}: its working directory {cwd} is not on this machine; drill "
                           f"on the machine that recorded it")
    script_path = Path(cwd, script)
    if not script_path.is_file():
        raise NotSupported(f"cannot replay {run.path}: its script {script_path} is not on this machine; drill where "
                           f"the script is")
    recorded_sha = m.get("script_sha256")
    if recorded_sha and manifest_mod.file_sha256(script_path) != recorded_sha:
        notes.append(f"the script {script} changed since the recording (its SHA-256 differs)")
    edited = [Path(f).name for f, sha in (m.get("sources") or {}).items()
              if f != str(script_path.resolve()) and manifest_mod.file_sha256(f) != sha]
    if edited:
        notes.append(f"{len(edited)} source file(s) the training imported changed or went since the recording: "
                     f"{', '.join(edited[:6])}")
    python = m.get("python")
    if not python or not Path(python).exists():
        notes.append(f"the recorded interpreter {python} is not here: replayed with {sys.executable}" if python else
                     f"the manifest records no interpreter (recorded by an older bitguard): replayed with {sys.executable}")
        python = sys.executable
    env = _environment(m, notes)
    env["BITGUARD_DRILL"] = str(spec_path)
    record = ["-m", "bitguard", "record", "--out", str(out), *_record_options(m, step)]
    world = int(m.get("world_size") or 1)
    if world > 1:
        argv = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *record,
                "--", str(script_path), *args]
        notes.append(f"replayed on {world} local processes under torch.distributed.run --standalone")
    else:
        argv = [python, *py_opts, *record, "--", str(script_path), *args]  # in this process: no launcher to start
    return Replay(side, run, out, argv, cwd, env, notes)


def _threads(r: Replay) -> int:
    """Cores a replay keeps busy: its ranks times the intra-op threads it was recorded with."""
    m = r.run.manifest
    threads = (m.get("determinism") or {}).get("torch_threads")
    return int(m.get("world_size") or 1) * (threads if isinstance(threads, int) and threads > 0 else os.cpu_count() or 1)


SHORT_STEP_S = 0.1  # a recorded step this short: a replay is mostly start-up, which overlaps well


def run(replays: list[Replay], timeout: float, step_s: float | None = None) -> None:
    """Run the replays (each one's output in its REPLAY_LOG), side by side when the machine has the
    cores for all of them or their step is short (`step_s`, as recorded), else one after the other:
    torch's OpenMP threads of two replays on too few cores slow both far more than running them in
    turn (measured: a 0.3 s step 7x slower, the drill a third slower), while two replays of a 30 ms
    step, all start-up, take 0.7x the time side by side."""
    together = sum(_threads(r) for r in replays) <= (os.cpu_count() or 1) or (
        step_s is not None and step_s < SHORT_STEP_S)
    deadline = time.monotonic() + timeout
    batches = [replays] if together else [[r] for r in replays]
    folders = {r.cwd for r in replays}
    before = {cwd: _files(cwd) for cwd in folders}
    for batch in batches:
        _run_batch(batch, deadline, timeout)
    for cwd in folders:  # (helper 59: mmengine's `last_checkpoint` pointed back at epoch 1 after a drill)
        own = [os.path.relpath(r.out.parent.resolve(), Path(cwd).resolve()) for r in replays]
        written = _written(before[cwd], _files(cwd), own)
        if written:
            shown = ", ".join(written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
            for r in replays:
                if r.cwd == cwd:
                    r.notes.append(f"the replays ran the script again in {cwd}, and it wrote there what it writes "
                                   f"when it runs, over what the training had left: {shown}; a training resumed "
                                   "from that folder would read these")
                    break


FILES_LOOKED_AT = 20_000  # files of the replays' folder noted before and after them (`_files`); past it, none


def _files(cwd: str) -> dict[str, tuple[int, int]] | None:
    """(modification time, size) of each file under `cwd`, by its path relative to it; None when there are
    more than FILES_LOOKED_AT (a dataset's folder) or the folder cannot be read."""
    out: dict[str, tuple[int, int]] = {}
    try:
        for root, dirs, names in os.walk(cwd):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            for name in names:
                path = os.path.join(root, name)
                try:
                    st = os.stat(path, follow_symlinks=False)
                except OSError:
                    continue
                out[os.path.relpath(path, cwd)] = (st.st_mtime_ns, st.st_size)
                if len(out) > FILES_LOOKED_AT:
                    return None
    except OSError:
        return None
    return out


def _written(before: dict | None, after: dict | None, own: list[str] = ()) -> list[str]:
    """The files that are new or changed between two `_files` looks, but the drill's own (under a run's
    `drill/` folder, or under `own`: the folders of the replays' records, relative to the same folder, which
    `--out` may put inside the script's; helper 65) and bitguard's recordings of the replays."""
    if before is None or after is None:
        return []
    mine = tuple(f"{o}{os.sep}" for o in own if o != os.curdir and not o.startswith(os.pardir))
    return sorted(p for p, st in after.items() if before.get(p) != st and not p.startswith(mine)
                  and "drill" not in Path(p).parts and not p.endswith((".duckdb", ".duckdb.wal", ".journal", REPLAY_LOG)))


def _run_batch(replays: list[Replay], deadline: float, timeout: float) -> None:
    procs = []
    for r in replays:
        r.out.mkdir(parents=True, exist_ok=True)
        log = open(r.out.parent / f"{r.out.name}.{REPLAY_LOG}", "wb")
        t0 = time.monotonic()
        procs.append((r, subprocess.Popen(r.argv, cwd=r.cwd, env=r.env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True), log, t0))
    try:
        for r, proc, log, t0 in procs:
            try:
                r.exit_status = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(proc)
                r.exit_status = proc.wait()
                r.timed_out = True
                r.notes.append(f"the replay ran past the drill's {timeout:g} s timeout and was stopped")
            r.seconds = time.monotonic() - t0
    finally:
        for r, proc, log, _ in procs:
            if proc.poll() is None:
                _kill(proc)
                proc.wait()
            _kill(proc)  # what the replay started and left (its recording child, torchrun's workers)
            log.close()


def _kill(proc: subprocess.Popen) -> None:
    """Kill a replay and every process of its session (it is started in one of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def log_tail(r: Replay, lines: int = 6) -> str:
    path = r.out.parent / f"{r.out.name}.{REPLAY_LOG}"
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


# modules whose forward takes another path while a torch function mode is on (the drill's tracer)
FAST_PATHS = frozenset({"TransformerEncoder", "TransformerEncoderLayer", "MultiheadAttention"})


def _digests(run: RunInfo, rank: int, step: int, upto: int | None) -> pl.DataFrame:
    """One row per tensor of the rank's events in `step` (up to event seq `upto`): the event's
    place (phase, kind, boundary, call), the tensor's role and index, and its digests."""
    events, tensors, _ = load_rank(run, rank)
    ev = events.filter(pl.col("step") == step)
    if upto is not None:
        ev = ev.filter(pl.col("seq") <= upto)
    ev = ev.select("seq", "phase", "kind", "boundary", "call", "module_type")
    return ev.join(tensors.select("seq", "role", "idx", "shape", "dtype", "xor", "pos", "unobserved"), on="seq",
                   how="left").sort("seq", "role", "idx")


def check(record: RunInfo, replay_dir: Path, rank: int, step: int, upto: int | None) -> dict:
    """Does the replay reproduce the recorded step `step` of `rank`, every event up to seq `upto`
    (None: the whole step)? {"reproduced", "compared", "differing", "missing", "first", "detail"}."""
    try:
        replay = open_run(replay_dir)
    except Exception as exc:  # noqa: BLE001 - a replay that wrote no run is a replay that did not reproduce
        return {"reproduced": False, "compared": 0, "differing": 0, "missing": 0, "first": None,
                "detail": f"the replay wrote no readable run ({exc})"}
    if rank not in replay.ranks:
        return {"reproduced": False, "compared": 0, "differing": 0, "missing": 0, "first": None,
                "detail": f"the replay recorded no rank {rank}"}
    want = _digests(record, rank, step, upto)
    got = _digests(replay, rank, step, None)
    place = ["phase", "kind", "boundary", "call", "role", "idx"]
    joined = want.join(got.drop("module_type"), on=place, how="left", suffix="_r", nulls_equal=True)
    missing = joined.filter(pl.col("seq_r").is_null())
    differing = joined.filter(pl.col("seq_r").is_not_null() & (
        (pl.col("xor") != pl.col("xor_r")) | (pl.col("pos") != pl.col("pos_r"))
        | (pl.col("dtype") != pl.col("dtype_r")) | (pl.col("unobserved").is_null() != pl.col("unobserved_r").is_null())))
    bad = pl.concat([missing.with_columns(pl.lit("missing").alias("how")),
                     differing.with_columns(pl.lit("differs").alias("how"))]).sort("seq")
    events = want["seq"].n_unique()
    if bad.height == 0:
        return {"reproduced": True, "compared": events, "differing": 0, "missing": 0, "first": None,
                "detail": f"the {events} recorded events of step {step} up to the pivot are reproduced bitwise"}
    first = bad.row(0, named=True)
    what = f"{first['phase']} {first['boundary']} (call {first['call']}, {first['role']} {first['idx']})"
    how = "is missing from the replay" if first["how"] == "missing" else "has other digests in the replay"
    if first["module_type"] in FAST_PATHS:  # (helper 71: said to be nondeterminism)
        how += (f": a {first['module_type']} takes its inference fast path (nested tensors, fused kernels) under "
                f"no_grad or eval only where no torch function mode is on, and the drill's op tracing is one, so its "
                f"replay computes it another way; drilling into it is not supported yet (docs/DRILL.md)")
    return {"reproduced": False, "compared": events, "differing": int(differing["seq"].n_unique()),
            "missing": int(missing["seq"].n_unique()),
            "first": {k: first[k] for k in ("seq", "phase", "kind", "boundary", "call", "role", "idx", "module_type")},
            "detail": f"step {step}'s {what} {how}"}


def write_spec(path: Path, spec: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec, indent=2))
    os.replace(tmp, path)


def writable_beside(run_path: Path, name: str) -> Path:
    """`run_path/drill/name`, created; BadInput when the run's folder is read-only."""
    target = run_path / "drill" / name
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = target.parent / f".bitguard-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise BadInput(f"cannot write the drill records beside {run_path} ({exc.strerror or exc}); give "
                       f"--out DIR for them") from None
    return target
