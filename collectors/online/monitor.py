"""The online monitor: what `--mode online` installs in the training process instead of the
recording Collector.

It counts steps with a global optimizer step post hook (step 0 until the first optimizer.step()
ends, as events count them), installs the chosen sensors, gives them the budget
(`monitor.budget`) and `raise_alert`, runs the verifier, and at every step's end writes each
sensor's `sensor_stats` rows and the alert rows of the step (raised ones, and the verifier's
verdicts) to the rank's store through its journal, so a killed run keeps them. What the store's
writer thread spends on them (its CPU time, folds included, as a mean per step so far: a fold every
FOLD_SECONDS would otherwise empty one step's allowance) is charged to the budget as fixed cost:
that thread competes with training for the interpreter and the cores, and no sampling rate lowers it. Every alert state
change is also one line on stderr. It records no boundary event and changes nothing the training
computes: its hooks read tensors, copy evidence, and never raise (`guard`).

It does not know what a sensor checks; module names come from `ModuleNames` (the same dotted
paths events use, found from the first call of a module without wrapping every module call).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import weakref

import torch

from bitguard.collectors.api_events import ApiRecorder, OnlineNaming
from bitguard.collectors.compiled import aside_while_tracing
from bitguard.collectors.guarded import Guarded
from bitguard.collectors.weights import initialising_step
from bitguard.collectors.online.budget import DEFAULT_BUDGET, Budget
from bitguard.collectors.online.sensor import Alert, Task
from bitguard.collectors.online.verifier import Verifier, Verdict
from bitguard.schema import ALERTS, SENSOR_STATS

MAX_REPORTED_ERRORS = 20
DRAIN_SECONDS = 30.0  # at the recording's end, how long the verifier may still run
MAX_PRINTED_ALERTS = 200  # stderr lines; every state change is in the alerts table whatever the count
FOLD_SECONDS = 30.0  # the rank store folds its journal into DuckDB this often (a fold's ~30 ms of CPU every 5 s
# was about 0.6 ms a step; the journal is durable and readers read it, so folding later loses nothing)


class ModuleNames:
    """Dotted module paths as named_modules() gives them under each root (a root: its class
    name), found on a module's first call by walking the Python stack up to the outermost module
    whose forward is running (its `self`). A module called outside any module's forward is its own
    root."""

    def __init__(self):
        self._names: dict[int, tuple[weakref.ref, str]] = {}
        self._roots: set[str] = set()

    def __call__(self, module: torch.nn.Module) -> str:
        entry = self._names.get(id(module))
        if entry is not None and entry[0]() is module:
            return entry[1]
        root = module
        frame = sys._getframe(1)
        while frame is not None:
            candidate = frame.f_locals.get("self") if frame.f_code.co_name in ("forward", "_call_impl") else None
            if isinstance(candidate, torch.nn.Module) and candidate is not root:
                if any(m is root for m in candidate.modules()):
                    root = candidate
            frame = frame.f_back
        self._register(root)
        entry = self._names.get(id(module))
        return entry[1] if entry is not None else type(module).__name__

    def _register(self, root: torch.nn.Module) -> None:
        from bitguard.collectors.compiled import eager_name
        from bitguard.collectors.sharded import clean_name

        base = name = type(root).__name__
        n = 1
        while name in self._roots:
            n += 1
            name = f"{base}#{n}"
        self._roots.add(name)
        for sub_name, sub in root.named_modules():
            entry = self._names.get(id(sub))
            if entry is None or entry[0]() is not sub:
                self._names[id(sub)] = (weakref.ref(sub), clean_name(eager_name(sub_name)) or name)


class ChargedApiRecorder(ApiRecorder):
    """The API-event recorder of online mode: what its hooks cost on the training thread is charged to
    the budget as fixed cost (its rows are part of what online mode costs, and no rate lowers them)."""

    def __init__(self, budget: Budget, *args, **kwargs):
        self._budget = budget
        super().__init__(*args, **kwargs)

    def _guarded(self, fn, *args, **kwargs):
        t0 = self._budget.clock()
        try:
            return super()._guarded(fn, *args, **kwargs)
        finally:
            self._budget.charge_fixed(self._budget.clock() - t0)


class OnlineMonitor(Guarded):
    def __init__(self, store, rank: int = 0, world_size: int = 1, budget: float = DEFAULT_BUDGET,
                 sensors: list | None = None, simulator=None, clock=time.perf_counter, verifier_thread: bool = True,
                 out=sys.stderr):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.errors: list[str] = store.errors if store is not None else []
        self.enabled = True
        self.budget = Budget(budget, clock, seed=rank)
        self.sensors = list(sensors or [])
        self.simulator = simulator  # the SDC simulator (tests and evaluation only), or None
        self.module_name = ModuleNames()
        self.verifier = Verifier(self._on_verdict, thread=verifier_thread)
        self.alerts_raised = 0
        self.writer_charge_s = 0.0  # the writer CPU charged at the last step's end
        self.states: dict[int, str] = {}  # alert_id -> latest state
        self._out = out
        self._step = 0
        self._advance = False
        self._lock = threading.Lock()
        self._rows: list[dict] = []  # alert rows waiting for the training thread
        self._handles: list = []
        self._paused = False
        self.api: ChargedApiRecorder | None = None  # the API-event recorder (collectors/api_events.py), once installed
        self._printed = 0
        self._stepped: set[int] = set()  # optimizers that stepped since the last step's end
        self._writer_start = getattr(store, "writer_cpu_s", 0.0)  # the store's writer CPU before this recording

    # -- steps ---------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The current step (0 until the first optimizer.step() ends)."""
        if self._advance:
            self._advance = False
            self._step += 1
        return self._step

    def install(self) -> None:
        from torch.optim import optimizer as optim

        self._handles.append(optim.register_optimizer_step_post_hook(self.guard(self._on_optimizer_step)))
        if self.store is not None:  # API-level events (collectors/api_events.py); its step hook after ours
            self.api = ChargedApiRecorder(self.budget, self.store, OnlineNaming(self), self._fail, self.rank).install()
            self._handles.append(self.api)
        if self.simulator is not None:  # first: the sensors see its corrupted outputs, as they would a device's
            self.guard(self.simulator.install)(self)
        for sensor in self.sensors:
            self.guard(sensor.install)(self)
        self._handles += aside_while_tracing(self)  # (torch.jit.trace: its traced and checking runs are not the training)
        self.budget.start()

    def remove(self) -> None:
        """Remove every hook, let the verifier finish (DRAIN_SECONDS at most: what is left stays
        pending) and write what is still queued (a paused monitor resumes first: what it holds is written)."""
        if self._paused:
            self.resume()
        for sensor in reversed(self.sensors):
            self.guard(sensor.remove)()
        if self.simulator is not None:
            self.guard(self.simulator.remove)()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        left = self.verifier.drain(DRAIN_SECONDS)
        if left:
            print(f"bitguard: online: {left} verification task(s) unfinished at the end; their alerts stay pending",
                  file=self._out)
        if self._active():
            self.guard(self._end_step)(final=True)  # the last, partial step's counters
        self.guard(self._pending_stats)()  # (the rows sensors hold to sum several steps)
        self.guard(self._flush)()
        self.enabled = False

    def pause(self) -> None:
        """Observe nothing until resume(), for a benchmark's paired steps (bench_online.py paired):
        every hook of the monitor, its sensors and the API recorder returns at its first test of
        `enabled`, so nothing is checked, counted, charged or written and the step counter stands
        still; the hooks stay installed and keep what they learned (thresholds, rates, costs, the
        balance). Call it between steps: the verifier goes on with its queue."""
        self._paused = True
        self.enabled = False
        if self.api is not None:
            self.api.enabled = False

    def resume(self) -> None:
        """Observe again after pause(): the budget's clock starts the next step now (the paused
        steps are not training time it allowed checks for)."""
        if self.api is not None:
            self.api.enabled = True
        self.budget.start()
        self._paused = False
        self.enabled = True

    def steps_seen(self) -> int:
        return self._step + (1 if self._advance else 0)

    def _active(self) -> bool:
        """Whether a protected call was seen since the last step's end."""
        return any(e.calls for e in self.budget.ops.values())

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if initialising_step():  # (torch.distributed.checkpoint filling the state in: no training step)
            return
        if self._advance:
            if id(optimizer) not in self._stepped and not self._active():
                # another optimizer in the same step: no protected call ran since the first one's step()
                # (without a sensor that sees calls, another optimizer's step() always joins the step)
                self._stepped.add(id(optimizer))
                return
            self._advance = False
            self._step += 1
        self._stepped = {id(optimizer)}
        try:
            self._end_step()
        finally:
            self._advance = True

    def _end_step(self, final: bool = False) -> None:
        """`final`: the recording ends inside a step (no sensor's on_step_end: a cross-rank exchange
        there could wait for a rank that has gone)."""
        step = self.step  # (a partial last step's calls, after an optimizer.step() ended, are the next step's)
        for sensor in self.sensors if not final else ():
            self.guard(sensor.on_step_end)(step)
        t0 = self.budget.clock()
        rows = []
        for sensor in self.sensors:
            rows += self.guard(sensor.stats)() or []
        queue = len(self.verifier)
        for row in rows:
            row.update(step=step, rank=self.rank, queue=queue)
            row.setdefault("steps", 1)
        self._charge_writer(step)
        self.budget.step_end()
        self.budget.reset()
        if self.store is not None and rows:
            self.store.add_rows(SENSOR_STATS.name, rows)
        if self.simulator is not None:
            self.guard(self.simulator.on_step_end)(step)
        self._flush()
        self.budget.charge_fixed(self.budget.clock() - t0)

    def _pending_stats(self) -> None:
        """The sensors' rows still held when the recording ends, to its last step (the last that ended,
        or the partial one _end_step(final=True) just wrote)."""
        step = self._step
        rows = []
        for sensor in self.sensors:
            rows += self.guard(sensor.pending_stats)(step) or []
        for row in rows:
            row.update(rank=self.rank, queue=len(self.verifier))
        if self.store is not None and rows:
            self.store.add_rows(SENSOR_STATS.name, rows)

    def _charge_writer(self, step: int) -> None:
        """Charge the store's writer thread's CPU time as fixed cost: its mean per step so far (steps
        0 to `step`), so a fold's burst is spread over the steps that made its rows."""
        spent = getattr(self.store, "writer_cpu_s", None)
        if spent is not None:
            self.writer_charge_s = (spent - self._writer_start) / (step + 1)
            self.budget.charge_fixed(self.writer_charge_s)

    def _flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if self.store is not None:
            if rows:
                self.store.add_rows(ALERTS.name, rows)
            if not self.store.step_barrier():
                self._fail("step barrier", TimeoutError("writer did not commit within 30 s"))

    # -- alerts --------------------------------------------------------------------------------
    def sensor(self, name: str):
        return next((s for s in self.sensors if s.name == name), None)

    def raise_alert(self, alert: Alert, payload=None) -> int:
        """Record an alert (a `pending` row, or `warning`), print its line, and queue its
        verification when it is an alert. Its id."""
        with self._lock:
            alert_id = self.alerts_raised
            self.alerts_raised += 1
        step = self.step
        state = "pending" if alert.severity == "alert" else "warning"
        self._record(alert_id, step, alert, state, alert.evidence)
        if alert.severity == "alert":
            sensor = self.sensor(alert.sensor)
            if sensor is None:
                self._fail("raise_alert", ValueError(f"no sensor {alert.sensor!r} to verify alert #{alert_id}"))
            else:
                self.verifier.submit(Task(alert_id, step, sensor, payload, time.monotonic(), alert))
        return alert_id

    def _record(self, alert_id: int, step: int, alert: Alert, state: str, evidence: dict,
                latency: int | None = None, seconds: float | None = None) -> None:
        row = {"alert_id": alert_id, "step": step, "rank": self.rank, "sensor": alert.sensor,
               "boundary": alert.boundary, "op": alert.op, "severity": alert.severity, "state": state,
               "evidence": json.dumps(evidence, default=str, allow_nan=True), "threshold": alert.threshold,
               "t_ns": time.time_ns(), "latency_steps": latency, "verifier_s": seconds}
        with self._lock:
            self._rows.append(row)
            self.states[alert_id] = state
            printed = self._printed
            self._printed += 1
        if printed < MAX_PRINTED_ALERTS:
            print(f"bitguard: online alert #{alert_id} step {step} rank {self.rank} {alert.sensor} {alert.boundary} "
                  f"({alert.op}): {_summary(alert, evidence)} — {state}", file=self._out, flush=True)
        elif printed == MAX_PRINTED_ALERTS:
            print("bitguard: online: more alert state changes follow; only the alerts table holds them",
                  file=self._out, flush=True)

    def _on_verdict(self, verdict: Verdict) -> None:
        task = verdict.task
        now = self._step + (1 if self._advance else 0)
        self._record(task.alert_id, task.step, task.alert, verdict.state, verdict.evidence,
                     latency=now - task.step, seconds=verdict.seconds)

    # -- failure containment: guard() (collectors/guarded.py) ----------------------------------
    def _fail(self, where: str, exc: BaseException) -> None:
        message = f"online {where}: {type(exc).__name__}: {exc}"
        if message not in self.errors and len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(message)
            print(f"bitguard: collector error (training continues): {message}", file=self._out)


def _summary(alert: Alert, evidence: dict) -> str:
    """What the stderr line says was seen: the gap against the threshold, or the verdict's words."""
    if isinstance(evidence, dict) and isinstance(evidence.get("summary"), str):
        return evidence["summary"]
    gap = evidence.get("gap") if isinstance(evidence, dict) else None
    if isinstance(gap, (int, float)) and alert.threshold is not None:
        return f"gap {gap:.1e} > threshold {alert.threshold:.1e}"
    return alert.severity


def start(recording, rank: int, world: int, rank_path, settings: dict):
    """Online mode's part of `bitguard.record`: the manifest (mode online, its budget, sensors and
    any SDC simulation), this rank's store and the installed monitor. (store, monitor, manifest)."""
    import os

    from bitguard import manifest
    from bitguard.collectors.online import build
    from bitguard.collectors.online.simulator import from_env as simulator_from_env
    from bitguard.collectors.store import RankStore

    simulator = simulator_from_env(recording.out, rank)  # a bad spec is bad input, before anything starts
    options = {"budget": recording.budget, "sensors": recording.sensors,
               "sdc_simulate": None if simulator is None else simulator.spec_dict()}
    data = manifest.new(recording.command, recording.mode, world, settings, recording.steps, {"online": options})
    if rank == 0:
        manifest.write(recording.out, data)
    store = RankStore(str(rank_path), {
        "rank": rank, "world_size": world, "mode": recording.mode, "determinism": settings, "steps": recording.steps,
        "start_time_ns": time.time_ns(), "pid": os.getpid(), "online": options}, fold_seconds=FOLD_SECONDS,
        fold_process=False)  # (its CPU budget charges the writer's folds: they stay on its thread)
    monitor = OnlineMonitor(store, rank, world, recording.budget, build(recording.sensors), simulator)
    monitor.install()
    if simulator is not None:
        print(f"bitguard: online: SDC SIMULATION ACTIVE ({simulator.describe()}): this run's outputs are corrupted "
              f"on purpose (BITGUARD_SDC_SIMULATE)", file=sys.stderr)
    return store, monitor, data
