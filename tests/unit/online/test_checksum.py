"""The checksum sensor: quiet on clean training, catches a corrupted Linear output (the SDC
simulator's bit flip) in the step it happens, names its rows, and its threshold adapts as AEGIS
§5.1.3 says (learned from clean gaps, doubled on a spike or a false alarm, halved back per step)."""

import duckdb
import pytest
import torch

from bitguard.collectors.online.checksum import MARGIN, WARMUP, ChecksumSensor, hard_bound
from bitguard.collectors.online.monitor import OnlineMonitor
from bitguard.collectors.online.sensor import Task
from bitguard.collectors.online.simulator import Simulator, Spec
from bitguard.collectors.store import RankStore
from online_tiny import build, train


def _monitored(tmp_path, simulator=None):
    store = RankStore(str(tmp_path / "rank-0.duckdb"), {"rank": 0, "world_size": 1, "mode": "online"})
    sensor = ChecksumSensor()
    monitor = OnlineMonitor(store, budget=1.0, sensors=[sensor], simulator=simulator, verifier_thread=False)
    return store, sensor, monitor


def test_a_flipped_exponent_bit_is_caught_in_its_step_and_confirmed(tmp_path):
    simulator = Simulator(Spec(module="blocks.1.mlp.fc", bit=28, from_step=3, rows=1), tmp_path / "inj.jsonl")
    store, sensor, monitor = _monitored(tmp_path, simulator)
    monitor.install()
    model, opt, data = build()
    try:
        train(model, opt, data, 5)
        while monitor.verifier.run_one():
            pass
    finally:
        monitor.remove()
        store.close("complete")
    injected = [__import__("json").loads(line) for line in (tmp_path / "inj.jsonl").read_text().splitlines()]
    assert [r["step"] for r in injected] == [3, 4] and all(r["bit"] == 28 for r in injected)
    con = duckdb.connect(str(tmp_path / "rank-0.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT alert_id, step, boundary, op, state, json_extract(evidence, '$.rows')::VARCHAR "
                           "FROM alerts ORDER BY t_ns").fetchall()
    finally:
        con.close()
    raised = [r for r in rows if r[4] == "pending"]
    assert [(r[1], r[2], r[3]) for r in raised] == [(3, "blocks.1.mlp.fc", "linear"), (4, "blocks.1.mlp.fc", "linear")], \
        "exactly the corrupted operator, in the steps it was corrupted (its backward GEMMs are right)"
    assert [r[5] for r in raised] == [f"[{r['row']}]" for r in injected], "the alert names the corrupted row"
    verdicts = {r[0]: r[4] for r in rows if r[4] != "pending"}
    assert set(verdicts.values()) == {"confirmed"} and len(verdicts) == 2


class _FakeMonitor:
    step = 0
    enabled = True

    def __init__(self):
        self.raised = []

    def raise_alert(self, alert, payload=None):
        self.raised.append((alert, payload))
        return len(self.raised) - 1


def _judge(sensor, state, gap):
    gaps = torch.tensor([gap], dtype=torch.float64)
    sensor._judge(state, "linear:m", gap, gap, gaps, 0, 1, 0, lambda rows: {"rows_copied": rows})


def test_the_threshold_is_learned_doubles_on_a_spike_and_halves_back():
    sensor, monitor = ChecksumSensor(), _FakeMonitor()
    sensor.monitor = monitor
    state = sensor._state("linear:m", "m", "linear")
    state.bound = hard_bound(64, torch.float32, torch.device("cpu"))
    assert state.threshold() == state.bound, "before WARMUP clean checks only the rounding bound alerts"
    for _ in range(WARMUP):
        _judge(sensor, state, 1e-9)
    assert state.threshold() == pytest.approx(MARGIN * 1e-9)
    _judge(sensor, state, 1e-7)  # a spike: alert, threshold doubled
    assert len(monitor.raised) == 1 and monitor.raised[0][0].threshold == pytest.approx(MARGIN * 1e-9)
    assert monitor.raised[0][1] == {"kind": "linear", "rows_copied": [0], "rows": [0]}
    assert state.threshold() == pytest.approx(2 * MARGIN * 1e-9)
    _judge(sensor, state, 1e-7)  # once per operator per step
    assert len(monitor.raised) == 1
    sensor.on_step_end(0)
    assert state.threshold() == pytest.approx(MARGIN * 1e-9), "halved back at the step's end"
    monitor.step = 1
    task = Task(0, 0, sensor, None, 0.0, monitor.raised[0][0])
    sensor.on_verdict(task, "cleared")  # a false alarm: doubled, and its gap is clean now
    assert state.threshold() == pytest.approx(2 * MARGIN * 1e-7)
    sensor.on_step_end(1)
    assert state.threshold() == pytest.approx(MARGIN * 1e-7)
    state.learn(1e-3, 1e-3)
    assert state.threshold() == state.bound, "never above what rounding alone can reach"
    _judge(sensor, state, float("nan"))  # a NaN is over any threshold
    assert len(monitor.raised) == 2


def test_clean_gaps_stay_far_below_the_rounding_bound_and_scale_free():
    """The normalised gap of a clean float32 Linear is rounding-sized, whatever the scale of its inputs."""
    torch.manual_seed(0)
    for scale in (1e-3, 1.0, 1e3):
        lin = torch.nn.Linear(256, 512)
        x = torch.randn(64, 256) * scale
        y = lin(x).detach()
        c = lin.weight.detach().double().sum(0)
        gap = (y.double().sum(1) - (x.double() @ c + lin.bias.double().sum())).abs() / (
            x.double().abs() @ lin.weight.detach().double().abs().sum(0) + lin.bias.double().abs().sum())
        assert gap.max() < hard_bound(256, torch.float32, torch.device("cpu")) / 10, (scale, float(gap.max()))
        assert gap.max() > 0


def test_a_linear_subclass_with_its_own_forward_is_not_checked(tmp_path):
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2  # not x·Wᵀ + b: a checksum of it would be a false alarm

    store, sensor, monitor = _monitored(tmp_path)
    monitor.install()
    try:
        m = Scaled(8, 4)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            m(torch.randn(5, 8)).sum().backward()
            opt.step()
    finally:
        monitor.remove()
        store.close("complete")
    assert monitor.alerts_raised == 0
    assert {k for k in sensor.ops if k.startswith("linear:")} == {"linear:Scaled"}, "its inner Linear.forward is"
