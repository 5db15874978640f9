"""The checksum sensor: quiet on clean training, catches a corrupted Linear output (the SDC
simulator's bit flip) in the step it happens, names its element, and its threshold adapts as AEGIS
§5.1.3 says (learned from clean gaps, doubled on a spike or a false alarm, halved back per step).
A checked call covers every element of its output (column sums): a single wrong element anywhere,
forward or backward, is caught; clean calls of float32, bfloat16 and float16 stay under the
threshold."""

import math

import numpy as np
import duckdb
import pytest
import torch

from bitguard.collectors.online.budget import Budget
from bitguard.collectors.online.checksum import (MARGIN, WARMUP, ChecksumSensor, column_bound, column_gaps, hard_bound,
                                                 verify_gemm)
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

    def __init__(self, budget=1.0):
        self.raised = []
        self.budget = Budget(budget)

    def raise_alert(self, alert, payload=None):
        self.raised.append((alert, payload))
        return len(self.raised) - 1

    def module_name(self, module):
        return "m"

    def guard(self, fn):
        return fn


_ONE = torch.ones(1, 1, dtype=torch.float64)


def _judge(sensor, state, gap):
    gaps = np.array([gap])
    sensor._judge(state, "linear:m", gap, gap, gaps, 0, (_ONE, _ONE, _ONE, None, False))


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
    payload = monitor.raised[0][1]
    assert payload["kind"] == "linear" and payload["rows"] == payload["columns"] == [0]
    assert monitor.raised[0][0].evidence["elements"] == [[0, 0]]
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
    state.learn(1e-3)
    assert state.threshold() == state.bound, "never above what rounding alone can reach"
    _judge(sensor, state, float("nan"))  # a NaN is over any threshold
    assert len(monitor.raised) == 2


def test_clean_gaps_stay_far_below_the_rounding_bound_and_scale_free():
    """The normalised column gap of a clean Linear is rounding-sized, whatever the scale of its inputs."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for scale in (1e-2, 1.0, 1e2):
            lin = torch.nn.Linear(256, 512).to(dtype)
            x = (torch.randn(64, 256) * scale).to(dtype)
            y = lin(x).detach()
            gaps, raw, _ = column_gaps(y, x, lin.weight.detach().T, lin.bias.detach())
            # (float32 is summed in float64 on the host: the bound of those sums, the GEMM's own rounding, holds too)
            sums = torch.float64 if dtype == torch.float32 else None
            bound = column_bound(64, 256, dtype, torch.device("cpu"), sums)
            assert 0 < gaps.max() < bound / 10, (dtype, scale, float(gaps.max()), bound)



def test_the_fused_host_pass_gives_torchs_sums_for_every_layout_and_falls_back_elsewhere():
    """cpu_checksum's one pass per operand gives the torch ops' lhs, rhs and scale (to float32
    rounding of torch's own sums) for the three GEMMs' layouts, float32 and float64; a strided or
    16-bit operand is left to torch."""
    from bitguard.collectors.online import checksum, cpu_checksum

    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        x, w, g = (torch.randn(*s, generator=gen, dtype=dtype) for s in ((48, 32), (24, 32), (48, 24)))
        bias = torch.randn(24, generator=gen, dtype=dtype)
        cases = [(x @ w.T + bias, x, w.T, bias), ((g @ w), g, w, None), ((x.T @ g).T, g.T, x, None)]
        for c, a, b, bias_ in cases:
            views = cpu_checksum.host_operands(c, a, b, bias_)
            assert views is not None
            got = cpu_checksum.column_sums(views, bias_)
            want = [t.numpy() for t in checksum._torch_sums(c, a, b, bias_)]
            for mine, theirs in zip(got, want):
                assert np.allclose(mine, theirs, rtol=1e-5, atol=1e-5 * float(np.abs(theirs).max())), (dtype, mine, theirs)
    y = torch.randn(8, 6)
    assert cpu_checksum.host_operands(y[:, ::2], torch.randn(8, 4), torch.randn(4, 3), None) is None
    assert cpu_checksum.host_operands(y.bfloat16(), torch.randn(8, 4).bfloat16(), torch.randn(4, 6).bfloat16(), None) is None
    gaps, _, _ = column_gaps(y[:, ::2], y[:, :4], torch.eye(4)[:, :3], None)  # (the torch path: not a product)
    assert gaps.shape == (3,)

def _linear_calls(sensor, lin, shape, dtype, n, corrupt=None, seed=0):
    """n calls of lin on fresh inputs through the sensor's forward check; corrupt(y) on the last."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        x = torch.randn(*shape, lin.in_features, generator=gen).to(dtype)
        with torch.no_grad():
            y = lin(x)
        if corrupt is not None and i == n - 1:
            corrupt(y.view(-1, lin.out_features))
        sensor._on_linear(lin, x, y)


_SHAPES = [((64,), 32, 48), ((4, 16), 128, 96), ((3, 5, 7), 200, 24), ((256,), 16, 300)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_clean_calls_across_shapes_stay_under_the_threshold(dtype):
    for shape, k, o in _SHAPES:
        sensor, monitor = ChecksumSensor(), _FakeMonitor()
        sensor.monitor = monitor
        torch.manual_seed(1)
        lin = torch.nn.Linear(k, o).to(dtype)
        _linear_calls(sensor, lin, shape, dtype, 60)
        state = sensor.ops["linear:m"]
        assert state.checks == 60 and not monitor.raised, (shape, dtype, [a.evidence for a, _ in monitor.raised])
        assert state.threshold() < state.bound / 4, "the learned threshold is well below the hard bound"


@pytest.mark.parametrize("dtype,bits", [(torch.float32, (31, 30, 22, 20)), (torch.bfloat16, (15, 14)),
                                        (torch.float16, (15, 14, 9))])
def test_a_single_wrong_element_anywhere_is_caught_and_named(dtype, bits):
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    gen = torch.Generator().manual_seed(7)
    for shape, k, o in _SHAPES:
        torch.manual_seed(2)
        lin = torch.nn.Linear(k, o).to(dtype)
        n = math.prod(shape)
        for bit in bits:
            sensor, monitor = ChecksumSensor(), _FakeMonitor()
            sensor.monitor = monitor
            _linear_calls(sensor, lin, shape, dtype, WARMUP + 4)  # learn
            i, j = int(torch.randint(n, (), generator=gen)), int(torch.randint(o, (), generator=gen))
            hit = []

            def corrupt(y2):
                if bit == 14 or bit == 30:  # an exponent bit that makes the element larger (or inf/NaN)
                    y2.view(ints)[i, j] |= 1 << bit
                else:
                    y2.view(ints)[i, j] ^= (1 << bit) - (1 << (bit + 1) if bit in (15, 31) else 0)
                hit.append(float(y2[i, j]))

            while True:  # a sign flip of an element that rounds to zero changes nothing: take the next call
                _linear_calls(sensor, lin, shape, dtype, 1, corrupt, seed=len(hit) + 100)
                if monitor.raised or len(hit) > 3:
                    break
            assert monitor.raised, (shape, dtype, bit, hit)
            alert, payload = monitor.raised[0]
            assert [i, j] in alert.evidence["elements"], (alert.evidence, i, j)
            state, evidence = verify_gemm(payload)
            assert state == "confirmed" and evidence["worst"] == [i, j], evidence


def test_the_backward_gemms_are_checked_whole_and_name_the_element_in_the_ops_layout():
    sensor, monitor = ChecksumSensor(), _FakeMonitor()
    sensor.monitor = monitor
    torch.manual_seed(3)
    n, k, o = 40, 24, 56
    w = torch.randn(o, k)
    for step in range(WARMUP + 3):
        x, g = torch.randn(n, k), torch.randn(n, o)
        dx, dwt = g @ w, x.T @ g
        if step == WARMUP + 2:
            dx[17, 5] *= -1
            dwt[3, 50] *= 1.5  # dW[50, 3]
        monitor.step = step
        sensor._on_backward("m", dx, dwt, g, x, w, 0)
    assert [a.op for a, _ in monitor.raised] == ["linear.dgrad", "linear.wgrad"]
    (dgrad, p1), (wgrad, p2) = monitor.raised
    assert dgrad.evidence["elements"] == [[17, 5]] and wgrad.evidence["elements"] == [[50, 3]]
    assert wgrad.evidence["shape"] == [o, k], "dW in the weight's layout"
    assert verify_gemm(p1)[1]["worst"] == [17, 5] and verify_gemm(p2)[1]["worst"] == [50, 3]
    assert verify_gemm(p1)[0] == verify_gemm(p2)[0] == "confirmed"


def test_call_sampling_checks_the_budgets_share_of_calls_each_whole():
    sensor, monitor = ChecksumSensor(), _FakeMonitor(budget=0.02)
    sensor.monitor = monitor
    monitor.budget.op("checksum", "linear:m").rate = 0.25
    lin = torch.nn.Linear(16, 8)
    _linear_calls(sensor, lin, (10,), torch.float32, 800)
    sensor.stats()  # (the calls a countdown passed are counted when the step's rows are made, before the budget reads them)
    entry = monitor.budget.op("checksum", "linear:m")
    assert entry.calls == 800 and 150 < entry.checked < 250
    assert sensor.ops["linear:m"].checks == entry.checked
    assert entry.flops_checked == pytest.approx(entry.checked * 2 * 10 * 16 * 8), "a checked call is checked whole"


def test_a_rate_raised_takes_effect_at_once_not_after_the_old_countdown():
    """A call that no countdown has due reads nothing; when the rates change at a step's end the
    countdowns left are rescaled: an operator raised from MIN_RATE to 0.5 is checked on about half
    its next calls, not after the ~1,000 calls its old countdown had to pass."""
    from bitguard.collectors.online.budget import MIN_RATE

    sensor, monitor = ChecksumSensor(), _FakeMonitor(budget=0.02)
    sensor.monitor = monitor
    entry = monitor.budget.op("checksum", "linear:m")
    entry.rate = MIN_RATE
    lin = torch.nn.Linear(16, 8)
    _linear_calls(sensor, lin, (10,), torch.float32, 40)
    sensor.stats()
    before = entry.checked
    entry.rate = 0.5
    monitor.budget.epoch += 1  # (what Budget.step_end does when it sets the rates)
    _linear_calls(sensor, lin, (10,), torch.float32, 400, seed=1)
    sensor.stats()
    assert entry.calls == 440
    assert 160 < entry.checked - before < 240, entry.checked - before
    assert sensor.ops["linear:m"].checks == entry.checked


def test_a_gemm_call_site_is_sampled_at_its_rate_and_counts_every_call():
    """A functional GEMM's call site counts down to its next checked call as an nn.Linear does: at
    a rate of 0.25 about a quarter of its calls are checked, whole, and every call is counted."""
    sensor, monitor = ChecksumSensor(), _FakeMonitor(budget=0.02)
    sensor.monitor = monitor
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(12, 16, generator=gen), torch.randn(16, 8, generator=gen)
    sensor.install_gemms(monitor)
    try:
        for i in range(800):
            if i == 1:  # (the site's first call made its budget entries; its rate set as a step's end would)
                (entry,) = [e for (_, key), e in monitor.budget.ops.items() if key.startswith("matmul:")]
                entry.rate = 0.25
                monitor.budget.epoch += 1
            torch.matmul(a, b)
    finally:
        sensor.remove_gemms()
    sensor.stats()
    assert entry.calls == 800 and 150 < entry.checked < 250, entry.checked
    (key,) = [key for key in sensor.ops if key.startswith("matmul:")]
    assert sensor.ops[key].checks == entry.checked
    assert entry.flops_checked == pytest.approx(entry.checked * 2 * 12 * 16 * 8), "a checked call is checked whole"


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


def test_an_alerts_localisation_is_charged_apart_from_the_operators_checks():
    """An operator that keeps alerting must not be sampled less for its alerts' cost."""
    sensor, monitor = ChecksumSensor(), _FakeMonitor()
    sensor.monitor = monitor
    torch.manual_seed(4)
    lin = torch.nn.Linear(64, 32)
    _linear_calls(sensor, lin, (128,), torch.float32, WARMUP + 2)
    fixed = monitor.budget.fixed_s  # (the hook's own time around its checks: fixed cost too)

    def corrupt(y2):
        y2[5, 7] = -y2[5, 7] + 1.0

    _linear_calls(sensor, lin, (128,), torch.float32, 1, corrupt, seed=9)
    assert monitor.raised and sensor._alert_s > 0
    assert monitor.budget.fixed_s - fixed >= sensor._alert_s, "the alert's time went to the fixed costs"


def test_a_fault_present_during_warm_up_does_not_lift_the_threshold_above_itself():
    """A wrong element below the hard bound, on every call from the third on: not learned as clean
    during warm-up, so the learned threshold catches it once warm-up ends."""
    sensor, monitor = ChecksumSensor(), _FakeMonitor()
    sensor.monitor = monitor
    torch.manual_seed(5)
    lin = torch.nn.Linear(256, 128)
    _linear_calls(sensor, lin, (512,), torch.float32, 2)
    state = sensor.ops["linear:m"]
    gaps = []

    def corrupt(y2):
        y2[100, 3] = y2[100, 3] * 1.01 + 1e-3  # (small: under the hard bound of a 512-row column sum)

    for i in range(WARMUP + 2):
        _linear_calls(sensor, lin, (512,), torch.float32, 1, corrupt, seed=50 + i)
        gaps.append(monitor.raised[-1][0].evidence["elements"] if monitor.raised else None)
        if monitor.raised:
            break
    assert state.rejected > 0, "the faulty warm-up gaps were not learned"
    assert monitor.raised, "caught once the learned threshold replaced the hard bound"
    assert state.checks >= WARMUP and [100, 3] in monitor.raised[0][0].evidence["elements"]
    assert max(state.clean) < monitor.raised[0][0].evidence["gap"] / MARGIN


def test_under_autocast_the_cast_product_is_checked_and_clean_calls_raise_nothing(tmp_path):
    store, sensor, monitor = _monitored(tmp_path)
    monitor.install()
    try:
        torch.manual_seed(6)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(WARMUP + 3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(torch.randn(128, 64))
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        monitor.remove()
        store.close("complete")
    assert monitor.alerts_raised == 0
    assert {s.op for s in sensor.ops.values() if s.checks} == {"linear", "linear.dgrad", "linear.wgrad"}
    assert all(s.threshold() < s.bound for s in sensor.ops.values() if s.checks >= WARMUP)


def test_under_autocast_a_false_alarm_is_cleared_not_confirmed(monkeypatch):
    """The evidence is the product autocast ran (the operands cast to bfloat16): a clean output
    recomputes within the rounding bound (with the float32 operands it would look wrong)."""
    from bitguard.collectors.online.checksum import OpState

    monkeypatch.setattr(OpState, "threshold", lambda self: 0.0)  # every check alerts
    sensor, monitor = ChecksumSensor(), _FakeMonitor()
    sensor.monitor = monitor
    torch.manual_seed(7)
    lin = torch.nn.Linear(256, 64)
    x = torch.randn(96, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    sensor._on_linear(lin, x, y.detach())
    assert monitor.raised
    state, evidence = verify_gemm(monitor.raised[0][1])
    assert state == "cleared", evidence


class _NamedMonitor(_FakeMonitor):
    """A fake monitor naming each module apart (the pool needs two operators)."""

    def __init__(self, budget=1.0):
        super().__init__(budget)
        self.names = {}

    def module_name(self, module):
        return self.names.setdefault(id(module), f"m{len(self.names)}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_operators_of_many_shapes_in_warm_up_judged_by_their_pool_raise_nothing_on_clean_calls(dtype):
    """The pool's threshold is shared by operators of any shape: one call each in turn, the way a model's
    Linears are checked at a low rate, and none is over it while each is still in its warm-up."""
    sensor, monitor = ChecksumSensor(), _NamedMonitor()
    sensor.monitor = monitor
    torch.manual_seed(3)
    lins = [(torch.nn.Linear(k, o).to(dtype), shape) for shape, k, o in _SHAPES]
    for round_ in range(WARMUP - 1):
        for n, (lin, shape) in enumerate(lins):
            _linear_calls(sensor, lin, shape, dtype, 1, seed=100 * round_ + n)
    states = [sensor.ops[f"linear:m{n}"] for n in range(len(lins))]
    assert all(s.checks < WARMUP for s in states) and {s.source() for s in states} == {"pool"}
    assert monitor.raised == []


def test_an_operator_in_warm_up_is_judged_by_its_pool_so_a_fault_under_the_hard_bound_on_its_first_check_is_caught():
    """Without the pool, a rarely checked operator is judged by the hard bound alone for its first WARMUP
    checks (hundreds of steps at a low rate): a wrong element under it went through."""
    sensor, monitor = ChecksumSensor(), _NamedMonitor()
    sensor.monitor = monitor
    torch.manual_seed(5)
    others = [torch.nn.Linear(256, 128) for _ in range(3)]
    for i in range(6):
        for lin in others:
            _linear_calls(sensor, lin, (512,), torch.float32, 1, seed=10 * i + len(monitor.names))
    assert sensor.ops["linear:m0"].pool.threshold() is not None and monitor.raised == []
    fresh = torch.nn.Linear(256, 128)

    def corrupt(y2):
        y2[100, 3] = y2[100, 3] * 1.01 + 1e-3  # under the hard bound of a 512-row column sum

    _linear_calls(sensor, fresh, (512,), torch.float32, 1, corrupt, seed=99)
    state = sensor.ops["linear:m3"]
    assert state.checks == 1 and 1e-3 / 512 < state.bound, "the fault is under the hard bound"
    assert len(monitor.raised) == 1, "caught on the operator's first check"
    alert = monitor.raised[0][0]
    assert alert.evidence["threshold_source"] == "pool" and [100, 3] in alert.evidence["elements"]
    assert alert.threshold < state.bound / 100


def test_a_pool_judges_only_once_it_holds_enough_from_two_operators_and_dtypes_have_their_own():
    sensor, monitor = ChecksumSensor(), _NamedMonitor()
    sensor.monitor = monitor
    torch.manual_seed(7)
    one = torch.nn.Linear(64, 32)
    _linear_calls(sensor, one, (128,), torch.float32, 2 * WARMUP)
    assert sensor.ops["linear:m0"].pool.threshold() is None, "one operator alone makes no pool threshold"
    two = torch.nn.Linear(64, 32)
    _linear_calls(sensor, two, (128,), torch.float32, 1)
    assert sensor.ops["linear:m1"].source() == "pool"
    half = torch.nn.Linear(64, 32).to(torch.bfloat16)
    _linear_calls(sensor, half, (128,), torch.bfloat16, 1)
    state = sensor.ops["linear:m2"]
    assert state.pool is not sensor.ops["linear:m0"].pool and state.source() == "hard bound"
