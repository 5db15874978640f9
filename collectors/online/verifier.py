"""The verifier: verification tasks run off the critical path, on a daemon worker thread.

Sensors' alerts become `Task`s in a bounded queue. The worker takes them oldest first and calls
the raising sensor's `verify(task)`, which re-runs the operator on the saved evidence and returns
confirmed / transient / cleared (the classification is each sensor's: see checksum.py). A full
queue drops its oldest task, whose alert becomes `transient` with evidence {"dropped": "queue
full"}: never silently lost. At the recording's end `drain(seconds)` waits for the queue up to a
time limit; what is left keeps its `pending` state. Verdicts are handed to the `on_verdict`
callback on the worker thread (the monitor queues their rows for the training thread: the store
is written from there only).

This module knows nothing about operators or tensors.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from bitguard.collectors.online.sensor import VERDICTS, Task

QUEUE_TASKS = 16


@dataclass
class Verdict:
    task: Task
    state: str  # confirmed | transient | cleared
    evidence: dict = field(default_factory=dict)
    seconds: float = 0.0  # the verifier's time on it


class Verifier:
    def __init__(self, on_verdict, max_tasks: int = QUEUE_TASKS, thread: bool = True):
        self.on_verdict = on_verdict  # called with each Verdict, on the worker thread
        self.max_tasks = max_tasks
        self._tasks: deque[Task] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stop = False
        self.seconds = 0.0  # spent verifying, in all
        self.done = 0
        self.dropped = 0
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="bitguard-verifier", daemon=True)
            self._thread.start()

    def __len__(self) -> int:
        with self._cond:
            return len(self._tasks) + self._busy

    def submit(self, task: Task) -> None:
        dropped = None
        with self._cond:
            if len(self._tasks) >= self.max_tasks:
                dropped = self._tasks.popleft()
                self.dropped += 1
            self._tasks.append(task)
            self._cond.notify()
        if dropped is not None:
            self.on_verdict(Verdict(dropped, "transient", {"dropped": "queue full"}))

    def run_one(self) -> bool:
        """Verify the oldest task on the calling thread (a worker-less verifier, tests); False when none."""
        with self._cond:
            if not self._tasks:
                return False
            task = self._tasks.popleft()
            self._busy = True
        try:
            self._verify(task)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        return True

    def _verify(self, task: Task) -> None:
        t0 = time.perf_counter()
        try:
            state, evidence = task.sensor.verify(task)
            if state not in VERDICTS:
                raise ValueError(f"verify() returned {state!r}, not one of {', '.join(VERDICTS)}")
        except Exception as exc:  # noqa: BLE001 - a verification that fails proves nothing either way
            state, evidence = "transient", {"verifier_error": f"{type(exc).__name__}: {exc}",
                                            "traceback": traceback.format_exc(limit=3)[-1500:]}
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        self.done += 1
        verdict = Verdict(task, state, evidence, seconds)
        try:
            task.sensor.on_verdict(task, state)
        except Exception:  # noqa: BLE001
            pass
        self.on_verdict(verdict)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._tasks and not self._stop:
                    self._cond.wait()
                if self._stop and not self._tasks:
                    return
            self.run_one()

    def drain(self, seconds: float) -> int:
        """Wait up to `seconds` for the queue to empty, then stop the worker; the tasks left (pending)."""
        deadline = time.monotonic() + seconds
        if self._thread is None:
            while time.monotonic() < deadline and self.run_one():
                pass
        with self._cond:
            while (self._tasks or self._busy) and self._thread is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._stop = True
            self._cond.notify_all()
            return len(self._tasks) + self._busy
