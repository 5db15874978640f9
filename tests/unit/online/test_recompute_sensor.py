"""The deterministic-recompute sensor in-process, on a tiny model whose blocks run under
torch.utils.checkpoint: a clean run raises nothing and leaves the training bitwise; a bit flipped
only in a recompute is an alert on its step that the verifier confirms (the re-runs reproduce the
forward); a flip in the forward is confirmed the other way; a region that does not restore the
RNG state is not compared."""

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bitguard.collectors.online.monitor import OnlineMonitor
from bitguard.collectors.online.recompute_sensor import RecomputeSensor

STEPS = 4


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(F.gelu(self.fc(self.ln(x))))


class Net(nn.Module):
    def __init__(self, reentrant=False, preserve_rng=True, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 32)
        self.reentrant, self.preserve_rng = reentrant, preserve_rng

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant, preserve_rng_state=self.preserve_rng)
        return self.head(x)


class FaultyLinear(nn.Linear):
    """A Linear whose forward flips bit 9 of its output's first element when its `fault` says so (as a
    faulty device computes a wrong value inside the op)."""

    fault = None

    def forward(self, x):
        out = super().forward(x)
        if self.fault is not None and self.fault.now_wrong():
            out.view(-1).view(torch.int32)[0] ^= 1 << 9
        return out


class Flip:
    """Makes blocks.1.fc wrong once, at step `step`, in its recompute (during backward) or its forward:
    an intermittent fault (the verifier's re-runs at the step's end compute right)."""

    def __init__(self, net, step, where="recompute"):
        self.step, self.where, self.now, self.fired = step, where, 0, False
        fc = net.blocks[1].fc
        fc.__class__ = FaultyLinear
        fc.fault = self

    def now_wrong(self) -> bool:
        in_backward = torch._C._current_graph_task_id() != -1
        if self.fired or self.now != self.step or in_backward != (self.where == "recompute"):
            return False
        self.fired = True
        return True


def train(net, monitor=None, steps=STEPS, fault=None):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    if monitor is not None:
        monitor.install()
    try:
        for step in range(steps):
            if fault is not None:
                fault.now = step
            idx = torch.randint(0, 32, (4, 8), generator=gen)
            opt.zero_grad()
            loss = F.cross_entropy(net(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            opt.step()
    finally:
        if monitor is not None:
            monitor.remove()
    return [p.detach().clone() for p in net.parameters()]


def monitored(thread=False):
    out = io.StringIO()
    sensor = RecomputeSensor()
    # a clock that stands still: no step has a duration, so the budget keeps every rate at 1 (checks all)
    monitor = OnlineMonitor(None, budget=1.0, sensors=[sensor], clock=lambda: 0.0, verifier_thread=thread, out=out)
    return monitor, sensor, out


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_clean_run_raises_nothing_and_trains_bitwise(reentrant):
    plain = train(Net(reentrant))
    monitor, sensor, out = monitored()
    rows = []
    sensor_stats = sensor.stats
    sensor.stats = lambda: rows.extend(sensor_stats()) or rows[-1:]
    watched = train(Net(reentrant), monitor)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched)), "the sensor changed the training"
    assert monitor.alerts_raised == 0, out.getvalue()
    checked = [r["checked"] for r in rows]
    assert checked[0] == 0, "step 0: the roots are learned from its recomputes, nothing to compare yet"
    # each module call of a recompute that completes is compared, from step 1 on: non-reentrant checkpointing
    # stops a recompute once it has rebuilt what backward needs (ln and fc of each block; not the dropout or the
    # block's own output), reentrant checkpointing runs it whole (ln, fc, drop, the block)
    assert checked[1:] == [8 if reentrant else 4] * (STEPS - 1)
    assert sensor.coverage()["roots"] == ["blocks.0", "blocks.1"]


class Plain(Net):
    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_module_hooks_wait_for_the_first_checkpoint(reentrant):
    """A training without activation checkpointing gets no global module hook (every module call would
    take torch's slow path for nothing); the first checkpoint installs them; remove() restores torch."""
    from torch.nn.modules import module as nn_module
    from torch.utils import checkpoint as cp

    before = (cp._checkpoint_hook.__dict__["__init__"], cp.CheckpointFunction.__dict__["backward"])
    hooks = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    monitor, sensor, _ = monitored()
    monitor.install()
    try:
        net = Plain(reentrant)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        idx = torch.randint(0, 32, (4, 8))
        for _ in range(2):
            F.cross_entropy(net(idx).flatten(0, 1), idx.flatten()).backward()
            opt.step()
        assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == hooks
        net.__class__ = Net
        for _ in range(2):
            F.cross_entropy(net(idx).flatten(0, 1), idx.flatten()).backward()
            opt.step()
        assert len(nn_module._global_forward_pre_hooks) == hooks[0] + 1
        assert sensor.coverage()["roots"] == ["blocks.0", "blocks.1"], "the recompute was watched from the first"
    finally:
        monitor.remove()
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == hooks
    assert (cp._checkpoint_hook.__dict__["__init__"], cp.CheckpointFunction.__dict__["backward"]) == before


@pytest.mark.parametrize("thread", [False, True], ids=["at-the-end", "worker-thread"])
def test_a_bit_flipped_in_a_recompute_is_confirmed_on_its_step(thread):
    """(the worker thread takes the task at once and waits for the step's end, where the region is re-run)"""
    monitor, sensor, out = monitored(thread)
    net = Net()
    fault = Flip(net, step=2)
    train(net, monitor, fault=fault)
    assert monitor.alerts_raised == 1, out.getvalue()
    lines = out.getvalue().splitlines()
    assert "online alert #0 step 2 rank 0 recompute blocks.1.fc (recompute)" in lines[0] and "pending" in lines[0]
    assert "confirmed" in lines[1] and monitor.states[0] == "confirmed"
    assert "the recompute during backward computed a wrong value" in lines[1]


def test_a_bit_flipped_in_the_forward_is_confirmed_as_the_forward():
    monitor, sensor, out = monitored()
    net = Net()
    train(net, monitor, fault=Flip(net, step=1, where="forward"))
    assert monitor.states == {0: "confirmed"}, out.getvalue()
    assert "the forward computed a wrong value" in out.getvalue()


def test_a_region_that_draws_other_random_numbers_in_its_recompute_is_not_compared():
    """preserve_rng_state=False: the recompute's dropout masks differ by design, not a fault."""
    monitor, sensor, out = monitored()
    rows = []
    sensor_stats = sensor.stats
    sensor.stats = lambda: rows.extend(sensor_stats()) or rows[-1:]
    train(Net(preserve_rng=False), monitor)
    assert monitor.alerts_raised == 0, out.getvalue()
    assert sum(r["checked"] for r in rows) == 0
