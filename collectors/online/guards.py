"""Guards: non-finite and magnitude checks on the loss and the gradient norm, and the loss-spike
watcher they share with the evaluation's baseline.

The loss is the scalar tensor `backward()` is called on (`torch.autograd.backward`, which
`Tensor.backward` calls, is wrapped; with gradient accumulation the step's value is the mean of
its backward calls'; a GradScaler'd loss is the scaled one). The gradient norm is what
`torch.nn.utils.clip_grad_norm_` returned in the step when the training clips (the wrapped
function hands the same tensor back), otherwise computed at the optimizer step pre hook from the
optimizer's gradients (a read of every gradient, so sampled by the budget) and summed over the
step's optimizers. Neither changes a value the training computes.

A non-finite loss or gradient norm is an `alert`: the verifier confirms it from the copied value
(it cannot tell a hardware fault from a numerical blow-up: the other sensors' alerts of the steps
before can). A value above its trailing window's median + k·MAD (`SpikeWatcher`) is a `warning`,
never confirmed: losses and gradient norms jump for many honest reasons.

CUDA values are read one step late (copied to the host without a sync at the step's end, read
at the next one), so the guards never synchronise the device; the last step of a CUDA run is not
read. This module knows nothing of the other sensors.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from bitguard.collectors.online.sensor import Alert, Sensor
from bitguard.collectors.recompute import in_backward_pass
from bitguard.cuda.fingerprint import local_values

NAME = "guard"


@dataclass
class SpikeWatcher:
    """Flags a value above median + k·(1.4826·MAD) of the trailing `window` values (or above
    median·(1 + rel) when the window barely moves), and every non-finite value. Upward spikes only:
    a loss falling fast is training, not a fault."""

    window: int = 50  # trailing values the baseline is taken from
    k: float = 10.0  # robust standard deviations above the median
    rel: float = 0.05  # and at least this fraction of the median above it
    min_history: int = 10  # values needed before a spike can be judged

    def __post_init__(self):
        self._values: deque[float] = deque(maxlen=self.window)

    def observe(self, value: float) -> dict | None:
        """A finding for `value` ({"kind": "non_finite" | "spike", ...}) or None; finite values join
        the window."""
        if not math.isfinite(value):
            return {"kind": "non_finite", "value": value}
        finding = None
        if len(self._values) >= self.min_history:
            median = statistics.median(self._values)
            mad = statistics.median(abs(v - median) for v in self._values)
            limit = median + max(self.k * 1.4826 * mad, self.rel * abs(median))
            if value > limit:
                finding = {"kind": "spike", "value": value, "median": median, "mad": mad, "limit": limit}
        self._values.append(value)
        return finding


class _Scalars:
    """One step's scalar tensors of one kind (losses, norms), read on the host without a CUDA sync:
    host values at once, device ones through a pinned copy read at the next step's end."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self._inflight: tuple[int, torch.Tensor, object] | None = None  # (step, host copy, event)

    def add(self, t: torch.Tensor) -> None:
        self.tensors.append(t.detach())

    def take(self, step: int) -> list[tuple[int, list[float]]]:
        """(step, values) ready now: this step's host values, the previous step's device values."""
        ready = []
        if self._inflight is not None:
            at, host, event = self._inflight
            event.synchronize()  # recorded a whole step ago: long done
            ready.append((at, host.tolist()))
            self._inflight = None
        tensors, self.tensors = self.tensors, []
        if not tensors:
            return ready
        if tensors[0].device.type == "cuda":
            with torch.no_grad():
                stacked = torch.stack([t.reshape(()).float() for t in tensors])
                host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._inflight = (step, host, event)
        else:
            ready.append((step, [float(t.reshape(()).float()) for t in tensors]))
        return ready


class GuardSensor(Sensor):
    name = NAME

    def __init__(self, loss: SpikeWatcher | None = None, grad_norm: SpikeWatcher | None = None):
        self.watchers = {"loss": loss or SpikeWatcher(), "grad_norm": grad_norm or SpikeWatcher(k=10.0, rel=0.5)}
        self._values = {"loss": _Scalars(), "grad_norm": _Scalars()}
        self._clipped = False  # clip_grad_norm_ gave this step's norm
        self._computed: list[torch.Tensor] = []  # squared norms computed at the step pre hooks
        self._patched: list[tuple[object, str, object]] = []
        self._handles: list = []
        self._seconds = {"loss": 0.0, "grad_norm": 0.0}
        self._seen = {"loss": 0, "grad_norm": 0}
        self._checked = {"loss": 0, "grad_norm": 0}
        self.monitor = None

    # -- hooks -------------------------------------------------------------------------------------
    def install(self, monitor) -> None:
        self.monitor = monitor
        backward = torch.autograd.backward
        self._patch(torch.autograd, "backward", self._backward_wrapper(backward))
        import torch.nn.utils as nn_utils
        import torch.nn.utils.clip_grad as clip_grad

        clip = nn_utils.clip_grad_norm_
        wrapped = self._clip_wrapper(clip)
        self._patch(nn_utils, "clip_grad_norm_", wrapped)
        if getattr(clip_grad, "clip_grad_norm_", None) is clip:
            self._patch(clip_grad, "clip_grad_norm_", wrapped)
        from torch.optim import optimizer as optim

        self._handles.append(optim.register_optimizer_step_pre_hook(monitor.guard(self._step_pre)))

    def _patch(self, owner, name: str, new) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def remove(self) -> None:
        for owner, name, old in reversed(self._patched):
            setattr(owner, name, old)
        self._patched.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _backward_wrapper(self, backward):
        note = self.monitor.guard(self._note_loss)

        def guarded_backward(tensors, *args, **kwargs):
            note(tensors)
            return backward(tensors, *args, **kwargs)

        guarded_backward.__wrapped__ = backward
        guarded_backward.__doc__ = backward.__doc__
        return guarded_backward

    def _note_loss(self, tensors) -> None:
        if in_backward_pass():  # a backward run inside a backward (reentrant checkpointing): not the loss
            return
        t0 = self.monitor.budget.clock()
        items = tensors if isinstance(tensors, (list, tuple)) else (tensors,)
        for t in items:
            if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point():
                self._seen["loss"] += 1
                if self.monitor.budget.allow(NAME, "loss"):
                    self._checked["loss"] += 1
                    self._values["loss"].add(local_values(t))
        self._charge("loss", t0)

    def _clip_wrapper(self, clip):
        note = self.monitor.guard(self._note_norm)

        def guarded_clip_grad_norm_(*args, **kwargs):
            total = clip(*args, **kwargs)
            note(total)
            return total

        guarded_clip_grad_norm_.__wrapped__ = clip
        guarded_clip_grad_norm_.__doc__ = clip.__doc__
        return guarded_clip_grad_norm_

    def _note_norm(self, total) -> None:
        if isinstance(total, torch.Tensor) and total.numel() == 1:
            t0 = self.monitor.budget.clock()
            self._clipped = True
            self._computed.clear()
            self._seen["grad_norm"] += 1
            self._checked["grad_norm"] += 1
            self.monitor.budget.allow(NAME, "grad_norm")  # counted as seen; the norm cost nothing more
            self._values["grad_norm"].add(total)
            self._charge("grad_norm", t0)

    def _step_pre(self, optimizer, args, kwargs) -> None:
        if self._clipped:
            return
        t0 = self.monitor.budget.clock()
        grads = [local_values(p.grad) for g in optimizer.param_groups for p in g["params"]
                 if isinstance(p.grad, torch.Tensor) and p.grad.layout == torch.strided]
        if not grads:
            return
        self._seen["grad_norm"] += 1
        if not self.monitor.budget.allow(NAME, "grad_norm", flops=2.0 * sum(g.numel() for g in grads)):
            return
        with torch.no_grad():
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for g in grads:
                by_device.setdefault(g.device, []).append(g)
            for device, group in by_device.items():
                norms = torch._foreach_norm(group, 2.0)
                self._computed.append(torch.stack([n.double() for n in norms]).square().sum())
        self._checked["grad_norm"] += 1
        self._charge("grad_norm", t0, flops=2.0 * sum(g.numel() for g in grads))

    def _charge(self, what: str, t0: float, flops: float = 0.0) -> None:
        seconds = self.monitor.budget.clock() - t0
        self._seconds[what] += seconds
        self.monitor.budget.charge(NAME, what, seconds, flops)

    # -- step end --------------------------------------------------------------------------------
    def on_step_end(self, step: int) -> None:
        t0 = self.monitor.budget.clock()
        if self._computed:
            with torch.no_grad():
                total = self._computed[0]
                for c in self._computed[1:]:
                    total = total + c.to(total.device)
                self._values["grad_norm"].add(total.sqrt())
        self._computed.clear()
        self._clipped = False
        for what in ("loss", "grad_norm"):
            for at, values in self._values[what].take(step):
                value = sum(values) / len(values)
                self._judge(what, at, value, values)
        self._charge("loss", t0)

    def _judge(self, what: str, step: int, value: float, values: list[float]) -> None:
        finding = self.watchers[what].observe(value)
        if finding is None:
            return
        label = "loss" if what == "loss" else "gradient norm"
        evidence = {**finding, "step": step, "values": values[:16]}
        if finding["kind"] == "non_finite":
            evidence["summary"] = f"{label} {value} is not finite"
            self.monitor.raise_alert(Alert(NAME, what, what, "alert", evidence), payload={"values": list(values)})
        else:
            evidence["summary"] = (f"{label} {value:.4g} > {finding['limit']:.4g} (median {finding['median']:.4g} "
                                   f"of the last {self.watchers[what].window} steps + k·MAD)")
            self.monitor.raise_alert(Alert(NAME, what, what, "warning", evidence, threshold=finding["limit"]))

    def verify(self, task) -> tuple[str, dict]:
        """A non-finite value is what the training computed (it was read from the tensor backward()
        or the optimizer used): confirmed, with what a guard cannot know."""
        bad = [v for v in task.payload["values"] if not math.isfinite(v)]
        return "confirmed", {"summary": f"{task.alert.boundary} was not finite ({bad[0] if bad else '?'})",
                             "note": "a guard cannot tell a hardware fault from a numerical blow-up (learning rate, "
                                     "overflow): the checksum, recompute and cross-rank alerts of the steps before "
                                     "this one can"}

    def stats(self) -> list[dict]:
        rows = []
        for what in ("loss", "grad_norm"):
            rows.append({"sensor": NAME, "op": what, "calls": self._seen[what], "checked": self._checked[what],
                         "rate": self.monitor.budget.op(NAME, what).rate, "seconds": self._seconds[what],
                         "flops_seen": 0.0, "flops_checked": 0.0, "threshold": None})
            self._seen[what] = self._checked[what] = 0
            self._seconds[what] = 0.0
        return rows

    def coverage(self) -> dict:
        return {"sees": "the loss backward() is called on; the gradient norm clip_grad_norm_ returns, or the "
                        "optimizers' gradients' norm when sampled",
                "not": "what the values are made of: a wrong value that stays finite and within the trailing "
                       "window's spread passes"}
