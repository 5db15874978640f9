"""The `bitguard` command line: record, compare, check, drill, export-perfetto, serve, eval.

Exit statuses are a contract: `compare` exits 0 identical, 1 diverged, 3 inconclusive; `check`
exits 0 clean, 1 findings, 3 inconclusive (nothing it could check, or a run not whole); `drill`
exits 0 when it names an op-level pivot, 1 when the replays do not differ inside the window, 3 when
a replay does not reproduce its record; `alerts` exits 0 when no alert was confirmed, 1 when some was; every
command exits 2 on bad input (a `BitguardError`, one line on stderr) and 70 on an internal
error (an unexpected exception: one line on stderr, the traceback saved to a file it names), so
a CI job never mistakes a crash for a divergence. A closed stdout (`bitguard compare A B | head`)
does not change the exit status.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bitguard.errors import BadInput, BitguardError, NotSupported
from bitguard.schema import DIGEST, MANIFEST_NAME, SCHEMA_VERSION

_PYTHON = re.compile(r"^python[\d.]*$")
INTERNAL_ERROR = 70  # EX_SOFTWARE: an unexpected exception, never a verdict


# launchers that run a Python module in each process they start (`-m bitguard record ...`)
_MODULE_LAUNCHERS = ("torchrun", "accelerate launch")

def _record_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="run directory to write (must be empty unless --force)")
    p.add_argument("--mode", default="full", help="full: every module; trusted: heavy modules only (cheaper); "
                   "online: no boundary events, sensors watch for silent data corruption while training runs (alerts)")
    p.add_argument("--budget", type=float, default=None,
                   help="online mode: the fraction of step time the sensors may cost (default 0.02; 1: no limit, "
                        "every call checked whole)")
    p.add_argument("--sensors", default=None, help="online mode: comma-separated sensors to run (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed for Python, NumPy and torch RNGs (default 0)")
    p.add_argument("--steps", default=None, help="record only steps A:B (B exclusive, 'A:' open-ended)")
    p.add_argument("--force", action="store_true", help="replace an existing recording in --out")
    p.add_argument("--no-determinism", dest="determinism", action="store_false", default=None,
                   help="leave RNGs, deterministic algorithms, TF32 and threads as the script sets them")
    p.add_argument("--warn-only", action="store_true",
                   help="torch.use_deterministic_algorithms(warn_only=True): warn instead of failing")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: what the script would get; stated in the manifest)")
    p.add_argument("--dump", action="store_true",
                   help="also store every tensor's bytes (small models only: for tolerance studies and debugging)")
    p.add_argument("--check", default=None, metavar="INV_JSON",
                   help="check each step against the invariants of this file (bitguard invariants infer -o): "
                        "a violation is one stderr line and a row in the run's violations table")
    p.add_argument("--no-digest-cache", dest="digest_cache", action="store_false",
                   help="digest every observation of a tensor, even when its version counter says it is unchanged")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- python SCRIPT [ARGS...]  (or -- SCRIPT [ARGS...] to run in this process, "
                        "e.g. under torchrun -m bitguard record)")


def _record_kwargs(args) -> dict:
    return dict(out=args.out, mode=args.mode, seed=args.seed, steps=args.steps, force=args.force,
                determinism=args.determinism, warn_only=args.warn_only, threads=args.threads, dump=args.dump,
                digest_cache=args.digest_cache, budget=args.budget, sensors=args.sensors, check=args.check)


_PYTHON_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")  # python's own, given as two words


def cmd_record(args) -> int:
    from bitguard.recording import (MODES, bitguard_files, check_invariants, check_writable, online_options, parse_steps,
                                    run_script)

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise BadInput("nothing to record; give the training command after --, e.g. "
                       "bitguard record --out runs/a -- python train.py")
    if args.mode not in MODES:
        raise BadInput(f"unknown --mode {args.mode!r}; use one of: {', '.join(MODES)}")
    parse_steps(args.steps)
    online_options(args.mode, args.budget, args.sensors)
    check_invariants(args.check, args.mode)  # a bad file before anything runs
    program = os.path.basename(command[0])
    given = _launcher_command(args.out)  # (this process is the one `bitguard record -- python SCRIPT` started)
    if command[0].endswith(".py") or (given is not None and Path(command[0]).is_file()):
        # In-process: one rank of a job (torchrun -m bitguard record --out DIR -- train.py), or the script the
        # launcher was given after python, whatever its name (a console script: `python $(which yolo) train`)
        return run_script(command[0], command[1:], command=given or list(command), **_record_kwargs(args))
    if not _PYTHON.match(program):
        launcher = f"{program} launch" if program == "accelerate" and command[1:2] == ["launch"] else program
        if launcher in _MODULE_LAUNCHERS:
            raise NotSupported(f"not supported yet: launching {launcher!r} from bitguard; put bitguard inside the "
                               f"launcher instead, each process records its rank: '{launcher} [OPTIONS] -m bitguard "
                               f"record --out {args.out} -- SCRIPT [ARGS]' (README.md, Launchers), or use 'python SCRIPT'")
        raise NotSupported(f"not supported yet: launching {launcher!r} from bitguard; run the script with python "
                           f"('bitguard record --out {args.out} -- python SCRIPT [ARGS]'), or, where the launcher "
                           f"starts the processes itself, record in the script: 'with bitguard.record({args.out!r}):' "
                           f"around the training (README.md, Launchers)")
    py_opts, rest = [], command[1:]
    while rest and rest[0].startswith("-"):
        if rest[0] in ("-m", "-c"):
            raise NotSupported(f"not supported yet: 'python {rest[0]} ...'; pass the script's path instead")
        py_opts.append(rest.pop(0))
        if py_opts[-1] in _PYTHON_OPTIONS_WITH_VALUE and rest:  # (`-W ignore`, `-X dev`: the next word is its value)
            py_opts.append(rest.pop(0))
    if not rest:
        raise BadInput("no script after python; give the training script, e.g. -- python train.py")
    script = rest[0]
    if not Path(script).is_file():
        raise BadInput(f"script {script} not found; give the path of the training script after -- python")
    python = _interpreter(command[0])
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out} is a file; give a directory")
    check_writable(out)
    existing = list(out.iterdir())
    if existing:
        if not args.force:
            raise BadInput(f"--out {out} is not empty ({len(existing)} entries); choose an empty directory "
                           f"or pass --force to replace the recording there")
        for p in bitguard_files(out):
            p.unlink()
    child = [python, *py_opts, "-m", "bitguard", "record", *_forwarded(args), "--", *rest]
    return _launch(child, out, command, hash_seed=args.determinism is not False)


def _launcher_command(out: str) -> list[str] | None:
    """The command as typed to the `bitguard record` launcher that started this process for the
    same --out (`_launch`), so that the manifest says it from the start: a launcher killed before
    the end never writes it, and the run's own would lack the interpreter (`train.py ...`, not
    `python train.py ...`). Taken out of the environment: a process this one starts is not its child."""
    raw = os.environ.pop("BITGUARD_LAUNCHER_COMMAND", None)
    try:
        given = json.loads(raw) if raw else None
    except ValueError:
        return None
    if (isinstance(given, dict) and given.get("out") == os.path.abspath(out) and isinstance(given.get("command"), list)
            and given["command"] and all(isinstance(c, str) for c in given["command"])):
        return given["command"]
    return None


def _interpreter(python: str) -> str:
    """The interpreter to run the script under, checked before anything is written (a wrong one
    leaves --out as it was). A bare name (`python`, `python3`) is looked up on PATH; when what is
    found there cannot import bitguard (no venv activated), the interpreter bitguard itself runs
    under is used instead, and said so on stderr: it has bitguard and torch, and is the python the
    user most likely meant. A path (`.venv/bin/python`, `/usr/bin/python3`) is taken as given and
    must import bitguard."""
    bare = os.sep not in python and not (os.altsep and os.altsep in python)
    exe = shutil.which(python)
    if exe is not None and _imports_bitguard(exe, python):
        return exe
    if bare and sys.executable:
        where = f"{python!r} on PATH ({exe}) cannot import bitguard" if exe else f"{python!r} is not on PATH"
        print(f"bitguard record: {where}; running the script with {sys.executable}, the interpreter bitguard runs "
              f"under (give another python's path after -- to choose)", file=sys.stderr)
        return sys.executable
    if exe is None:
        raise BadInput(f"interpreter {python!r} not found; give the python that runs the training "
                       f"(e.g. -- {sys.executable} train.py)")
    raise BadInput(f"interpreter {python!r} ({exe}) cannot import bitguard; install bitguard into that "
                   f"environment (pip install bitguard) or give its python, e.g. -- {sys.executable} ...")


PROBED = "bitguard.collectors"


def _imports_bitguard(exe: str, python: str) -> bool:
    # bitguard.collectors, not just bitguard: in a checkout's root a python without bitguard installed
    # finds the bitguard/ folder itself, but not the packages the install maps beside it
    if os.path.abspath(exe) == os.path.abspath(sys.executable or "") and importlib.util.find_spec(PROBED):
        return True  # the interpreter running this (by its own path: a venv's, not what it links to): no probe
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({PROBED!r}) is None)"
    try:
        return subprocess.run([exe, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BadInput(f"interpreter {python!r} cannot be started ({exc}); give another python after --") from None


def _forwarded(args) -> list[str]:
    opts = ["--out", args.out, "--mode", args.mode, "--seed", str(args.seed)]
    if args.steps:
        opts += ["--steps", args.steps]
    if args.determinism is False:
        opts.append("--no-determinism")
    if args.budget is not None:
        opts += ["--budget", repr(args.budget)]
    if args.sensors is not None:
        opts += ["--sensors", args.sensors]
    if args.warn_only:
        opts.append("--warn-only")
    if args.threads:
        opts += ["--threads", str(args.threads)]
    if args.dump:
        opts.append("--dump")
    if not args.digest_cache:
        opts.append("--no-digest-cache")
    if args.check is not None:
        opts += ["--check", os.path.abspath(args.check)]
    return opts


def _launch(child: list[str], out: Path, command: list[str], hash_seed: bool = True) -> int:
    """Run the recording child; with the determinism controls (`hash_seed`), Python's string hashes
    are fixed (PYTHONHASHSEED=0, unless set): the order of a set of names (peft's target_modules, a
    set of parameters) then is the same from run to run. The manifest records the variable."""
    from bitguard import manifest

    env = dict(os.environ, BITGUARD_LAUNCHER_COMMAND=json.dumps({"out": os.path.abspath(out), "command": command}))
    if hash_seed:
        env.setdefault("PYTHONHASHSEED", "0")
    proc = subprocess.Popen(child, env=env)
    forward = lambda signum, frame: proc.send_signal(signum)  # noqa: E731
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    exit_status = code if code >= 0 else 128 - code
    from bitguard.recording import disabled

    if disabled() and not (out / MANIFEST_NAME).exists():
        print(f"bitguard: BITGUARD_DISABLE is set: the script ran unrecorded and {out} holds no run", file=sys.stderr)
        return exit_status
    _fold_journals(out)
    try:
        data = manifest.read(out)
    except (OSError, ValueError):
        # the child died before it wrote one (an import error, a kill at start): say so in a manifest
        # every reader understands ("no rank files: the recording wrote no events")
        data = {"tool": "bitguard", "schema_version": SCHEMA_VERSION, "digest": DIGEST, "status": "running",
                "complete": False, "command": command, "world_size": 1}
    data["command"] = command
    data["exit_status"] = exit_status
    if code < 0:
        data["signal"] = signal.Signals(-code).name
    if data.get("status") == "running" or (exit_status and data.get("status") == "complete"):
        data["status"] = "interrupted" if code in (-signal.SIGINT, -signal.SIGTERM) else "failed"
        data["complete"] = False
    manifest.write(out, data)
    return exit_status


def _fold_journals(out: Path) -> None:
    """A killed child leaves its last events in rank-N.journal: fold them in now. (Readers never
    write into a run: they read what a journal still holds in memory.)"""
    from bitguard.collectors.store import recover

    for journal in sorted(out.glob("rank-*.journal")):
        for wait in (0.2, 0.5, 1, 2, 4, 8, None):  # a fold process ends its fold in hand first (collectors/folder.py)
            try:
                recover(journal.with_suffix(".duckdb"))
                break
            except Exception as exc:  # noqa: BLE001 - the journal stays; every reader tries again
                if wait is not None and "lock" in str(exc).lower():
                    time.sleep(wait)
                    continue
                print(f"bitguard: could not fold {journal} into its rank file yet: {exc}", file=sys.stderr)
                break


def cmd_compare(args) -> int:
    from bitguard.backend.compare import compare
    from bitguard.backend.report import render_text

    comparison = compare(args.run_a, args.run_b, rules=args.rules, rank=args.rank, jobs=args.jobs,
                         ray=args.ray, frames=False, resumed_at=args.resumed_at)  # (the report reads no frame)
    if args.json:

        _print(json.dumps(comparison.to_dict(), indent=2))
    else:
        _print(render_text(comparison))
    return comparison.exit_status


def _print(text: str) -> None:
    """print(), but a reader that closed the pipe early (`| head`) is not an error."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
        os.close(devnull)


def cmd_check(args) -> int:
    from bitguard.backend.check import run_checks
    from bitguard.backend.report import render_check

    result = run_checks(args.run, rank=args.rank)
    if args.json:

        _print(json.dumps(result.to_dict(), indent=2))
    else:
        _print(render_check(result))
    return result.exit_status


def cmd_drill(args) -> int:
    from bitguard.backend.drill import drill
    from bitguard.backend.report import render_drill

    if not args.timeout > 0:  # also nan, which every comparison fails (the replays were stopped at once)
        raise BadInput(f"--timeout {args.timeout} is not a positive number of seconds")
    if not args.keep_mib >= 0:  # (nan too)
        raise BadInput(f"--keep-mib {args.keep_mib} is negative; give the MiB of a tensor kept whole (default 64)")
    report = drill(args.run_a, args.run_b, rank=args.rank, rules=args.rules, out=args.out, timeout=args.timeout,
                   max_tensor_bytes=int(args.keep_mib * (1 << 20)))
    if args.json:

        _print(json.dumps(report.to_dict(), indent=2))
    else:
        _print(render_drill(report.to_dict()))
    return report.exit_status


def cmd_alerts(args) -> int:
    from bitguard.backend.alerts import read_alerts, render_text, to_json

    report = read_alerts(args.run)
    _print(to_json(report) if args.json else render_text(report))
    return report.exit_status


def cmd_export_perfetto(args) -> int:
    from bitguard.backend.compare import compare

    comparison = compare(args.run_a, args.run_b, rules=args.rules)
    try:
        path = comparison.export_perfetto(args.output, args.max_events)
    except OSError as exc:
        raise BadInput(f"cannot write the trace {args.output}: {exc.strerror or exc}; give another -o") from None
    _print(f"wrote {path} (open it at ui.perfetto.dev: Open trace file)")
    return 0


def cmd_serve(args) -> int:
    from bitguard.backend.server import serve

    serve(args.workspace, args.host, args.port, demo=tuple(args.demo) if args.demo else None)
    return 0


def cmd_eval(args) -> int:
    from bitguard.sample_traces.evaluation import main as evaluate

    return evaluate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bitguard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("record", help="run a training script with collectors attached; write a run directory")
    _record_options(p)
    p.set_defaults(func=cmd_record)

    p = sub.add_parser("compare", help="compare two run directories; exit 0 identical, 1 diverged, 2 bad input, "
                                       "3 inconclusive, 70 internal error")
    p.add_argument("run_a", help="reference run directory")
    p.add_argument("run_b", help="suspect run directory")
    p.add_argument("--rules", default=None, help="benign-difference rules file (JSON, bitguard.rules/1)")
    p.add_argument("--rank", type=int, default=None, help="compare only this rank")
    p.add_argument("--json", action="store_true", help="print the bitguard.compare/1 JSON report")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="compare ranks in N worker processes (default: the cores, on a machine of 4 or more, when "
                        "the runs hold two or more ranks and enough events to pay for starting workers, and no more "
                        "than the available memory holds; 1: in this process)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="compare the ranks on a Ray cluster: its address (host:port), or 'auto' for the one "
                        "'ray start' runs here; the run directories must be at the same path on every node "
                        "(needs the ray extra)")
    p.add_argument("--resumed-at", type=int, default=0, metavar="STEP",
                   help="run B resumed the training from a checkpoint at STEP in a new process that counted its steps "
                        "from 0: compare B's step s with A's step STEP+s, and leave A's steps before STEP out")
    p.set_defaults(func=cmd_compare)

    what = ("check one run against itself, with no reference run (each activation recompute against its original "
            "forward, ...); exit 0 clean, 1 findings, 2 bad input, 3 inconclusive (nothing it could check, or the run "
            "is incomplete, damaged, missing ranks or reported collector errors), 70 internal error")
    p = sub.add_parser("check", help=what, description=what)
    p.add_argument("run", help="run directory")
    p.add_argument("--rank", type=int, default=None, help="check only this rank")
    p.add_argument("--json", action="store_true", help="print the bitguard.check/1 JSON document")
    p.set_defaults(func=cmd_check)

    what = ("replay both runs for the pivot's step, trace every torch operation inside its blame window and name the "
            "first that differs, with its source line, a numeric diff and a fault signature; exit 0 an op named, 1 the "
            "replays' windows do not differ, 2 bad input or not supported, 3 a replay does not reproduce its record, "
            "70 internal error")
    p = sub.add_parser("drill", help=what, description=what)
    p.add_argument("run_a", help="reference run directory")
    p.add_argument("run_b", help="suspect run directory")
    p.add_argument("--rank", type=int, default=None, help="drill this rank's pivot (default: the first divergence)")
    p.add_argument("--rules", default=None, help="benign-difference rules file to apply to the comparison first")
    p.add_argument("--out", default=None, help="where the drill records go (default: RUN/drill/ beside each run)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the replays may take (default 3600)")
    p.add_argument("--keep-mib", type=float, default=64.0,
                   help="MiB of a tensor kept whole (default 64); of a bigger one, a second replay keeps the 1-MiB "
                        "chunks that differ")
    p.add_argument("--json", action="store_true", help="print the bitguard.drill/1 JSON document")
    p.set_defaults(func=cmd_drill)

    what = ("list the alerts of a run recorded with --mode online, each in its latest state, with how to replay "
            "a confirmed one offline; exit 0 no confirmed alert, 1 some confirmed, 2 bad input (not an online run)")
    p = sub.add_parser("alerts", help=what, description=what)
    p.add_argument("run", help="run directory recorded with --mode online")
    p.add_argument("--json", action="store_true", help="print the bitguard.alerts/1 JSON document")
    p.set_defaults(func=cmd_alerts)

    from bitguard.backend.invariants.commands import add_commands as add_invariants_commands
    add_invariants_commands(sub)  # bitguard invariants infer|check (issue 17)

    p = sub.add_parser("export-perfetto", help="write a Perfetto trace of the comparison")
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("-o", "--output", required=True, help="trace file to write (.perfetto-trace)")
    p.add_argument("--rules", default=None, help="benign-difference rules file to apply first")
    p.add_argument("--max-events", type=int, default=None,
                   help="export at most this many events per comparison, in a window around each rank's pivot")
    p.set_defaults(func=cmd_export_perfetto)

    p = sub.add_parser("serve", help="start the browser explorer")
    p.add_argument("--workspace", default=None, help="workspace directory (default: user data dir)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--demo", nargs=2, metavar=("RUN_A", "RUN_B"), default=None,
                   help="import these two run directories (once) and open their comparison")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("eval", help="record the sample fault scenarios, localise each one, print the tables "
                                    "(docs/EVALUATION.md); exit 0 when every fault is localised")
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO", help="scenario names (default: all; see "
                   "python -m bitguard.sample_traces.scenarios list)")
    p.add_argument("--out", default="runs/eval", help="where recordings are kept and reused (default runs/eval)")
    p.add_argument("--json", action="store_true", help="print the bitguard.eval/1 JSON document")
    p.add_argument("--ablations", action="store_true",
                   help="also score XOR-only, sum, 1e-3 tolerance, no determinism and few-probes analyses")
    p.add_argument("--watch-steps", type=int, default=100,
                   help="steps of the plain runs the loss watcher reads (0: skip the loss watcher)")
    p.add_argument("--workers", type=int, default=2, help="recordings and comparisons run at once (default 2)")
    p.add_argument("--no-reruns", dest="reruns", action="store_false",
                   help="skip recording every run twice (the rerun check)")
    p.add_argument("--fresh", action="store_true", help="delete --out first and record everything again")
    p.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BitguardError as exc:
        print(f"bitguard {args.cmd}: error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"bitguard {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug of ours: say so, keep the traceback, never exit 1
        shadowed = _import_failure(exc)
        if shadowed is not None:  # (helper 74: an empty `scipy` on PYTHONPATH failed numba's import: "internal error")
            print(f"bitguard {args.cmd}: error: a package bitguard uses failed to import ({type(exc).__name__}: "
                  f"{str(exc)[:300]}, in {shadowed}): a module on PYTHONPATH or in this folder may stand in for an "
                  f"installed one (PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}); run bitguard without it",
                  file=sys.stderr)
            return BadInput.exit_code
        saved = _save_traceback(args.cmd, argv)
        where = f"the traceback is in {saved}" if saved else "the traceback could not be saved"
        print(f"bitguard {args.cmd}: internal error ({type(exc).__name__}: {str(exc)[:300]}); {where}: please "
              f"report it with that file", file=sys.stderr)
        return INTERNAL_ERROR


def _import_failure(exc: BaseException) -> str | None:
    """The file where `exc` was raised when it was raised while Python imported a module of another
    package than bitguard's (a dependency's import failed: an environment's fault, not bitguard's), else
    None."""
    roots = [os.path.abspath(p) + os.sep for p in _package_paths()]

    def ours(frame) -> bool:
        return os.path.abspath(frame.filename).startswith(tuple(roots))

    frames = traceback.extract_tb(exc.__traceback__)  # (Python leaves importlib's own frames out)
    importing = any(f.name == "<module>" and not ours(f) for f in frames)  # (a module's body running: its import)
    return frames[-1].filename if frames and importing and not ours(frames[-1]) else None


def _package_paths() -> list[str]:
    """The folders of bitguard's own packages (one, installed; several, an editable install's)."""
    return [path for name, module in list(sys.modules.items()) if name == "bitguard" or name.startswith("bitguard.")
            for path in (getattr(module, "__path__", None) or ())]


def _save_traceback(cmd: str, argv: list[str]) -> str | None:
    try:
        fd, path = tempfile.mkstemp(prefix=f"bitguard-{cmd}-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"bitguard {' '.join(argv)}\n\n{traceback.format_exc()}")
        return path
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
