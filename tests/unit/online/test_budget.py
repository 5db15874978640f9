"""The budget controller, driven by a fake clock: the sensors' charged time converges within the
budget, cheap operators get higher rates than dear ones, rates stay in [MIN_RATE, 1], and a rate
is the probability of checking a call (checked whole). The fake clock advances by what a check
charges, so a check costs the step what it times: these budgets are made with marginal=1 (the
factor has its own test)."""

import pytest

from bitguard.collectors.online.budget import DEBT_STEPS, HEADROOM, MARGINAL, MIN_RATE, START_RATE, Budget


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _steps(budget, clock, unit: dict, n: int, train_s: float = 1.0) -> list[float]:
    """n steps: each op is called once and checked (when allowed) at a cost of rate × its unit; the
    training itself takes train_s. The overhead the controller measured each step."""
    seen = []
    for _ in range(n):
        for op, cost in unit.items():
            for _ in range(4):  # four calls a step, each check a quarter of the unit
                if budget.allow("checksum", op):
                    seconds = cost / 4
                    budget.charge("checksum", op, seconds)
                    clock.t += seconds
        clock.t += train_s
        budget.step_end()
        budget.reset()
        seen.append(budget.overhead)
    return seen


def test_the_measured_cost_converges_within_the_budget_cheap_ops_checked_more():
    clock = Clock()
    budget = Budget(0.02, clock, marginal=1.0)
    budget.start()
    unit = {"cheap": 0.004, "dear": 0.1, "mid": 0.02}
    overheads, rates = [], {op: [] for op in unit}
    for _ in range(100):
        overheads += _steps(budget, clock, unit, 1)
        for op in unit:
            rates[op].append(budget.op("checksum", op).rate)
    assert overheads[0] < 0.02, "the first step checks at START_RATE"
    late = overheads[-60:]  # (calls are sampled, and a debt lowers the next steps' rates: the mean is what holds)
    assert 0.02 * HEADROOM * 0.8 <= sum(late) / len(late) <= 0.02, sum(late) / len(late)
    mean = {op: sum(r[-60:]) / 60 for op, r in rates.items()}
    assert sum(r == 1.0 for r in rates["cheap"][-60:]) > 30, "a cheap operator's share is more than it needs"
    assert mean["dear"] < mean["mid"] < mean["cheap"]
    assert all(MIN_RATE <= r <= 1 for r in rates.values() for r in r)


def test_a_generous_budget_checks_everything():
    clock = Clock()
    budget = Budget(0.5, clock)
    budget.start()
    _steps(budget, clock, {"a": 0.01, "b": 0.02}, 8)
    assert budget.op("checksum", "a").rate == budget.op("checksum", "b").rate == 1.0


def test_a_rate_is_the_probability_of_checking_a_call():
    budget = Budget(0.02, Clock())
    assert budget.op("checksum", "x").rate == START_RATE
    budget.op("checksum", "x").rate = 0.25
    allowed = sum(budget.allow("checksum", "x") for _ in range(4000))
    assert 900 < allowed < 1100, allowed  # a quarter of the calls (each checked whole)
    entry = budget.op("checksum", "x")
    assert entry.calls == 4000 and entry.checked == allowed


def test_a_countdown_gives_each_call_the_rates_chance():
    """Budget.countdown: the calls to pass before the next checked one, geometric at the rate (so
    a hook counting down checks each call with the same chance as draw())."""
    budget = Budget(0.02, Clock())
    entry = budget.op("checksum", "x")
    entry.rate = 0.25
    draws = [budget.countdown(entry) for _ in range(8000)]
    assert 0.22 < sum(d == 0 for d in draws) / len(draws) < 0.28, "the next call itself, at the rate"
    assert 2.7 < sum(draws) / len(draws) < 3.3, "(1 - r) / r calls passed on average"
    entry.rate = 1.0
    assert budget.countdown(entry) == 0
    entry.rate = 0.0
    assert budget.countdown(entry) > 10 ** 15


def test_the_unit_cost_counts_the_calls_left_out():
    """Half the calls checked at 1 s each: the operator's cost at rate 1 is 2 s per call pair."""
    clock = Clock()
    budget = Budget(0.02, clock, marginal=1.0)
    budget.start()
    entry = budget.op("checksum", "x")
    entry.calls, entry.checked, entry.seconds, entry.rate = 100, 50, 50.0, 0.5
    clock.t += 1000.0
    budget.step_end()
    assert entry.unit == pytest.approx(100.0)
    earned = HEADROOM * 0.02 * (1000.0 - 50.0)  # the step charged 50 s of it: a debt, repaid in quarters
    assert budget.balance == pytest.approx(earned - 50.0)
    assert entry.rate == pytest.approx((earned + (earned - 50.0) / DEBT_STEPS) / 100.0)


def test_an_overspent_step_is_paid_back_by_the_next_ones():
    """A step that charged three times its allowance lowers the next steps' allowance until the
    debt is repaid; over the steps the charges meet the allowance, not 1.25x it as before."""
    clock = Clock()
    budget = Budget(0.02, clock, marginal=1.0)
    budget.start()
    entry = budget.op("checksum", "x")  # 1000 calls a step, 0.064 s at rate 1
    entry.calls, entry.checked, entry.seconds = 1000, 750, 0.048  # three times 0.8 x 2% of 1 s
    clock.t += 1.048
    budget.step_end()
    assert budget.balance == pytest.approx(-0.032)
    balance, charged = [], []
    for _ in range(16):
        budget.reset()
        entry.calls, entry.checked = 1000, entry.rate * 1000  # the expected number, not a draw
        entry.seconds = entry.rate * 0.064
        charged.append(entry.seconds)
        clock.t += 1.0 + entry.seconds
        budget.step_end()
        balance.append(budget.balance)
    assert charged[0] == pytest.approx(0.016 - 0.032 / DEBT_STEPS), "the next step repays a quarter of the debt"
    assert balance[0] == pytest.approx(-0.024)
    assert balance[-1] == pytest.approx(0.0, abs=1e-3), balance


def test_a_debt_is_capped_and_a_credit_is_one_step():
    """One step slowed a hundredfold by a check (a page fault, a context switch) leaves at most
    DEBT_STEPS steps of debt; steps that charged nothing save at most one step's allowance."""
    clock = Clock()
    budget = Budget(0.02, clock, marginal=1.0)
    budget.start()
    entry = budget.op("checksum", "x")
    entry.calls, entry.checked, entry.seconds = 1, 1, 2.0
    clock.t += 3.0
    budget.step_end()
    assert budget.balance == pytest.approx(-DEBT_STEPS * HEADROOM * 0.02 * 1.0)
    for _ in range(20):
        budget.reset()
        clock.t += 1.0
        budget.step_end()
    assert budget.balance == pytest.approx(HEADROOM * 0.02 * 1.0)


def test_fixed_costs_come_off_the_allowance():
    clock = Clock()
    budget = Budget(0.02, clock, marginal=1.0)
    budget.start()
    _steps(budget, clock, {"a": 0.1}, 8)
    free = budget.op("checksum", "a").rate
    budget.charge_fixed(0.015)  # most of the next step's 2%
    _steps(budget, clock, {"a": 0.1}, 1)
    assert budget.op("checksum", "a").rate < free


def test_a_budget_out_of_range_is_refused():
    for bad in (0, -0.1, 1.5):
        with pytest.raises(ValueError):
            Budget(bad)


def test_a_budget_of_one_is_no_limit():
    clock = Clock()
    budget = Budget(1.0, clock)
    budget.start()
    _steps(budget, clock, {"a": 5.0}, 3)  # five times the step: still everything
    assert budget.op("checksum", "a").rate == 1.0
    assert all(budget.allow("checksum", "a") for _ in range(100))


def test_an_operator_never_checked_is_priced_from_the_measured_ones():
    """Twenty operators whose calls were all sampled out share the allowance at the measured one's
    cost per FLOP; raised blindly (each rate doubled) they would have overspent it."""
    clock = Clock()
    budget = Budget(0.02, clock, marginal=1.0)
    budget.start()
    known = budget.op("checksum", "known")
    known.calls, known.checked, known.seconds, known.flops_seen = 1, 1, 0.01, 1e9
    unknown = [budget.op("checksum", f"u{i}") for i in range(20)]
    for entry in unknown:
        entry.calls, entry.flops_seen = 1, 2e9  # twice the FLOPs: priced at twice the cost
    clock.t += 1.0
    budget.step_end()
    earned = HEADROOM * 0.02 * (1.0 - 0.01)
    allowance = earned + (earned - 0.01) / DEBT_STEPS  # the step left some of it unspent
    assert known.rate * 0.01 + sum(e.rate * 0.02 for e in unknown) <= allowance * (1 + 1e-9)
    assert all(0 < e.rate <= START_RATE * 2 for e in unknown)
    assert known.rate > unknown[0].rate, "the cheaper operator gets the higher rate"


def test_with_nothing_measured_yet_the_rates_rise():
    clock = Clock()
    budget = Budget(0.02, clock, marginal=1.0)
    budget.start()
    entry = budget.op("checksum", "x")
    entry.calls, entry.flops_seen = 1, 1e9
    clock.t += 1.0
    budget.step_end()
    assert entry.rate == START_RATE * 2


def test_an_operator_never_checked_is_priced_per_element_among_its_kind_not_per_flop():
    """A checksum reads each operand once: its cost follows the elements, not the product's FLOPs. A Linear
    never checked, of many FLOPs but few elements, is priced from the measured Linears per element; the
    batched products measured too (dearer per element) do not price it. Priced per FLOP it got a rate
    under 0.002 on the bench GPT, and was not checked once in 200 steps."""
    clock = Clock()
    budget = Budget(0.02, clock, marginal=1.0)
    budget.start()
    for name, kind, seconds, size, flops in [("a", "linear", 0.001, 1e6, 1e8), ("b", "linear", 0.002, 2e6, 2e8),
                                             ("c", "matmul", 0.01, 1e6, 1e6), ("d", "matmul", 0.02, 2e6, 2e6)]:
        entry = budget.op("checksum", f"{kind}:{name}")
        entry.calls, entry.checked, entry.seconds, entry.flops_seen, entry.size_seen = 1, 1, seconds, flops, size
    fresh = budget.op("checksum", "linear:fresh")
    fresh.calls, fresh.flops_seen, fresh.size_seen = 1, 5e9, 1e6
    clock.t += 1.0
    budget.step_end()
    priced = dict((id(e), unit) for e, unit in budget._priced(
        [(k, e) for k, e in budget.ops.items() if e.unit], [(("checksum", "linear:fresh"), fresh)]))
    assert priced[id(fresh)] == pytest.approx(0.001), "the Linears' cost per element times its elements"


def test_one_slow_check_raises_an_operators_cost_estimate_at_most_outlier_times():
    from bitguard.collectors.online.budget import EMA, OUTLIER

    clock = Clock()
    budget = Budget(0.02, clock, marginal=1.0)
    budget.start()
    entry = budget.op("checksum", "linear:x")
    for seconds in (0.001, 1.0):  # a check slowed a thousandfold (a context switch, a page fault)
        entry.calls, entry.checked, entry.seconds = 1, 1, seconds
        clock.t += 10.0
        budget.step_end()
        budget.reset()
    assert entry.unit == pytest.approx((1 - EMA) * 0.001 + EMA * OUTLIER * 0.001)


def test_a_check_is_charged_its_cost_to_the_step_not_its_own_time():
    """Each check costs the step twice what its own clock times (its frames before the clock starts,
    the caches it evicts): charged only its own time, the steps overspend the budget; charged
    MARGINAL times it, they keep within it."""
    def mean_overhead(marginal: float) -> float:
        clock = Clock()
        budget = Budget(0.02, clock, marginal=marginal)
        budget.start()
        true = []
        for _ in range(120):
            cost = 0.0
            for op, unit in {"a": 0.004, "b": 0.05, "c": 0.02}.items():
                for _ in range(4):
                    if budget.allow("checksum", op):
                        budget.charge("checksum", op, unit / 4)
                        cost += 2 * unit / 4  # what the step paid
            clock.t += 1.0 + cost
            budget.step_end()
            budget.reset()
            true.append(cost)
        return sum(true[-60:]) / 60

    assert MARGINAL == 2.0
    assert mean_overhead(1.0) > 0.02 * 1.2, "its own time alone: the steps pay about twice the aim"
    assert mean_overhead(MARGINAL) <= 0.02 * HEADROOM * 1.1
    with pytest.raises(ValueError):
        Budget(0.02, Clock(), marginal=0.5)
