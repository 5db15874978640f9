"""Guards on the loss and the gradient norm, in-process: the spike watcher's baseline, a clean run
raising nothing and leaving the training bitwise, a non-finite loss confirmed on its step, a
gradient-norm spike a warning (from clip_grad_norm_'s value, or computed when the training does
not clip)."""

import io
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bitguard.collectors.online.guards import GuardSensor, SpikeWatcher
from bitguard.collectors.online.monitor import OnlineMonitor


def test_spike_watcher_flags_upward_spikes_over_median_plus_k_mad():
    w = SpikeWatcher(window=20, k=10.0, rel=0.05, min_history=5)
    assert [w.observe(v) for v in (3.0, 2.9, 2.8, 2.7)] == [None] * 4, "too little history to judge"
    assert w.observe(2.6) is None
    assert w.observe(0.1) is None, "a loss falling fast is training, not a fault"
    spike = w.observe(30.0)
    assert spike["kind"] == "spike" and spike["median"] == pytest.approx(2.75) and spike["limit"] < 30.0
    assert w.observe(2.95) is None, "within the window's spread"
    assert w.observe(float("nan"))["kind"] == "non_finite" and w.observe(float("inf"))["kind"] == "non_finite"


def test_spike_watcher_has_a_relative_floor_when_the_window_does_not_move():
    w = SpikeWatcher(window=10, k=10.0, rel=0.05, min_history=3)
    for _ in range(5):
        w.observe(1.0)
    assert w.observe(1.04) is None, "MAD 0: within 5% of the median is not a spike"
    assert w.observe(1.06)["kind"] == "spike"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def train(monitor=None, steps=12, clip=False, poison=None, boost=None):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)
    norms = []
    if monitor is not None:
        monitor.install()
    try:
        for step in range(steps):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            if boost is not None and step == boost:
                y = y * 1e3  # a step whose gradients are huge
            opt.zero_grad()
            loss = F.mse_loss(net(x), y)
            if poison is not None and step == poison:
                loss = loss * float("nan")
            loss.backward()
            if clip:
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9)))
            opt.step()
    finally:
        if monitor is not None:
            monitor.remove()
    return [p.detach().clone() for p in net.parameters()], norms


def monitored():
    out = io.StringIO()
    sensor = GuardSensor()
    rows = []
    stats = sensor.stats
    sensor.stats = lambda: rows.extend(stats()) or rows[-2:]
    # a clock that stands still: no step has a duration, so the budget keeps every rate at 1 (checks all)
    monitor = OnlineMonitor(None, budget=1.0, sensors=[sensor], clock=lambda: 0.0, verifier_thread=False, out=out)
    return monitor, sensor, out, rows


@pytest.mark.parametrize("clip", [False, True])
def test_a_clean_run_raises_nothing_and_trains_bitwise(clip):
    plain, plain_norms = train(clip=clip)
    monitor, sensor, out, rows = monitored()
    watched, norms = train(monitor, clip=clip)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    assert norms == plain_norms, "clip_grad_norm_ returns what it returns unwatched"
    assert monitor.alerts_raised == 0, out.getvalue()
    loss = [r for r in rows if r["op"] == "loss"]
    norm = [r for r in rows if r["op"] == "grad_norm"]
    assert [r["checked"] for r in loss] == [1] * 12 and [r["checked"] for r in norm] == [1] * 12
    assert monitor.steps_seen() == 12


def test_a_non_finite_loss_is_an_alert_confirmed_on_its_step():
    monitor, sensor, out, rows = monitored()
    train(monitor, poison=7)
    lines = out.getvalue().splitlines()
    assert "online alert #0 step 7 rank 0 guard loss (loss): loss nan is not finite — pending" in lines[0]
    assert monitor.states[0] == "confirmed" and "a guard cannot tell a hardware fault" not in lines[1]
    # the non-finite loss made every weight NaN: the later gradient norms are not finite either
    assert {monitor.states[i] for i in monitor.states} == {"confirmed"}


@pytest.mark.parametrize("clip", [False, True])
def test_a_gradient_norm_spike_is_a_warning(clip):
    monitor, sensor, out, rows = monitored()
    _, norms = train(monitor, clip=clip, boost=11)
    raised = [line for line in out.getvalue().splitlines() if "guard grad_norm" in line]
    assert len(raised) == 1 and "step 11" in raised[0] and raised[0].endswith("— warning"), out.getvalue()
    if clip:
        spike = next(v for v in [norms[11]])
        assert f"{spike:.4g}" in raised[0], "the value clip_grad_norm_ returned"
    assert all(math.isfinite(n) for n in norms)
