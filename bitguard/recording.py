"""Recording a training process: the `record` context manager and the in-process runner.

`record(DIR)` applies the determinism controls, opens this rank's file, installs the
collectors, and on exit removes them and marks the run complete, failed or interrupted. The
script runner executes a user's script unchanged inside such a recording (used by
`bitguard record` in a child process and directly under `torchrun -m bitguard record`).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

from bitguard import manifest, tracebacks
from bitguard.errors import BadInput
from bitguard.modes import MODES
from bitguard.schema import MANIFEST_NAME, RANK_FILE
from bitguard.tracebacks import print_failure


def disabled() -> bool:
    """The one switch: BITGUARD_DISABLE=1 turns every collector into a no-op."""
    return os.environ.get("BITGUARD_DISABLE", "") not in ("", "0")


def rank_and_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def parse_steps(text: str | None) -> tuple[int, int | None] | None:
    """'A:B' records steps A..B-1; 'A:' from A on; None records every step."""
    if text is None:
        return None
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        window = (int(start or 0), int(end) if end else None)
    except ValueError:
        raise BadInput(f"--steps {text!r} is not A:B (e.g. 0:10 or 5:); give a step range") from None
    if window[0] < 0 or (window[1] is not None and window[1] <= window[0]):
        raise BadInput(f"--steps {text!r} is an empty or negative range; give A:B with 0 <= A < B")
    return window


def online_options(mode: str, budget: float | None, sensors) -> tuple[float, list[str]]:
    """(budget, sensor names) of an online recording, checked; BadInput for options online mode
    alone takes given to another mode, or out of range."""
    if mode != "online":
        if budget is not None or sensors is not None:
            raise BadInput(f"--budget and --sensors apply to --mode online only (this is --mode {mode})")
        return 0.0, []
    from bitguard.collectors.online import parse_sensors
    from bitguard.collectors.online.budget import DEFAULT_BUDGET

    budget = DEFAULT_BUDGET if budget is None else budget
    if not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise BadInput(f"--budget {budget!r} is not a fraction of the step time in (0, 1]; e.g. 0.02 for 2%")
    return float(budget), parse_sensors(sensors)


def check_invariants(path, mode: str):
    """The invariants of `record --check FILE` (None without it); BadInput for a file that is not
    one, NotSupported in online mode (its monitor records no boundary events to check)."""
    if path is None:
        return None
    if mode == "online":
        from bitguard.errors import NotSupported

        raise NotSupported("not supported yet: --check with --mode online; record with --mode full or trusted")
    from bitguard.backend.invariants.check import load_invariants

    return load_invariants(path)


def check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".bitguard-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise BadInput(f"cannot write the run directory {directory}: {exc.strerror or exc}; "
                       f"choose another --out") from None


def bitguard_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir()
            if p.name == MANIFEST_NAME or (p.name.startswith("rank-") and p.suffix in (".duckdb", ".wal", ".json", ".journal"))
            or p.name.endswith(".duckdb.wal")]


class record:
    """`with bitguard.record(DIR, mode="full"):` records everything the block trains.

    `seed`: reseed Python's, NumPy's and torch's generators as the block begins. None (the default)
    leaves them as the script left them: a script seeds itself before its model and data, and a
    recording must not change what it trains (`bitguard record --seed N`, 0 by default, seeds before
    the script runs instead, where the script's own seeding overrides it)."""

    def __init__(self, out: str | os.PathLike, mode: str = "full", seed: int | None = None,
                 steps: str | tuple | None = None, force: bool = False, determinism: bool | None = None,
                 warn_only: bool = False, threads: int | None = None, command: list[str] | None = None,
                 dump: bool = False, digest_cache: bool = True, budget: float | None = None, sensors=None,
                 check: str | os.PathLike | None = None):
        if mode not in MODES:
            raise BadInput(f"unknown mode {mode!r}; use one of: {', '.join(MODES)}")
        # absolute: a script that changes its working directory (Hydra's @main, os.chdir) must not move the
        # run under it (helper 26: a relative --out lost every event, the journal's and manifest's paths gone)
        self.out = Path(os.path.abspath(out))
        self.mode = mode
        self.seed = seed
        self.steps = parse_steps(steps) if isinstance(steps, str) or steps is None else tuple(steps)
        self.force = force
        # online mode watches the user's production run: it changes none of its settings unless asked
        self.determinism = mode != "online" if determinism is None else determinism
        self.budget, self.sensors = online_options(mode, budget, sensors)
        self.warn_only = warn_only
        self.threads = threads
        self.dump = dump
        self.digest_cache = digest_cache
        self.command = command or list(sys.argv)
        self.collector = None
        self.store = None
        self._old_sigterm = None
        self._pid = os.getpid()  # (set again when the recording begins)
        self.drill = None  # a drill replay's op tracer (collectors/drill.py), when BITGUARD_DRILL is set
        self.monitor = None  # online mode's OnlineMonitor (collectors/online/monitor.py)
        self.invariants = check_invariants(check, mode)  # --check: what each step is checked against

    def __enter__(self):
        if disabled():
            return self
        rank, world = rank_and_world()
        self._pid = os.getpid()
        self.rank, self.world = rank, world
        check_writable(self.out)
        from bitguard.collectors.drill import from_env as drill_from_env

        drill = drill_from_env(rank, self.out) if self.mode != "online" else None  # bad input before anything starts
        rank_path = self.out / RANK_FILE.format(rank=rank)
        if rank_path.exists():
            if not self.force:
                raise BadInput(f"{rank_path} already exists; record into an empty directory or pass --force "
                               f"to replace it")
            for p in (rank_path, Path(str(rank_path) + ".wal"), rank_path.with_suffix(".journal")):
                p.unlink(missing_ok=True)

        from bitguard.collectors import determinism as det
        from bitguard.collectors.hooks import Collector
        from bitguard.collectors.store import RankStore
        from bitguard.cuda.fingerprint import warmup

        self._settings_before = det.snapshot()
        settings = det.apply(det.DeterminismConfig(self.determinism, self.seed, self.warn_only, self.threads))
        self._settings_applied = det.snapshot()
        if self.mode == "online":
            return self._enter_online(rank, world, rank_path, settings)
        self._manifest = manifest.new(self.command, self.mode, world, settings, self.steps, {"dump": self.dump, "digest_cache": self.digest_cache})
        if rank == 0:
            manifest.write(self.out, self._manifest)
            if self.determinism and os.environ.get("PYTHONHASHSEED") is None:  # (`bitguard record` sets it for its script)
                print(HASH_SEED_UNSET, file=sys.stderr)
        warmup()
        self.store = RankStore(str(rank_path), {
            "rank": rank, "world_size": world, "mode": self.mode, "determinism": settings,
            "steps": self.steps, "start_time_ns": time.time_ns(), "pid": os.getpid(), "dump": self.dump,
            "digest_cache": self.digest_cache,
        })
        self.collector = Collector(self.store, self.mode, self.steps, rank, world, dump=self.dump,
                                   digest_cache=self.digest_cache)
        self.collector.began = sys._getframe(1)  # (`with bitguard.record()`'s frame; run_script's for the CLI)
        self.collector.thread = threading.get_ident()  # (module calls on other threads are not recorded)
        if drill is not None:  # its module-call wrapper goes under the collector's
            drill.install(self)
            self.drill = drill
        self.collector.install()
        if self.invariants is not None and self.collector.api is not None:
            from bitguard.backend.invariants.check import Checker

            self.collector.api.check_with(Checker(self.invariants))
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        return self

    def _enter_online(self, rank: int, world: int, rank_path: Path, settings: dict):
        from bitguard.collectors.online.monitor import start

        self.store, self.monitor, self._manifest = start(self, rank, world, rank_path, settings)
        self.collector = self.monitor  # what finish() ends
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.collector is None or os.getpid() != self._pid:
            return False  # (a child forked inside the recording ends here too: the run is the parent's)
        if exc_type is None or (exc_type is SystemExit and exc.code in (0, None)):
            status = "complete"
        elif exc_type is KeyboardInterrupt or (exc_type is SystemExit and exc.code in (130, 143)):
            status = "interrupted"
        else:
            status = "failed"
        if self.determinism and not self.warn_only and isinstance(exc, RuntimeError) \
                and "does not have a deterministic implementation" in str(exc):
            print(NONDETERMINISTIC_OP, file=sys.stderr)
        self.finish(status, _exit_code(exc_type, exc))
        if exc is not None:
            tracebacks.trim(exc)  # (the recorder's module-call frames are not the user's to read)
        return False

    def finish(self, status: str, exit_status: int | None) -> None:
        """End the recording: the collector's hooks out, the rank file closed, the manifest written. A SIGTERM
        that comes meanwhile waits for the end of it (then raised as SystemExit, as it would have been)."""
        _FINISHING[:] = [0]
        try:
            self._finish(status, exit_status)
        finally:
            came = _FINISHING[1:]
            _FINISHING.clear()
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None
        if came:
            raise SystemExit(128 + came[0])

    def _finish(self, status: str, exit_status: int | None) -> None:
        from bitguard.collectors.determinism import FILL, TOUCHED, give_back

        collector, self.collector = self.collector, None
        elsewhere, drew = {}, {}
        if self.monitor is not None:
            collector.remove()
            steps_seen, events = collector.steps_seen(), 0
        else:
            collector.remove(final_state=status == "complete")  # a failed run's weights are not its result
            collector.began = collector.script_globals = None  # (the frame and the script's globals let go)
            steps_seen, events = collector.step + (1 if collector._advance else 0), collector._seq
            elsewhere, drew = collector.calls_elsewhere()
        if self.drill is not None:
            self.drill.close()
        refused = []
        try:  # the user's settings again (a notebook trains on after the recording)
            refused = FILL.remove()
            give_back(self._settings_before, self._settings_applied, TOUCHED.remove())
        except Exception as exc:  # noqa: BLE001 - the end of a recording must not fail on a setting (nor is it the record's)
            print(f"bitguard: could not give back the settings the determinism controls changed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
        if refused:
            print(f"bitguard: kept torch's fill of uninitialised memory on while recording (the script turned it "
                  f"off at {refused[0]}): what torch.empty makes reads as a fixed value in both runs, not as the "
                  f"bytes the memory held (--no-determinism leaves it as the script sets it)", file=sys.stderr)
        self.store.close(status, {"end_time_ns": time.time_ns(), "steps_completed": steps_seen,
                                  "events": events, **({"fill_kept_on": refused} if refused else {}),
                                  **({"threads_not_recorded": elsewhere, "threads_drew_rng": drew}
                                     if elsewhere else {})})
        if self.rank == 0:
            self._manifest.update(status=status, complete=status == "complete", exit_status=exit_status,
                                  end_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  collector_errors=list(self.store.errors), events_rank0=events,
                                  steps_completed=steps_seen,
                                  versions=manifest.versions_at_end(self._manifest.get("versions")),
                                  sources=_sources(self._manifest))
            manifest.write(self.out, self._manifest)
        if self.store.errors:
            print(f"bitguard: {len(self.store.errors)} collector error(s) recorded in {self.out}",
                  file=sys.stderr)
        if self.rank == 0 and self.steps is not None and steps_seen <= self.steps[0]:
            print(_window_never_opened(self.steps, steps_seen, status), file=sys.stderr)


# Said when a recording starts in a process whose hash seed is random (helper 44: peft saved its target_modules,
# a set of names, in another order in every run); this process's seed cannot be set any more.
HASH_SEED_UNSET = ("bitguard: PYTHONHASHSEED is not set: Python orders sets of strings differently in every process, "
                   "so two runs that iterate one (peft's target_modules) can differ; set it (PYTHONHASHSEED=0) before "
                   "Python starts, as `bitguard record` does for the script it runs")


# What a training that failed on torch's refusal of an operator without a deterministic implementation
# is told (helper 36: a quantized model's eval, `quantized_resize_cpu_`): the refusal is bitguard's doing.
NONDETERMINISTIC_OP = ("bitguard: this error comes from the determinism controls bitguard turned on "
                       "(torch.use_deterministic_algorithms(True)); record with --warn-only (warn_only=True in "
                       "Python) to have torch warn instead where an operator has no deterministic implementation "
                       "(the runs may then differ there), or with --no-determinism")


def _window_never_opened(window: tuple[int, int | None], steps_seen: int, status: str) -> str:
    """The line a recording whose --steps window the training never reached ends with (helper 29: a
    loop that updates its weights by hand is all step 0, and it learned so only from compare)."""
    a, b = window
    ran = f"the training {'ran' if status == 'complete' else status + ' after'} {steps_seen} step(s)"
    return (f"bitguard: --steps {a}:{'' if b is None else b} recorded no step: {ran} as bitguard counts them "
            f"(one per optimizer step(); a loop that updates the weights without torch.optim is one step); "
            f"give a window that starts below {max(steps_seen, 1)}, or no --steps")


def _sources(m: dict) -> dict:
    try:
        return manifest.sources(m.get("cwd"), m.get("command"))
    except Exception:  # noqa: BLE001 - the end of a recording must not fail on a hash
        return {}


_FINISHING: list[int] = []  # while a recording is finished (`finish`): the SIGTERMs that came, raised after it


def _sigterm_to_exit(signum, frame):
    if _FINISHING:  # (helper 63: torchrun's SIGTERM to the ranks still writing, as one failed, interrupted DuckDB's
        _FINISHING.append(signum)  # writes mid-query: raw database errors, a manifest left "running")
        return
    raise SystemExit(128 + signum)


def _sigterm_default_in_child() -> None:
    """A forked child (a pool's worker, a DataLoader's) is not the recording's: it ends on SIGTERM as
    without it. (Inherited, the handler made a terminated child's exit code 143, not -15; and a pool
    worker waiting on the pool's lock when the pool was terminated was seen never to end.)"""
    try:
        if signal.getsignal(signal.SIGTERM) is _sigterm_to_exit:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):  # (not the child's main thread: nothing set, nothing to give back)
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_sigterm_default_in_child)


def _exit_code(exc_type, exc) -> int:
    if exc_type is None:
        return 0
    if exc_type is SystemExit:
        code = exc.code
        return 0 if code is None else code if isinstance(code, int) else 1
    if exc_type is KeyboardInterrupt:
        return 130
    return 1


def _from_script(tb, filename: str):
    """The traceback from the frame of `filename`'s code on (the script's), None without one."""
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    return tb


def run_script(script: str, args: list[str], **record_kwargs) -> int:
    """Run SCRIPT with ARGS as `python SCRIPT ARGS` would, inside a recording. Returns its exit status."""
    path = Path(script)
    if not path.is_file():
        raise BadInput(f"script {script} not found; give the path of the training script after --")
    recording = record(**record_kwargs)
    recording.__enter__()  # bad input raises here, before the script runs
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    main = os.path.abspath(path)  # the script's __file__, absolute as python makes it (helper 18: it was relative)
    failure = (None, None, None)
    script_globals = None  # held until the recording ends: its final event reads the script's models
    try:
        script_globals = runpy.run_path(main, run_name="__main__")
    except SystemExit as exc:
        failure = (SystemExit, exc, exc.__traceback__)
        ended = _from_script(exc.__traceback__, main)  # (a script that ends with sys.exit(0): helper 83)
        script_globals = ended.tb_frame.f_globals if ended is not None else None
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - the script's own failure, reported as python would
        failure = (type(exc), exc, exc.__traceback__)
        shown = _from_script(exc.__traceback__, main)  # as python prints it (not runpy's frames and ours)
        print_failure(exc, shown or exc.__traceback__)  # (bitguard's module-call wrapper frames left out)
    finally:
        if hasattr(recording.collector, "script_globals"):  # (the last look for kept models reads them)
            recording.collector.script_globals = script_globals
        recording.__exit__(*failure)
        del script_globals
    return _exit_code(failure[0], failure[1])
