"""What every online sensor is: the `Sensor` interface, the `Alert` it raises and the `Task` the
verifier runs for it.

A sensor sits on the training's critical path and must be cheap: it attaches hooks at `install`,
checks what the budget lets it (`monitor.budget.allow`, `monitor.budget.charge`), and raises an
`Alert` with `monitor.raise_alert(alert, payload)` when something is off, the payload being the
minimal evidence copied at raise time (never a reference to a tensor training will change). The
expensive confirmation runs later, off the critical path, on the verifier's thread:
`verify(task)`. This module knows nothing about particular operators.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SEVERITIES = ("alert", "warning")  # alert: goes to the verifier; warning: a lead, never confirmed
STATES = ("pending", "confirmed", "transient", "cleared", "warning")
VERDICTS = ("confirmed", "transient", "cleared")  # what verify() returns


@dataclass
class Alert:
    sensor: str  # sensor name (checksum, recompute, crossrank, guard)
    boundary: str  # module path, parameter name, collective, loss, grad_norm
    op: str  # operator: linear, linear.dgrad, linear.wgrad, matmul, allreduce, ...
    severity: str = "alert"  # alert | warning
    evidence: dict = field(default_factory=dict)  # JSON-able: what was seen
    threshold: float | None = None  # threshold in force when raised


@dataclass
class Task:
    alert_id: int  # the alert it verifies
    step: int  # step the alert was raised in
    sensor: "Sensor"  # whose verify() runs it
    payload: Any  # evidence tensors, copied at raise time
    raised_t: float  # time.monotonic() when raised
    alert: Alert | None = None  # the alert itself (for the verdict's row)


class Sensor:
    """One kind of online check. Subclasses set `name` and override what they need."""

    name = "sensor"

    def install(self, monitor) -> None:
        """Attach hooks; wrap each one in monitor.guard(fn) so it never raises into training."""
        self.monitor = monitor

    def remove(self) -> None:
        """Remove every hook install() attached."""

    def on_step_end(self, step: int) -> None:
        """Called on the training thread when step `step` ends (after optimizer.step())."""

    def verify(self, task: Task) -> tuple[str, dict]:
        """(verdict, evidence) for one task, verdict one of VERDICTS; runs on the verifier thread."""
        raise NotImplementedError(f"sensor {self.name} raises no alerts to verify")

    def on_verdict(self, task: Task, verdict: str) -> None:
        """Called on the verifier thread after verify(): e.g. a false alarm doubles a threshold."""

    def stats(self) -> list[dict]:
        """sensor_stats rows for the step that ends (op, calls, checked, rate, seconds, flops_seen,
        flops_checked, threshold), then reset the per-step counters."""
        return []

    def pending_stats(self, step: int) -> list[dict]:
        """sensor_stats rows stats() still holds (a row summing several steps), to step `step`: called
        once when the recording ends after a step's end."""
        return []

    def coverage(self) -> dict:
        """What the sensor sees and what it cannot (for the manifest and `bitguard alerts`)."""
        return {}


class LinearPatch:
    """nn.Linear.forward wrapped at the class (only Linear calls pay; a subclass with its own forward
    is not wrapped): `callback(module, input, output)` runs after each eager call, guarded by the
    monitor, and never inside a torch.compile trace. Patches stack: the one installed last sees the
    output the earlier ones let through (the SDC simulator installs first)."""

    def __init__(self, monitor, callback):
        self.monitor = monitor
        self.callback = callback
        self._original = self._wrapper = None

    def install(self) -> None:
        import torch

        self._original = original = torch.nn.Linear.forward
        monitor, callback = self.monitor, self.monitor.guard(self.callback)
        is_compiling = torch.compiler.is_compiling

        def forward(module, input):
            out = original(module, input)
            if monitor.enabled and not is_compiling():
                callback(module, input, out)
            return out

        forward.__wrapped__ = original
        self._wrapper = forward
        torch.nn.Linear.forward = forward

    def remove(self) -> None:
        import torch

        if self._original is not None and torch.nn.Linear.forward is self._wrapper:
            torch.nn.Linear.forward = self._original
        self._original = None
