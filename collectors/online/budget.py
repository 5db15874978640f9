"""The overhead budget: how much of each operator's work the sensors may check, so that what they
cost on the critical path stays within a fraction of the step time (`--budget`, default 0.02).

Sensors ask `allow(sensor, op)` before checking a call and report what a check cost with
`charge(sensor, op, seconds, flops)`. At each step's end `step_end()` compares the seconds
cost with the training's own time in that step (the step's wall time minus what the sensors
cost) and sets every operator's rate for the next step: a water-filling of the step's allowance
(HEADROOM × budget × training time) over the operators seen, cheapest first, each getting an equal share of
what is left, capped at rate 1. What the steps so far charged beyond their allowance (or left
unspent) is carried as a balance and repaid over the next DEBT_STEPS steps. An operator's cost per
unit of rate is learned from what it charged (an exponential average of what its checks cost, each observation at most OUTLIER times the
estimate: one check slowed by a context switch must not starve an operator checked once in a hundred
steps), so the controller needs no model of the hardware; one not checked yet is priced from the
others' until its first check: per element its checks would read (what a checksum's cost follows: it
reads each operand once, whatever the product's FLOPs), among the operators of its kind (the part of
the op key before its first colon: `linear`, `matmul.dgrad`, ...) when any is measured, else per FLOP.

What a check costs the step is MARGINAL times what its own clock times: its frames before the clock
starts and the caches its pass over the operands evicts for the training's next operators are paid
by the step but seen by no clock (on the bench GPT's CPU a checked call cost the step about twice
what its checks timed; on a GPU it is not measured). The fixed cost is taken as charged.

A rate r is the probability that a call of the operator is checked (a hook draws each call,
`draw`, or counts down to the next checked one, `Countdown`: the same chance per call, and a call
passed reads nothing); a checked call is checked whole (the checksum sensor covers every element of it), so the cost of a check's fixed part
(Python, a weight's float64 copy) scales with r too. No rate goes below `MIN_RATE`: a budget too
small for even that is exceeded, and the sensor_stats rows show by how much. A budget of 1 means no
limit: every rate stays 1 (every call checked; tests and evaluations).

The random draws use a generator of their own, never torch's or Python's global one (the training
must draw exactly what it draws unwatched). The clock is injectable: tests drive the controller
with a fake one. This module knows nothing about tensors or hooks.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

DEFAULT_BUDGET = 0.02
MIN_RATE = 1 / 1024
EMA = 0.3  # weight of the latest step in an operator's cost estimate
MAX_RAISE = 2.0  # a rate at most doubles from one step to the next (decreases take effect at once)
START_RATE = 1 / 16  # an operator's first rate: cheap before anything is measured, raised when there is room
OUTLIER = 4.0  # one observation of an operator's cost raises its estimate at most to this multiple
DEBT_STEPS = 4  # what the steps overspent (or left unspent) is paid back over this many steps
HEADROOM = 0.8  # the rates aim at this share of the budget: what is not measured (the
# hooks' own frames, the training thread's waits for the interpreter lock, caches the checks evict) takes the rest; the
# journal writer thread's CPU time is charged as fixed cost (monitor.py)
MARGINAL = 2.0  # what a check costs the step per second its own clock times: the frames before its clock
# starts, the autograd hooks of a checked call, the caches its pass over C, A and B evicts for the training's
# next operators. Measured on the bench GPT's CPU (docs/ONLINE.md, overhead): run Q's 2.5% against 0.9% charged
# to checks and 0.7% fixed, run R (checks all but off) 0.995x; bench_hook_cost.py, a hook after a large GEMM
# 97-116 us marginal against 45-48 us timed


@dataclass
class OpBudget:
    rate: float = START_RATE  # in force for the current step
    unit: float | None = None  # learned seconds per step at rate 1
    calls: int = 0  # this step
    checked: int = 0
    seconds: float = 0.0
    flops_seen: float = 0.0
    flops_checked: float = 0.0
    flops_step: float = 0.0  # FLOPs seen in the last step it had calls (what prices it before its first check)
    size_seen: float = 0.0  # elements its checks would read, over this step's calls
    size_step: float = 0.0  # the same, in the last step it had calls


class Budget:
    def __init__(self, fraction: float = DEFAULT_BUDGET, clock=time.perf_counter, seed: int = 0,
                 marginal: float = MARGINAL):
        if not 0 < fraction <= 1:
            raise ValueError(f"budget {fraction!r} is not a fraction in (0, 1]")
        if not marginal >= 1:
            raise ValueError(f"marginal factor {marginal!r} is below 1: a check costs at least what it times")
        self.fraction = fraction
        self.marginal = marginal  # a check's cost to the step per second it charged (MARGINAL)
        self.clock = clock
        self.ops: dict[tuple[str, str], OpBudget] = {}
        self._random = random.Random(seed).random
        self._step_start: float | None = None
        self.last_step_s: float | None = None  # the last step's wall time
        self.last_sensor_s = 0.0  # what the sensors cost it: the checks' charges × marginal, and the fixed cost
        self.overhead: float | None = None  # last_sensor_s / (last_step_s - last_sensor_s)
        self.fixed_s = 0.0  # this step's critical-path seconds no rate can lower (the monitor's step end)
        self.balance = 0.0  # what the steps so far were allowed less what they charged (negative: a debt)
        self.epoch = 0  # counts the steps whose end set the rates (a countdown drawn under older rates is redrawn)

    def start(self) -> None:
        """The clock starts the first step (the recording began; what installing cost is not the step's)."""
        self._step_start = self.clock()
        self.fixed_s = 0.0

    def op(self, sensor: str, op: str) -> OpBudget:
        entry = self.ops.get((sensor, op))
        if entry is None:
            entry = self.ops[(sensor, op)] = OpBudget(1.0 if self.fraction >= 1 else START_RATE)
        return entry

    def allow(self, sensor: str, op: str, flops: float = 0.0, size: float = 0.0) -> bool:
        """Whether to check this call of `op` (counting it as seen); `size`: the elements its check would read."""
        return self.draw(self.op(sensor, op), flops, size)

    def draw(self, entry: OpBudget, flops: float = 0.0, size: float = 0.0) -> bool:
        """allow() on an entry the caller kept from op() (a hook called on every call skips the lookup)."""
        entry.calls += 1
        entry.flops_seen += flops
        entry.size_seen += size
        if entry.rate >= 1 or self._random() < entry.rate:
            entry.checked += 1
            return True
        return False

    def countdown(self, entry: OpBudget) -> int:
        """How many of the operator's next calls pass unchecked before one is checked, drawn at its
        rate: a geometric draw, the same chance per call as draw() gives, for a hook that counts
        calls down instead of drawing each (a call that draws nothing then reads nothing)."""
        if entry.rate >= 1:
            return 0
        if entry.rate <= 0:
            return 1 << 62
        return int(math.log(1.0 - self._random()) / math.log1p(-entry.rate))

    def seen(self, entry: OpBudget, calls: int, flops: float, size: float, checked: int = 0) -> None:
        """Count `calls` calls of `flops` and `size` each (`checked` of them checked) that a countdown passed."""
        entry.calls += calls
        entry.checked += checked
        entry.flops_seen += calls * flops
        entry.size_seen += calls * size

    def random(self) -> float:
        """A draw from the budget's own generator."""
        return self._random()

    def charge(self, sensor: str, op: str, seconds: float, flops: float = 0.0) -> None:
        entry = self.op(sensor, op)
        entry.seconds += seconds
        entry.flops_checked += flops

    def charge_fixed(self, seconds: float) -> None:
        """Critical-path time that no sampling rate scales (it comes off the allowance)."""
        self.fixed_s += seconds

    def step_end(self) -> None:
        """Measure the step that ends and set the rates for the next one; counters are kept until
        reset() (the sensors' stats() read them first)."""
        now = self.clock()
        charged = self.marginal * sum(e.seconds for e in self.ops.values()) + self.fixed_s
        if self._step_start is not None:
            step = now - self._step_start
            self.last_step_s, self.last_sensor_s = step, charged
            own = step - charged
            self.overhead = charged / own if own > 0 else None
            if own > 0 and self.fraction < 1:  # budget 1: no limit, everything checked
                earned = HEADROOM * self.fraction * own
                # a rate is a probability and a cost estimate learned from few checks: a step can
                # charge more than it earned (a recording's first steps charged about 1.25x), and
                # without a memory nothing paid it back. The balance carries it (at most
                # DEBT_STEPS steps of debt, one step of credit) and the next steps repay a
                # DEBT_STEPS-th of it each.
                self.balance = min(earned, max(-DEBT_STEPS * earned, self.balance + earned - charged))
                self._allocate(max(0.0, earned - self.fixed_s + self.balance / DEBT_STEPS))
                self.epoch += 1
        self._step_start = now

    def _allocate(self, allowance: float) -> None:
        active, unknown = [], []
        for key, entry in self.ops.items():
            if entry.calls:
                entry.flops_step, entry.size_step = entry.flops_seen, entry.size_seen
            if entry.checked and entry.seconds > 0 and entry.calls:
                # seconds at rate 1: what its checked calls cost the step, scaled to all its calls
                observed = self.marginal * entry.seconds * entry.calls / entry.checked
                entry.unit = observed if entry.unit is None else \
                    (1 - EMA) * entry.unit + EMA * min(observed, OUTLIER * entry.unit)
            if entry.calls and entry.unit:
                active.append((key, entry))
            elif entry.calls:
                unknown.append((key, entry))
        # an operator never checked yet (all its calls sampled out) is priced like the known ones, by its FLOPs
        # (else at their median cost), and shares the allowance: raising unknown rates blindly overspent the
        # first steps of a recording several times over (up to 36 of 75 calls checked, 16% of a step)
        priced = self._priced(active, unknown)
        if not active and allowance > 0:  # nothing measured yet to price by: the unknown rates rise until one is
            for _, entry in unknown:
                entry.rate = min(1.0, entry.rate * MAX_RAISE)
        left = allowance
        for n, (entry, unit) in enumerate(sorted(priced, key=lambda pair: pair[1])):
            share = left / (len(priced) - n)
            rate = min(1.0, max(MIN_RATE, share / unit), entry.rate * MAX_RAISE)
            left = max(0.0, left - rate * unit)
            entry.rate = rate

    @staticmethod
    def _priced(active: list, unknown: list) -> list:
        """(entry, its seconds per step at rate 1) of every operator with calls (`active`, `unknown`:
        (key, entry) pairs): the learned cost, or for one never checked an estimate from the known
        ones' (per element read, among its kind's when any is known, else among all; else per FLOP;
        else their median); with nothing known yet, none (the caller raises their rates until one is
        checked)."""
        priced = [(e, e.unit) for _, e in active]
        if not unknown or not active:
            return priced
        per_size: dict[str, list[float]] = {}
        for (_, op), e in active:
            if e.size_step > 0:
                per_size.setdefault(_kind(op), []).append(e.unit / e.size_step)
        every = sorted(v for values in per_size.values() for v in values)
        per_flop = sorted(e.unit / e.flops_step for _, e in active if e.flops_step > 0)
        median_unit = sorted(e.unit for _, e in active)[len(active) // 2]
        for (_, op), entry in unknown:
            peers = sorted(per_size.get(_kind(op), ())) or every
            if peers and entry.size_step > 0:
                priced.append((entry, peers[len(peers) // 2] * entry.size_step))
            elif per_flop and entry.flops_step > 0:
                priced.append((entry, per_flop[len(per_flop) // 2] * entry.flops_step))
            else:
                priced.append((entry, median_unit))
        return priced

    def reset(self) -> None:
        """Start the next step's counters."""
        self.fixed_s = 0.0
        for entry in self.ops.values():
            entry.calls = entry.checked = 0
            entry.seconds = entry.flops_seen = entry.flops_checked = entry.size_seen = 0.0


class Countdown:
    """The countdowns of one call's operators (an nn.Linear's forward, dgrad and wgrad; a GEMM call
    site's three) to their next checked call, each drawn at its rate (Budget.countdown). A hook asks
    `passes()` first: while no operator is due the call only decrements, and is counted as seen at
    the shapes of the last call that was not passed (`due` took them; `count_passed` adds the passed
    calls to the budget's counters before they are read). The first call is never passed: it gives
    the shapes."""

    __slots__ = ("entries", "left", "rates", "skip", "passed", "pending", "flops", "size", "counted")

    def __init__(self, budget: Budget, entries: tuple):
        self.entries = entries
        self.left = [budget.countdown(entry) for entry in entries]
        self.rates = [entry.rate for entry in entries]
        self.skip = 0  # calls to pass before one is looked at
        self.passed = 0  # calls passed since the last one looked at
        self.pending = 0  # calls passed since the budget last counted them
        self.flops = self.size = 0.0  # a call's, and the elements its check reads, at the last call looked at
        self.counted = (True,) * len(entries)  # which operators that call had (a backward GEMM only with a backward)

    def passes(self) -> bool:
        """Whether this call passes unchecked by every operator (then counted, nothing else read)."""
        if self.skip:
            self.skip -= 1
            self.passed += 1
            self.pending += 1
            return True
        return False

    def due(self, budget: Budget, flops: float, size: float, counted: tuple) -> list[bool]:
        """A call not passed, of `flops` and `size`, with the operators `counted`: which of them check
        it; every operator's next countdown; the call counted as seen (and checked) by those it has."""
        self.flops, self.size, self.counted = flops, size, counted
        left, due = self.left, []
        for i, entry in enumerate(self.entries):
            countdown = left[i] - self.passed
            if countdown <= 0:
                left[i], self.rates[i] = budget.countdown(entry), entry.rate
                due.append(counted[i])
            else:
                left[i] = countdown - 1
                due.append(False)
            if counted[i]:
                budget.seen(entry, 1, flops, size, due[i])
        self.passed, self.skip = 0, min(left)
        return due

    def rescale(self, budget: Budget) -> None:
        """The rates changed: each countdown left is stretched or shrunk to its operator's new rate
        (the calls still to pass scaled by log(1 - old) / log(1 - new), what a geometric countdown
        drawn at the new rate would have left), so a rate raised from MIN_RATE takes effect at once
        and not after the calls its old countdown had to pass."""
        left = self.left
        for i, entry in enumerate(self.entries):
            old, new, countdown = self.rates[i], entry.rate, left[i] - self.passed
            if new == old or countdown <= 0:
                left[i] = max(countdown, 0)
            elif new >= 1:
                left[i] = 0
            elif old >= 1:
                left[i] = budget.countdown(entry)
            else:
                left[i] = int(countdown * math.log1p(-old) / math.log1p(-new)) if new > 0 else 1 << 62
            self.rates[i] = new
        self.passed, self.skip = 0, min(left)

    def count_passed(self, budget: Budget) -> None:
        """The calls passed since the last count, into the budget's counters (before it reads them)."""
        if self.pending:
            for entry, counted in zip(self.entries, self.counted):
                if counted:
                    budget.seen(entry, self.pending, self.flops, self.size)
            self.pending = 0


def _kind(op: str) -> str:
    """An op key's kind: the part before its first colon (`linear:blocks.0.fc` -> `linear`)."""
    return op.partition(":")[0]
