"""The algorithmic checksum sensor: every element of a sampled GEMM call checked as 1ᵀ(A·B) against (1ᵀA)·B.

For a product C = A·B (+ a bias added to every row), A m×p, B p×q, a checked call compares, for
every column j of C,
    lhs_j = Σ_i C_ij                        (the output's column sums)
    rhs_j = (1ᵀA)·B_j + m·bias_j           (A's column sums, then a float64 product with B)
and normalises the gap by the column's noise scale ‖A‖_F·‖B_j‖ + √m·|bias_j|. A single wrong
element anywhere in C moves its column's sum by its error, so every element of a checked call is
covered, at the cost of reading C, A and B once (O(mq + mp + pq), against the GEMM's 2mpq): on the
host one fused pass per operand, every sum in float64 (cpu_checksum.py); elsewhere torch ops, the
operand converted to float64 for the product being the smaller one (a product without a bias can
be checked as Cᵀ = Bᵀ·Aᵀ). Rounding keeps the normalised gap below √m·(γ_{p+1} + u_out + 2γ_m)
(`column_bound`: the accumulation's γ, the output's rounding, the column sums'), a deterministic
bound; a clean gap is typically 10³ times below it. The clean signal comes from the float64 side,
never from a low-precision checksum of the output (AEGIS §5.1.1): for bfloat16 outputs the
output's own rounding (u = 2⁻⁹ per element) is the noise floor, so only faults of about the
element's own size (sign, exponent, top mantissa bits) stand out.

The ops: `linear` (y = x·Wᵀ + b of every nn.Linear call; A = x, B = Wᵀ), and, through a post hook
on the output's existing AddmmBackward0 / MmBackward0 node (no node is added; the gradients are
only read), `linear.dgrad` (dx = g·W) and `linear.wgrad` (dW = gᵀ·x, reported in the weight's
layout). A call whose output has another autograd node (a non-contiguous input that linear turns
into matmul + add) is counted as not observed in backward.

The budget samples CALLS (collectors/online/budget.py): each operator has a probability of
checking a call, and a checked call is checked whole. A fault on a call is caught with
probability (the operator's rate) × (the check's sensitivity), so an intermittent fault that
keeps recurring is caught within a few faulty calls even at a low rate. The three operators of an
nn.Linear (and of a GEMM call site, gemm_calls.py) each count down to their next checked call
(budget.Countdown: a geometric draw at the rate, stretched when the rates change at a step's end):
a call none of them is due on does one lookup and one decrement and touches neither its operands
nor their shapes (the first Python after a large GEMM pays for every cache line it touches). Each hook's own time around its checks is charged to the
budget as fixed cost.

Each operator keeps its threshold, learned from its clean checks' statistic (the largest
normalised column gap of a call): MARGIN × the largest of the last WINDOW, never above the hard
bound; during the first WARMUP checks the hard bound alone, and a gap under it is learned only when
it is within MARGIN × the median of those learned so far (a fault present during warm-up must not
lift the learned threshold above itself). An operator checked rarely (a low rate on one call a
step: hundreds of steps to its WARMUP checks) is not judged by the hard bound alone meanwhile: once
its `Pool` (every operator of the same output dtype, device type and sums' dtype) holds POOL_MIN
clean statistics from two operators or more, POOL_MARGIN × the pool's largest judges it until its own
warm-up ends (the normalised gap is scale-free: its clean values over the bench GPT's 75 Linear
operators of float32 lie within a factor of 10 of each other, 10³ under their hard bounds). A gap over the threshold raises an alert and
doubles the threshold, which halves back step by step (AEGIS §5.1.3); a false alarm (the
verifier clears it) doubles it too, and its gap joins the clean ones. At most one alert per
operator per step.

The evidence, copied when the alert is raised (bounded: at most EVIDENCE_ELEMENTS rows and as many
columns): the flagged columns are recomputed in float64 (on the alert only, off the checks'
budget) to find the rows whose elements are furthest off, and the alert keeps those rows of A,
those columns of B and of the bias, and the output's elements at their crossings; its JSON evidence
names them (`elements`, `rows`, `columns`). The verifier recomputes that block twice on the same
device and dtype and once in float64 on the CPU (`verify`).

The functional GEMMs (torch.matmul / mm / bmm / addmm and Tensor's @ / .matmul / .mm / .bmm,
called from Python: attention's score and value products, transformers' Conv1D) are checked the
same way, per call site (gemm_calls.py).

Not seen: Linear subclasses with their own forward (their output is not x·Wᵀ + b), functional
F.linear outside an nn.Linear, GEMMs called from C++ (scaled_dot_product_attention), calls
inside a torch.compile'd region (traced: the sensor steps aside), the calls the sampling skips,
and faults below the noise floor (a low mantissa bit: harmless and indistinguishable from rounding).
On CUDA each checked call reads its statistic back once (a synchronisation).
"""

from __future__ import annotations

import functools
import math
import statistics
import weakref
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from bitguard.collectors.online import cpu_checksum
from bitguard.collectors.online.budget import Countdown
from bitguard.collectors.online.gemm_calls import LINEAR, Family, GemmChecks
from bitguard.collectors.online.sensor import Alert, LinearPatch, Sensor

WARMUP = 8  # checks before the learned threshold replaces the hard bound
WARMUP_BASE = 2  # gaps learned before warm-up rejects implausible ones (OpState.plausible)
WINDOW = 64  # clean check statistics kept per operator
POOL_WINDOW = 256  # clean check statistics kept per pool (the latest, of all its operators)
MARGIN = 4.0  # learned threshold = MARGIN × the largest clean statistic in the window
POOL_MIN = 16  # clean statistics a pool holds, from two operators or more, before it judges operators in warm-up
POOL_MARGIN = 2 * MARGIN  # pool threshold = POOL_MARGIN × its largest clean statistic (its operators differ: with
# MARGIN and 8 statistics, one of the bench GPT's operators was over it on a clean call at step 3, cleared)
STATS_STEPS = 32  # an operator checked in none of this many steps writes one sensor_stats row for them (summed)
EVIDENCE_ELEMENTS = 4  # elements (so at most as many rows and columns) localised into an alert's evidence
CHUNK = 1 << 22  # elements of an operand converted to float64 at a time (the checks' memory stays bounded)
_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0")
_TINY = 1e-300


def gemm_node(y: torch.Tensor):
    """The autograd node that made y, past the view nodes in front of it (None without one)."""
    node = y.grad_fn
    while node is not None and type(node).__name__ in _VIEWS:
        nxt = node.next_functions
        node = nxt[0][0] if nxt else None
    return node


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def accumulation_roundoff(dtype: torch.dtype, device: torch.device) -> float:
    """The unit roundoff a GEMM of `dtype` accumulates in on `device`: float32 for float32 and the
    16-bit types, unless torch's switches allow TF32 or reduced-precision reductions on CUDA."""
    if dtype == torch.float64:
        return unit_roundoff(dtype)
    if device.type == "cuda":
        if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
            return 2.0 ** -11
        if dtype == torch.float16 and torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction:
            return unit_roundoff(dtype)
        if dtype == torch.bfloat16 and torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction:
            return unit_roundoff(dtype)
    return unit_roundoff(torch.float32)


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u) if n * u < 1 else math.inf


def hard_bound(k: int, dtype: torch.dtype, device: torch.device) -> float:
    """The relative error rounding alone can give one element of a dot product of length k (plus
    the bias) rounded to `dtype`: γ_{k+1} of the accumulation plus one rounding of the output
    (the verifier's per-element bound, against |A|·|B| + |bias|)."""
    return _gamma(k + 1, accumulation_roundoff(dtype, device)) + unit_roundoff(dtype)


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the checksums of a `dtype` product accumulate in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def column_bound(m: int, p: int, dtype: torch.dtype, device: torch.device, sums: torch.dtype | None = None) -> float:
    """The normalised column gap rounding alone can reach for C = A·B (+ bias) with A m×p:
    Σ_i (|A_i|·|B_j| + |bias_j|) <= √m·(‖A‖_F·‖B_j‖ + √m·|bias_j|), each element off by at most
    hard_bound of that, and the two sums over m rows (of C, of A) by γ_m of it each in `sums`, the
    dtype they were accumulated in (default check_dtype(dtype): torch's; the host pass sums in float64,
    which leaves the GEMM's own rounding as the bound: about 9 times tighter for float32 at m = 1024)."""
    return _column_bound(m, p, dtype, accumulation_roundoff(dtype, device), sums or check_dtype(dtype))


@functools.lru_cache(maxsize=4096)
def _column_bound(m: int, p: int, dtype: torch.dtype, accumulation: float, sums: torch.dtype) -> float:
    """column_bound for an accumulation's unit roundoff (a check's shapes repeat every step)."""
    element = _gamma(p + 1, accumulation) + unit_roundoff(dtype)
    return 1.01 * math.sqrt(m) * (element + 2 * _gamma(m, unit_roundoff(sums)) + _gamma(p, 2.0 ** -53))


def column_gaps(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None):
    """(normalised gaps, raw gaps, reference) per column of c = a·b (+ bias), all float64 NumPy
    vectors of length q: |1ᵀc − (1ᵀa)·b − m·bias|, over ‖a‖_F·‖b_j‖ + √m·|bias_j|. On the host (float32
    and float64 operands row-major or transposed) one fused Numba pass per operand does it
    (cpu_checksum.py); elsewhere torch, b converted to float64 CHUNK elements at a time (its column
    norms from the same copy)."""
    return column_gaps_summed(c, a, b, bias)[:3]


def column_gaps_summed(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None):
    """column_gaps and the dtype its column sums were accumulated in (column_bound's `sums`)."""
    views = cpu_checksum.host_operands(c, a, b, bias)
    if views is not None:
        (lhs, rhs, scale), sums = cpu_checksum.column_sums(views, bias), torch.float64
    else:
        lhs, rhs, scale = (t.cpu().numpy() for t in _torch_sums(c, a, b, bias))
        sums = check_dtype(c.dtype)
    with np.errstate(all="ignore"):  # (inf and NaN inputs give inf and NaN gaps, never a warning in training)
        raw = np.abs(lhs - rhs)
        return raw / np.maximum(scale, _TINY), raw, rhs, sums


def _torch_sums(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None):
    """column_gaps' (lhs, rhs, scale) by torch ops, float64 tensors on c's device."""
    acc = check_dtype(c.dtype)
    m, q = a.shape[0], b.shape[1]
    lhs = c.sum(0, dtype=acc).double()
    s = a.sum(0, dtype=acc).double()
    width = max(1, CHUNK // max(b.shape[0], 1))
    rhs, norms = [], []
    for j in range(0, q, width):
        bd = b[:, j:j + width].double()
        rhs.append(s @ bd)
        norms.append(torch.linalg.vector_norm(bd, dim=0))
    rhs, norms = (torch.cat(rhs), torch.cat(norms)) if len(rhs) > 1 else (rhs[0], norms[0])
    scale = torch.linalg.vector_norm(a, dtype=acc).double() * norms
    if bias is not None:
        bd = bias.double()
        rhs = rhs + m * bd
        scale = scale + math.sqrt(m) * bd.abs()
    return lhs, rhs, scale


def localise(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, cols: list[int],
             n: int = EVIDENCE_ELEMENTS) -> list[tuple[int, int]]:
    """The (row, column) elements of c's columns `cols` off their float64 values beyond the rounding
    bound (relative to |a_i|·|b_j| + |bias_j|), at most n, worst first (a non-finite element first
    of all), or the one furthest off when none is beyond it (a false alarm, for the verifier to
    clear): the columns recomputed in float64, CHUNK elements of a at a time."""
    bc = b[:, cols].double()
    bias_c = None if bias is None else bias[cols].double()
    rows_at = max(1, CHUNK // max(a.shape[1], 1))
    errs = []
    for i in range(0, a.shape[0], rows_at):
        ad = a[i:i + rows_at].double()
        ref, mag = ad @ bc, ad.abs_() @ bc.abs()
        if bias_c is not None:
            ref, mag = ref + bias_c, mag + bias_c.abs()
        err = (c[i:i + rows_at][:, cols].double() - ref).abs() / mag.clamp_min(_TINY)
        errs.append(err.nan_to_num(nan=math.inf))
    err = torch.cat(errs) if len(errs) > 1 else errs[0]
    values, top = err.flatten().topk(min(n, err.numel()))
    bound = hard_bound(a.shape[1], c.dtype, c.device)
    top = [i for v, i in zip(values.tolist(), top.tolist()) if v > bound] or top.tolist()[:1]
    return [(i // len(cols), cols[i % len(cols)]) for i in top]


@dataclass(eq=False)
class _LinearOps:
    """One nn.Linear's name, its three operators' budget entries and its calls in this step."""

    ref: weakref.ref
    name: str
    key: str  # the forward's op key
    forward: object  # budget.OpBudget of linear, linear.dgrad, linear.wgrad
    dgrad: object
    wgrad: object
    countdown: Countdown  # the three operators' countdowns to their next checked call
    calls: int = 0


@dataclass
class _Tally:
    """An operator's budget counters summed over steps, from step `first` (a sensor_stats row's sums)."""

    first: int
    calls: int = 0
    checked: int = 0
    seconds: float = 0.0
    flops_seen: float = 0.0
    flops_checked: float = 0.0

    def add(self, entry) -> None:
        """Add one step's counters of a budget.OpBudget."""
        self.calls += entry.calls
        self.checked += entry.checked
        self.seconds += entry.seconds
        self.flops_seen += entry.flops_seen
        self.flops_checked += entry.flops_checked

    def sums(self) -> dict:
        return {"calls": self.calls, "checked": self.checked, "seconds": self.seconds,
                "flops_seen": self.flops_seen, "flops_checked": self.flops_checked}


class Pool:
    """The clean check statistics of every operator of one kind (output dtype, device type, the dtype
    the sums were accumulated in): what judges an operator still in its warm-up."""

    def __init__(self):
        self.clean: deque[float] = deque(maxlen=POOL_WINDOW)
        self.ops: set[int] = set()  # id() of the OpStates that contributed

    def threshold(self) -> float | None:
        """POOL_MARGIN × the largest clean statistic held, or None before POOL_MIN from two operators."""
        if len(self.clean) < POOL_MIN or len(self.ops) < 2:
            return None
        return POOL_MARGIN * max(max(self.clean), 2.0 ** -52)


class OpState:
    """One operator's threshold, clean-check history and counters."""

    def __init__(self, boundary: str, op: str):
        self.boundary = boundary
        self.op = op
        self.pool: Pool | None = None  # its kind's pool (set at each check, with the hard bound)
        self.clean: deque[float] = deque(maxlen=WINDOW)  # a clean check's largest normalised column gap
        self.checks = 0
        self.mult = 1.0  # doubled by a spike or a false alarm, halved back each step
        self.bound = math.inf  # the hard bound at the last check
        self.alert_step = -1
        self.observed = True  # backward: False when a call's autograd node could not be hooked
        self.nonfinite = 0  # checks skipped: their inputs held inf or NaN
        self.rejected = 0  # warm-up checks under the hard bound not learned: implausible as clean

    def threshold(self) -> float:
        if self.checks < WARMUP or not self.clean:
            pooled = self.pool.threshold() if self.pool is not None else None
            return self.bound if pooled is None else min(self.bound, pooled * self.mult)
        base = MARGIN * max(max(self.clean), 2.0 ** -52)
        return min(self.bound, base * self.mult)

    def source(self) -> str:
        """What threshold() is now: the operator's own learned one, its pool's, or the hard bound."""
        if self.checks >= WARMUP and self.clean:
            return "learned"
        return "pool" if self.pool is not None and self.pool.threshold() is not None else "hard bound"

    def judged_by(self, bound: float, pool: Pool) -> None:
        """The hard bound of the check being judged and the pool of its kind."""
        self.bound, self.pool = bound, pool

    def learn(self, gap: float) -> None:
        self.clean.append(gap)
        if self.pool is not None:
            self.pool.clean.append(gap)
            self.pool.ops.add(id(self))

    def plausible(self, gap: float) -> bool:
        """Whether a gap under the hard bound may be learned as clean during warm-up: not when it is
        more than MARGIN × the median of the WARMUP_BASE or more gaps learned so far (a fault already
        there while the threshold is the hard bound would otherwise lift the learned threshold above
        itself). After warm-up the threshold itself keeps outliers out."""
        if self.checks > WARMUP or len(self.clean) < WARMUP_BASE:
            return True
        return gap <= MARGIN * statistics.median(self.clean)


class ChecksumSensor(GemmChecks, Sensor):
    name = "checksum"

    def __init__(self):
        self.ops: dict[str, OpState] = {}
        self._pending: dict[str, _Tally] = {}  # op key -> its counts since its last sensor_stats row
        self._pools: dict[tuple, Pool] = {}  # (dtype, device type, sums' dtype) -> its operators' pool
        self._linears: dict[int, _LinearOps] = {}  # id(module) -> its names, budget entries, calls this step
        self._epoch = -1  # the budget's epoch the countdowns were last rescaled to
        self._checks_s = 0.0  # seconds the checks of the current hook charged themselves
        self._alert_s = 0.0  # the last check's seconds spent raising its alert
        self._patch = None
        self.backward_unobserved = 0  # checked calls whose backward GEMMs could not be hooked (this step)

    # -- installation -----------------------------------------------------------------------------
    def install(self, monitor) -> None:
        self.monitor = monitor
        monitor.guard(cpu_checksum.warm)()  # (the kernels compiled or loaded now, not inside a training step)
        self._patch = LinearPatch(monitor, self._on_linear)
        self._patch.install()
        self.install_gemms(monitor)

    def remove(self) -> None:
        self.remove_gemms()
        if self._patch is not None:
            self._patch.remove()

    # -- the forward check ------------------------------------------------------------------------
    def _judged_by(self, state: OpState, m: int, p: int, c: torch.Tensor, sums: torch.dtype) -> None:
        """Set the check's hard bound (c = A·B, A m×p) and its kind's pool on the operator's state."""
        kind = (c.dtype, c.device.type, sums)
        pool = self._pools.get(kind)
        if pool is None:
            pool = self._pools[kind] = Pool()
        state.judged_by(column_bound(m, p, c.dtype, c.device, sums), pool)

    def _state(self, key: str, boundary: str, op: str) -> OpState:
        state = self.ops.get(key)
        if state is None:
            state = self.ops[key] = OpState(boundary, op)
        return state

    def _linear(self, module) -> "_LinearOps":
        ops = self._linears.get(id(module))
        if ops is None or ops.ref() is not module:
            name = self.monitor.module_name(module)
            budget = self.monitor.budget
            entries = tuple(budget.op(self.name, f"{op}:{name}") for op in ("linear", "linear.dgrad", "linear.wgrad"))
            ops = self._linears[id(module)] = _LinearOps(weakref.ref(module), name, f"linear:{name}", *entries,
                                                         Countdown(budget, entries))
        return ops

    def _on_linear(self, module, x, y) -> None:
        """Every nn.Linear call: the forward and the two backward GEMMs it will have are each checked
        at their rate. Each operator counts down to its next checked call (Budget.countdown): a call
        before any is due reads nothing but its module's entry (the first Python after a large GEMM
        pays for every cache line it touches: bench_hook_cost.py measured about 100 µs a call for
        the shapes, dtypes and three draws), and is counted as the last drawn call's shapes. The
        operands are touched only for a checked call. The call's own time, outside its checks, is
        charged as fixed cost (what no rate lowers)."""
        budget = self.monitor.budget
        t0 = budget.clock()
        ops = self._linears.get(id(module))
        if ops is not None and ops.ref() is module:
            if self._passed(ops, budget, t0):
                return
        if type(x) is not torch.Tensor or type(y) is not torch.Tensor or not x.dtype.is_floating_point \
                or x.dim() == 0 or x.numel() == 0:
            return  # (a tensor subclass, DTensor: its local values are not the whole product)
        ops = self._linear(module)
        call = ops.calls
        ops.calls = call + 1
        k, o = x.shape[-1], y.shape[-1]  # (the weight's shape, without nn.Module's attribute lookup)
        n = x.numel() // k if k else 0
        backward = y.requires_grad and torch.is_grad_enabled()  # the backward GEMMs' calls are drawn here
        forward, dgrad, wgrad = ops.countdown.due(budget, 2.0 * n * k * o, float(n * k + k * o + n * o),
                                                  (True, backward, backward))
        self._checks_s = 0.0
        if forward or dgrad or wgrad:
            name, weight, bias = ops.name, module.weight, module.bias
            x2 = x.detach().reshape(n, k)
            if forward:
                # (under autocast the GEMM ran on x, W and b cast to the output's dtype: check that product)
                w, b = weight.detach().to(y.dtype), None if bias is None else bias.detach().to(y.dtype)
                self._check(ops.key, name, "linear", y.detach().reshape(n, o), x2.to(y.dtype), w.T, b, call)
            if dgrad or wgrad:
                self._hook_backward(name, y, x2, weight, call, dgrad, wgrad)
        budget.charge_fixed(budget.clock() - t0 - self._checks_s)

    def _rescale(self, budget) -> None:
        """The rates changed at a step's end: every countdown follows (Countdown.rescale)."""
        self._epoch = budget.epoch
        for ops in self._linears.values():
            ops.countdown.rescale(budget)
        self.rescale_sites(budget)

    def _count_passed(self) -> None:
        """The calls countdowns passed since the last count, into the budget's counters (before it reads them)."""
        budget = self.monitor.budget
        for ops in self._linears.values():
            ops.countdown.count_passed(budget)
        self.count_passed_sites(budget)

    def _check(self, key: str, name: str, op: str, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias,
               call: int, transposed: bool = False) -> None:
        """Check every element of c = a·b (+ bias) by its column sums (a product without a bias as
        cᵀ = bᵀ·aᵀ when a is the smaller operand: the one converted to float64 is b). `transposed`:
        the elements are reported as (column, row) of what was checked (the op's own layout)."""
        if bias is None and a.numel() < b.numel():
            c, a, b, transposed = c.T, b.T, a.T, not transposed
        budget = self.monitor.budget
        t0 = budget.clock()
        self._alert_s = 0.0
        state = self._state(key, name, op)
        with torch.no_grad():
            gaps, raw, rhs, sums = column_gaps_summed(c, a, b, bias)
            self._judged_by(state, a.shape[0], a.shape[1], c, sums)
            worst = int(np.nan_to_num(gaps, nan=math.inf).argmax())
            gap = float(gaps[worst])
            if math.isfinite(gap) or bool(np.isfinite(rhs).all()):
                self._judge(state, key, gap, float(raw[worst]), gaps, call, (c, a, b, bias, transposed))
            else:  # non-finite inputs (an overflow the loss scaler will skip): no checksum to judge
                state.nonfinite += 1
        # (an alert's localisation and evidence copies are not the operator's checking cost: charged apart, so an
        # operator that keeps alerting is not sampled less for it)
        spent = budget.clock() - t0
        budget.charge(self.name, key, spent - self._alert_s, 2.0 * a.shape[0] * a.shape[1] * b.shape[1])
        budget.charge_fixed(self._alert_s)
        self._checks_s += spent  # (charged here: the hook that called it charges only the rest of its time)

    def _judge(self, state: OpState, key: str, gap: float, raw_gap: float, gaps: np.ndarray, call: int,
               operands, extra: dict | None = None) -> None:
        """Learn a clean check, or raise an alert with the evidence of the elements furthest off in
        the columns over the threshold. `operands`: (c, a, b, bias, transposed) of the check;
        `extra`: more evidence (a batched product's batch index)."""
        state.checks += 1
        threshold = state.threshold()
        if gap <= threshold:  # (a NaN gap is over any threshold)
            if state.plausible(gap):
                state.learn(gap)
            else:
                state.rejected += 1
            return
        step = self.monitor.step
        if state.alert_step == step:
            return
        state.alert_step = step
        t0 = self.monitor.budget.clock()
        try:
            self._raise(state, gap, raw_gap, gaps, threshold, call, operands, extra)
        finally:
            self._alert_s = self.monitor.budget.clock() - t0

    def _raise(self, state: OpState, gap: float, raw_gap: float, gaps: np.ndarray, threshold: float, call: int,
               operands, extra: dict | None = None) -> None:
        c, a, b, bias, transposed = operands
        ranked = np.nan_to_num(gaps, nan=math.inf)
        over = int((ranked > threshold).sum())
        cols = np.argsort(-ranked, kind="stable")[:min(max(over, 1), EVIDENCE_ELEMENTS)].tolist()
        elements = localise(c, a, b, bias, cols)
        rows = sorted({i for i, _ in elements})
        used = sorted({j for _, j in elements})
        payload = {"kind": state.op, "left": a[rows].clone(), "right": b[:, used].clone(),
                   "bias": None if bias is None else bias[used].clone(), "output": c[rows][:, used].clone(),
                   "rows": rows, "columns": used, "transposed": transposed}
        named = [[j, i] if transposed else [i, j] for i, j in elements]
        alert = Alert(self.name, state.boundary, state.op, "alert",
                      {"gap": gap, "raw_gap": raw_gap, "columns_over": over,
                       "column_gaps": [float(gaps[j]) for j in cols], "elements": named,
                       "rows": sorted({e[0] for e in named}), "columns": sorted({e[1] for e in named}),
                       "call": call, "shape": list(c.T.shape if transposed else c.shape),
                       "hard_bound": state.bound, "clean_max": max(state.clean) if state.clean else None,
                       "checks": state.checks, "threshold_source": state.source(), **(extra or {})}, threshold)
        state.mult *= 2
        self.monitor.raise_alert(alert, payload)

    # -- backward ---------------------------------------------------------------------------------
    def _hook_backward(self, name: str, y: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, call: int,
                       dgrad: bool, wgrad: bool, family: Family = LINEAR) -> None:
        """dx = g·W and dW = gᵀ·x of y = x·Wᵀ (+ b), through a post hook on y's AddmmBackward0 /
        MmBackward0 node; `family` names the operators and the weight gradient's layout (LINEAR,
        the default, or MATMUL)."""
        node = gemm_node(y)
        kind = type(node).__name__ if node is not None else None
        if kind not in ("AddmmBackward0", "MmBackward0"):
            self._unobserved(name, family.prefix)
            return
        monitor, sensor = self.monitor, self
        offset = 1 if kind == "AddmmBackward0" else 0  # addmm(bias, mat1, mat2): grads of (self, mat1, mat2)
        w = weight.detach()
        handle = None

        def post(grad_inputs, grad_outputs):
            handle.remove()
            monitor.guard(sensor._on_backward)(name, grad_inputs[offset] if dgrad else None,
                                               grad_inputs[offset + 1] if wgrad else None, grad_outputs[0],
                                               x2, w, call, family)

        handle = node.register_hook(post)

    def _unobserved(self, name: str, prefix: str) -> None:
        """A checked call whose backward GEMMs cannot be hooked (its output has another autograd node)."""
        self.backward_unobserved += 1
        for op in (f"{prefix}.dgrad", f"{prefix}.wgrad"):
            self._state(f"{op}:{name}", name, op).observed = False

    def _on_backward(self, name: str, dx, dwt, g, x2, w, call: int, family: Family = LINEAR) -> None:
        """dx = g·W (N×K) and dW = gᵀ·x (O×K; autograd hands dWᵀ), each checked whole."""
        if g is not None:
            self._charged(self._check_backward, name, dx, dwt, g, x2, w, call, family)

    def _charged(self, fn, *args) -> None:
        """fn(*args), its time outside the checks it makes (they charge themselves) charged as fixed cost."""
        budget = self.monitor.budget
        t0 = budget.clock()
        self._checks_s = 0.0
        try:
            fn(*args)
        finally:
            budget.charge_fixed(budget.clock() - t0 - self._checks_s)

    def _check_backward(self, name: str, dx, dwt, g, x2, w, call: int, family: Family = LINEAR) -> None:
        prefix = family.prefix
        n, o = g.shape[0], g.shape[-1]
        k = w.shape[1]
        g2 = g.reshape(n, o)
        w, x2 = w.to(g.dtype), x2.to(g.dtype)  # (autocast: the backward GEMMs ran on the cast operands)
        if dx is not None:
            self._check(f"{prefix}.dgrad:{name}", name, f"{prefix}.dgrad", dx.reshape(n, k), g2, w, None, call)
        if dwt is not None:  # (named in the layout of what it is the gradient of: nn.Linear's W, a product's B = Wᵀ)
            c, a, b = (dwt.T, g2.T, x2) if family.weight_layout else (dwt, x2.T, g2)
            self._check(f"{prefix}.wgrad:{name}", name, f"{prefix}.wgrad", c, a, b, None, call)

    # -- verification (verifier thread) -----------------------------------------------------------
    def verify(self, task) -> tuple[str, dict]:
        return verify_gemm(task.payload)

    def on_verdict(self, task, verdict: str) -> None:
        state = self.ops.get(_key(task.alert))
        if state is None:
            return
        if verdict == "cleared":  # a false alarm: the threshold was too tight
            state.mult *= 2
            gap = task.alert.evidence.get("gap")
            if isinstance(gap, float) and gap == gap:
                state.learn(gap)

    # -- per step ---------------------------------------------------------------------------------
    def on_step_end(self, step: int) -> None:
        for state in self.ops.values():
            state.mult = max(1.0, state.mult / 2)
        for ops in self._linears.values():
            ops.calls = 0
        self.reset_sites()

    def stats(self) -> list[dict]:
        """The step's rows: the sensor's totals (op NULL) every step, and an operator's row, summing
        its steps since its previous row (`steps`), on a step it was checked in and once STATS_STEPS
        steps have gone by (pending_stats() writes the rest when the recording ends): at a low rate most
        operators are checked in few steps, and a row for each of them each step cost the training
        thread and the journal writer about 1 ms a step (113 operators of the bench GPT)."""
        self._count_passed()
        rows = []
        step, total = self.monitor.step, _Tally(0)
        for (sensor, key), entry in self.monitor.budget.ops.items():
            if sensor != self.name:
                continue
            tally = self._pending.get(key)
            if entry.calls:
                if tally is None:
                    tally = self._pending[key] = _Tally(step)
                tally.add(entry)
                total.add(entry)
            if tally is not None and (entry.checked or step - tally.first + 1 >= STATS_STEPS):
                rows.append(self._op_row(key, step))
        if total.calls:
            rows.append({"sensor": self.name, "op": None, **total.sums(),
                         "rate": total.flops_checked / total.flops_seen if total.flops_seen else None,
                         "threshold": None, "steps": 1})
        self.backward_unobserved = 0
        return rows

    def pending_stats(self, step: int) -> list[dict]:
        """The operators' rows not written yet, up to step `step` (the recording ends)."""
        return [self._op_row(key, step) | {"step": step} for key in list(self._pending)]

    def _op_row(self, key: str, step: int) -> dict:
        """The sensor_stats row of operator `key`'s steps since its previous row, to `step` (it leaves _pending)."""
        tally = self._pending.pop(key)
        state = self.ops.get(key)
        threshold = None if state is None else state.threshold()
        entry = self.monitor.budget.ops.get((self.name, key))
        return {"sensor": self.name, "op": key, **tally.sums(), "rate": None if entry is None else entry.rate,
                "threshold": None if threshold is None or math.isinf(threshold) else threshold,
                "steps": step - tally.first + 1}

    def coverage(self) -> dict:
        return {"observed": ["nn.Linear forward (linear)", "its input gradient GEMM (linear.dgrad)",
                             "its weight gradient GEMM (linear.wgrad)",
                             "torch.matmul / mm / bmm / addmm and Tensor @ / .matmul / .mm / .bmm called from Python "
                             "(matmul, per call site), batched included, and their operands' gradient GEMMs "
                             "(matmul.dgrad, matmul.wgrad)",
                             "every element of a checked call (column sums); calls sampled at the budget's rate"],
                "not_observed": ["functional F.linear outside nn.Linear", "GEMMs called from C++ "
                                 "(scaled_dot_product_attention's kernels, einsum)", "vector (1-D) products, out= calls, "
                                 "addmm with a full-matrix input or alpha / beta other than 1",
                                 "Linear subclasses with their own forward", "torch.compile'd regions",
                                 "tensor subclasses (DTensor) and functorch-wrapped tensors",
                                 "the calls the sampling skips"]}


def _key(alert) -> str:
    return f"{alert.op}:{alert.boundary}"


def _operands(payload: dict) -> tuple:
    """(recompute(device, dtype), args, left, right, bias) of a checked GEMM's evidence: the same
    operator as in training (addmm with a bias, else mm), its operands as left @ right (+ bias).
    Also the older whole-operand forms (kinds linear, linear.dgrad, linear.wgrad without `left`)."""
    if "left" in payload:
        a, b, bias = payload["left"], payload["right"], payload["bias"]
        if bias is None:
            return torch.mm, (a, b), a, b, None
        return (lambda a, b, bias: torch.addmm(bias, a, b)), (a, b, bias), a, b, bias
    kind = payload["kind"]
    if kind == "linear":
        a, w, b = payload["input"], payload["weight"], payload["bias"]
        return (lambda a, w, b: torch.nn.functional.linear(a, w, b)), (a, w, b), a, w.T, b
    if kind == "linear.dgrad":
        g, w = payload["grad_output"], payload["weight"]
        return (lambda g, w: g @ w), (g, w), g, w, None
    if kind == "linear.wgrad":
        x, g = payload["input_columns"], payload["grad_output"]
        return (lambda x, g: x.T @ g), (x, g), x.T, g, None
    raise ValueError(f"no recomputation for a {kind!r} task")


def verify_gemm(payload: dict) -> tuple[str, dict]:
    """Recompute the GEMM on the saved evidence twice in place (same device and dtype), on a second
    device when one exists, and once in float64 on the CPU as the reference, then classify:
    cleared (a false alarm) when the original output is within the operator's rounding bound of the
    reference; else confirmed when the two recomputations agree bitwise (the corruption is real;
    `reproduced` says whether the device gave the worst element's wrong value again: a persistent
    fault), transient when they do not (the fault cannot be reproduced to one answer). The
    elements are named in the op's own layout (`worst`, `elements_off`: row, column)."""
    op, args, left, right, bias = _operands(payload)
    original = payload["output"]
    with torch.no_grad():
        first, second = op(*args), op(*args)
        ref = op(*(t if t is None else t.detach().to("cpu", torch.float64) for t in args))
        mag = left.detach().to("cpu", torch.float64).abs() @ right.detach().to("cpu", torch.float64).abs()
        if bias is not None:
            mag = mag + bias.detach().to("cpu", torch.float64).abs()
        bound = hard_bound(left.shape[-1], original.dtype, original.device) * mag
        err = (original.detach().to("cpu", torch.float64) - ref).abs()
        # an output that rounded to ±inf because the true value is beyond the dtype's range is rounding too
        overflow = original.detach().cpu().isinf() & (ref.abs() > torch.finfo(original.dtype).max) & (
            original.detach().cpu().double().sign() == ref.sign())
        err = torch.where(overflow, torch.zeros_like(err), err)
        excess = (err - bound).nan_to_num(nan=math.inf)
        worst = int(excess.flatten().argmax())
        off = (excess > 0).flatten().nonzero().flatten()[:16].tolist()
        over = int((excess > 0).sum())
        agree = torch.equal(first, second) and bool((first.isnan() == second.isnan()).all())
        reproduced = _same_bits(first.flatten()[worst:worst + 1], original.flatten()[worst:worst + 1])
        evidence = {"max_error": float(err.flatten()[worst]), "bound": float(bound.flatten()[worst]),
                    "elements_over_bound": over, "worst": _element(payload, worst, err.shape),
                    "elements_off": [_element(payload, i, err.shape) for i in off],
                    "original": float(original.flatten()[worst]), "reference": float(ref.flatten()[worst]),
                    "recomputed": float(first.flatten()[worst]), "recomputations_agree": agree,
                    "reproduced": reproduced, "device": str(original.device), "dtype": str(original.dtype)}
        if original.dtype in _INT_VIEWS:
            bits = int(original.flatten()[worst:worst + 1].view(_INT_VIEWS[original.dtype]).item()) ^ \
                int(first.flatten()[worst:worst + 1].view(_INT_VIEWS[original.dtype]).item())
            evidence["flipped_bits"] = [i for i in range(original.element_size() * 8) if bits >> i & 1]  # vs recompute
        other = _second_device(original.device)
        if other is not None:
            third = op(*(t if t is None else t.to(other) for t in args)).to(original.device)
            evidence["second_device"] = {"device": str(other), "agrees_with_recomputation": torch.equal(third, first)}
    if over == 0:
        state = "cleared"
        evidence["summary"] = (f"false alarm: the output is within the rounding bound of the float64 reference "
                               f"(error {evidence['max_error']:.1e} <= {evidence['bound']:.1e})")
    elif agree:
        state = "confirmed"
        evidence["summary"] = (f"{over} element(s) off the float64 reference beyond the rounding bound "
                               f"(error {evidence['max_error']:.1e} > {evidence['bound']:.1e}); recomputed twice "
                               f"alike, {'the same wrong value again (persistent)' if reproduced else 'correctly'}")
    else:
        state = "transient"
        evidence["summary"] = "the two recomputations disagree: the fault does not reproduce to one answer"
    return state, evidence


def _element(payload: dict, flat: int, shape) -> list[int]:
    """The element at `flat` of the evidence block, as (row, column) of the whole output in the op's
    layout (the block's own indices for the older whole-operand evidence)."""
    i, j = divmod(flat, shape[-1]) if len(shape) == 2 else (flat, 0)
    if "rows" in payload and "columns" in payload:
        i, j = payload["rows"][i], payload["columns"][j]
        if payload.get("transposed"):
            i, j = j, i
    return [i, j] if len(shape) == 2 else [flat]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in _INT_VIEWS and a.dtype == b.dtype:
        return torch.equal(a.contiguous().view(_INT_VIEWS[a.dtype]), b.contiguous().view(_INT_VIEWS[b.dtype]))
    return torch.equal(a, b)


_INT_VIEWS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
              torch.bfloat16: torch.int16}


def _second_device(device: torch.device) -> torch.device | None:
    """Another accelerator of the same kind, when there is one (CPU evidence has none)."""
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        return torch.device("cuda", (device.index or 0) + 1 if (device.index or 0) + 1 < torch.cuda.device_count()
                            else 0)
    return None
