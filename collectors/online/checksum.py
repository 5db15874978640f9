"""The algorithmic checksum sensor: Linear layers' GEMMs checked as (A·B)·1 against A·(B·1).

Forward (op `linear`): for an nn.Linear call y = x·Wᵀ + b (x as N×K rows), sampled rows i give
    lhs_i = Σ_j y_ij            (the output row's sum, in float64)
    rhs_i = x_i · c + Σ_j b_j   (c = Wᵀ·1, W's column sums in float64, cached per weight version)
and the normalised gap |lhs_i − rhs_i| / (|x_i| · |W|ᵀ·1 + Σ|b|), a dimensionless number that the
output's rounding keeps below about (K+1)·u (u: the unit roundoff of the accumulation; the
deterministic bound `hard_bound`). The clean signal comes from the float64 side, never from the
low-precision output's own checksum (AEGIS §5.1.1: a bf16 output checksum drowns faults 10⁴× larger).

Backward, where it can be seen without changing autograd: on a checked call the output's existing
AddmmBackward0 / MmBackward0 node gets a post hook (no node is added; the gradients are only read):
`linear.dgrad` checks rows of dx = g·W against g·(W·1), `linear.wgrad` rows of dWᵀ = xᵀ·g against
xᵀ·(g·1). A call whose output has another autograd node (a non-contiguous input that linear turns
into matmul + add) is counted as not observed in backward.

Each operator keeps its own threshold, learned from its clean normalised gaps (the largest of the
last WINDOW, times MARGIN, never above the hard bound): during the first WARMUP checks only the
hard bound alerts. A gap over the threshold raises an alert and doubles the threshold; it halves
back step by step (AEGIS §5.1.3). A false alarm (the verifier clears it) doubles it too, and its gap
joins the clean ones. At most one alert per operator per step.

The evidence is copied when the alert is raised: the offending input rows, the weight and bias,
the output rows (backward: the gradient rows and what they multiply). The verifier recomputes them
twice on the same device and dtype and once in float64 on the CPU (`verify`).

Not seen: Linear subclasses with their own forward (their output is not x·Wᵀ + b), functional
F.linear / matmul / bmm outside an nn.Linear (attention's score and value products), calls inside
a torch.compile'd region (traced: the sensor steps aside), and the rows a sampled call leaves out.
Columns are not sampled: a fault confined to an unsampled row is missed.
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections import deque

import torch
import torch.nn.functional as F

from bitguard.collectors.online.sensor import Alert, LinearPatch, Sensor

WARMUP = 8  # checks before the learned threshold replaces the hard bound
WINDOW = 64  # clean normalised gaps kept per operator
MARGIN = 16.0  # learned threshold = MARGIN × the largest clean gap in the window
EVIDENCE_ROWS = 4  # rows copied into an alert's evidence
_VIEWS = ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0")


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


def hard_bound(k: int, dtype: torch.dtype, device: torch.device) -> float:
    """The normalised gap rounding alone can reach for a dot product of length k (plus the bias)
    rounded to `dtype`: γ_{k+1} of the accumulation plus one rounding of the output."""
    u = accumulation_roundoff(dtype, device)
    return (k + 1) * u / (1 - (k + 1) * u) + unit_roundoff(dtype)


class OpState:
    """One operator's threshold, clean-gap history and counters."""

    def __init__(self, boundary: str, op: str):
        self.boundary = boundary
        self.op = op
        self.clean: deque[float] = deque(maxlen=WINDOW)  # normalised gaps
        self.raw: deque[float] = deque(maxlen=WINDOW)  # gaps in output units (the simulator's scale)
        self.checks = 0
        self.mult = 1.0  # doubled by a spike or a false alarm, halved back each step
        self.bound = math.inf  # the hard bound at the last check
        self.alert_step = -1
        self.observed = True  # backward: False when a call's autograd node could not be hooked
        self.nonfinite = 0  # checks skipped: their inputs held inf or NaN

    def threshold(self) -> float:
        if self.checks < WARMUP or not self.clean:
            return self.bound
        base = MARGIN * max(max(self.clean), 2.0 ** -52)
        return min(self.bound, base * self.mult)

    def learn(self, gap: float, raw: float) -> None:
        self.clean.append(gap)
        self.raw.append(raw)

    def median_raw(self) -> float | None:
        return statistics.median(self.raw) if self.raw else None


class ChecksumSensor(Sensor):
    name = "checksum"

    def __init__(self):
        self.ops: dict[str, OpState] = {}
        self._colsums: dict[int, tuple] = {}  # id(weight) -> (ref, version, ptr, W·1 pair, Wᵀ·1 pair)
        self._calls: dict[str, int] = {}  # op key -> calls in this step
        self._patch = None
        self.backward_unobserved = 0  # checked calls whose backward GEMMs could not be hooked (this step)

    # -- installation -----------------------------------------------------------------------------
    def install(self, monitor) -> None:
        self.monitor = monitor
        self._patch = LinearPatch(monitor, self._on_linear)
        self._patch.install()

    def remove(self) -> None:
        if self._patch is not None:
            self._patch.remove()

    # -- the forward check ------------------------------------------------------------------------
    def _state(self, key: str, boundary: str, op: str) -> OpState:
        state = self.ops.get(key)
        if state is None:
            state = self.ops[key] = OpState(boundary, op)
        return state

    def _on_linear(self, module, x, y) -> None:
        if type(x) is not torch.Tensor or type(y) is not torch.Tensor or not x.dtype.is_floating_point \
                or x.dim() == 0 or x.numel() == 0:
            return  # (a tensor subclass, DTensor: its local values are not the whole product)
        weight, bias = module.weight, module.bias
        k, o = weight.shape[1], weight.shape[0]
        n = x.numel() // k if k else 0
        name = self.monitor.module_name(module)
        key = f"linear:{name}"
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        if not self.monitor.budget.allow(self.name, key, 2.0 * n * k * o):
            return
        x2, y2 = x.detach().reshape(n, k), y.detach().reshape(n, o)
        self._check(key, name, "linear", y2, x2, lambda: (*self._sums(weight, 0), *self._bias(bias)), k, call,
                    lambda idx: {"input": x2[idx].clone(), "weight": weight.detach().clone(),
                                 "bias": None if bias is None else bias.detach().clone(), "output": y2[idx].clone()})
        if y.requires_grad and torch.is_grad_enabled():
            self._hook_backward(name, y, x2, weight, call)

    def _check(self, key: str, name: str, op: str, c: torch.Tensor, left: torch.Tensor, sums, inner: int, call: int,
               evidence) -> None:
        """Check sampled rows of a GEMM's result c = left·R (+ bias): each row's sum against
        left_i·(R·1) + Σbias in float64, normalised by |left_i|·(|R|·1) + Σ|bias|. `sums()` gives
        (R·1, |R|·1, Σbias, Σ|bias|); `evidence(rows)` copies what the verifier needs."""
        budget = self.monitor.budget
        t0 = budget.clock()
        state = self._state(key, name, op)
        with torch.no_grad():
            stride, offset = self._rows(key, c.shape[0])
            r, rabs, bsum, babs = sums()
            ls = left[offset::stride].double()
            # (a copy to float64 then a sum: torch's sum(dtype=float64) of a float32 tensor is 5x slower)
            raw = (c[offset::stride].double().sum(1) - (ls @ r + bsum)).abs()
            gaps = raw / (ls.abs() @ rabs + babs).clamp_min(1e-300)
            state.bound = hard_bound(inner, c.dtype, c.device)
            worst = int(gaps.argmax())
            gap = float(gaps[worst])
            if math.isfinite(gap) or bool(ls.isfinite().all()) and bool(r.isfinite().all()):
                self._judge(state, key, gap, float(raw[worst]), gaps, offset, stride, call, evidence)
            else:  # non-finite inputs (an overflow the loss scaler will skip): no checksum to judge
                state.nonfinite += 1
        budget.charge(self.name, key, budget.clock() - t0, 2.0 * gaps.numel() * inner * c.shape[1])

    def _rows(self, key: str, n: int) -> tuple[int, int]:
        """(stride, offset) of the rows to check: a fraction of n as the budget allows, at a random offset."""
        fraction = self.monitor.budget.row_fraction(self.name, key)
        stride = max(1, min(n, round(1 / fraction)))
        return stride, int(self.monitor.budget.random() * stride) % max(n, 1)

    def _sums(self, weight: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """W's sums along `dim` and of |W|, in float64, cached while the weight's version holds."""
        entry = self._colsums.get(id(weight))
        version, ptr = weight._version, weight.data_ptr()
        if entry is None or entry[0]() is not weight or entry[1] != version or entry[2] != ptr:
            entry = [weakref.ref(weight), version, ptr, {}]
            self._colsums[id(weight)] = entry
        sums = entry[3].get(dim)
        if sums is None:
            sums = entry[3][dim] = _sum_abs(weight.detach().double(), dim)
        return sums

    def _bias(self, bias) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        if bias is None:
            return 0.0, 0.0
        return self._sums(bias, 0)

    def _judge(self, state: OpState, key: str, gap: float, raw_gap: float, gaps: torch.Tensor, offset: int,
               stride: int, call: int, evidence) -> None:
        """Learn a clean gap, or raise an alert with the evidence of the rows over the threshold."""
        state.checks += 1
        threshold = state.threshold()
        if gap <= threshold:  # (a NaN gap is over any threshold)
            state.learn(gap, raw_gap)
            return
        step = self.monitor.step
        if state.alert_step == step:
            return
        state.alert_step = step
        over = (gaps > threshold) | gaps.isnan()
        local = over.nonzero().flatten()[:EVIDENCE_ROWS].tolist()
        rows = [offset + i * stride for i in local]
        payload = {"kind": state.op, **evidence(rows), "rows": rows}
        alert = Alert(self.name, state.boundary, state.op, "alert",
                      {"gap": gap, "raw_gap": raw_gap, "rows": rows, "row_gaps": [float(gaps[i]) for i in local],
                       "call": call, "rows_checked": int(gaps.numel()), "stride": stride, "offset": offset,
                       "hard_bound": state.bound, "clean_max": max(state.clean) if state.clean else None,
                       "checks": state.checks}, threshold)
        state.mult *= 2
        self.monitor.raise_alert(alert, payload)

    # -- backward ---------------------------------------------------------------------------------
    def _hook_backward(self, name: str, y: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, call: int) -> None:
        node = y.grad_fn
        while node is not None and type(node).__name__ in _VIEWS:
            nxt = node.next_functions
            node = nxt[0][0] if nxt else None
        kind = type(node).__name__ if node is not None else None
        if kind not in ("AddmmBackward0", "MmBackward0"):
            self.backward_unobserved += 1
            for op in ("linear.dgrad", "linear.wgrad"):
                self._state(f"{op}:{name}", name, op).observed = False
            return
        monitor, sensor = self.monitor, self
        offset = 1 if kind == "AddmmBackward0" else 0  # addmm(bias, mat1, mat2): grads of (self, mat1, mat2)
        w = weight.detach()
        handle = None

        def post(grad_inputs, grad_outputs):
            handle.remove()
            monitor.guard(sensor._on_backward)(name, grad_inputs[offset], grad_inputs[offset + 1], grad_outputs[0],
                                               x2, w, call)

        handle = node.register_hook(post)

    def _on_backward(self, name: str, dx, dwt, g, x2, w, call: int) -> None:
        """dx = g·W (N×K) and dWᵀ = xᵀ·g (K×O), each checked on sampled rows against the float64 side."""
        if g is None:
            return
        budget = self.monitor.budget
        n, o = g.shape[0], g.shape[-1]
        k = w.shape[1]
        g2 = g.reshape(n, o)
        key = f"linear.dgrad:{name}"
        if dx is not None and budget.allow(self.name, key, 2.0 * n * k * o):
            d2 = dx.reshape(n, k)
            self._check(key, name, "linear.dgrad", d2, g2, lambda: (*self._sums(w, 1), 0.0, 0.0), o, call,
                        lambda idx: {"grad_output": g2[idx].clone(), "weight": w.clone(), "output": d2[idx].clone()})
        key = f"linear.wgrad:{name}"
        if dwt is not None and budget.allow(self.name, key, 2.0 * n * k * o):
            self._check(key, name, "linear.wgrad", dwt, x2.T,
                        lambda: (*_sum_abs(g2.double(), 1), 0.0, 0.0), n,
                        call, lambda idx: {"input_columns": x2[:, idx].clone(), "grad_output": g2.clone(),
                                           "output": dwt[idx].clone()})

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
            raw = task.alert.evidence.get("raw_gap")
            if isinstance(gap, float) and gap == gap:
                state.learn(gap, raw)

    # -- per step ---------------------------------------------------------------------------------
    def on_step_end(self, step: int) -> None:
        for state in self.ops.values():
            state.mult = max(1.0, state.mult / 2)
        self._calls.clear()
        if len(self._colsums) > 4 * max(len(self.ops), 16):
            self._colsums = {k: e for k, e in self._colsums.items() if e[0]() is not None}

    def stats(self) -> list[dict]:
        rows = []
        total = {"op": None, "calls": 0, "checked": 0, "seconds": 0.0, "flops_seen": 0.0, "flops_checked": 0.0}
        for (sensor, key), entry in self.monitor.budget.ops.items():
            if sensor != self.name or not entry.calls:
                continue
            state = self.ops.get(key)
            rows.append({"sensor": self.name, "op": key, "calls": entry.calls, "checked": entry.checked,
                         "rate": entry.rate, "seconds": entry.seconds, "flops_seen": entry.flops_seen,
                         "flops_checked": entry.flops_checked,
                         "threshold": None if state is None or math.isinf(state.threshold()) else state.threshold()})
            for field in ("calls", "checked", "seconds", "flops_seen", "flops_checked"):
                total[field] += rows[-1][field]
        if rows:
            seen = total["flops_seen"]
            rows.append({"sensor": self.name, **total, "rate": total["flops_checked"] / seen if seen else None,
                         "threshold": None})
        self.backward_unobserved = 0
        return rows

    def median_gap(self, boundary: str, op: str = "linear") -> float | None:
        """The operator's median clean gap in output units (a row sum's), None before any check."""
        state = self.ops.get(f"{op}:{boundary}")
        return None if state is None else state.median_raw()

    def coverage(self) -> dict:
        return {"observed": ["nn.Linear forward (linear)", "its input gradient GEMM (linear.dgrad)",
                             "its weight gradient GEMM (linear.wgrad)"],
                "not_observed": ["functional F.linear / matmul / bmm outside nn.Linear (attention's products)",
                                 "Linear subclasses with their own forward", "torch.compile'd regions",
                                 "rows a sampled call leaves out (columns are not sampled)"]}


def _sum_abs(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t summed along dim, |t| summed along dim) of a float64 tensor the caller owns (|t| in place)."""
    return t.sum(dim), t.abs_().sum(dim)


def _key(alert) -> str:
    return f"{alert.op}:{alert.boundary}"


def _operands(payload: dict) -> tuple:
    """(recompute(device, dtype), left, right, bias) of a checked GEMM's evidence: the same operator
    as in training (linear: F.linear), its operands as left @ right (+ bias) for the bound."""
    kind = payload["kind"]
    if kind == "linear":
        a, w, b = payload["input"], payload["weight"], payload["bias"]
        return (lambda a, w, b: F.linear(a, w, b)), (a, w, b), a, w.T, b
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
    `reproduced` says whether the device gave the wrong value again: a persistent fault), transient
    when they do not (the fault cannot be reproduced to one answer)."""
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
        excess = err - bound
        worst = int(excess.flatten().argmax())
        idx = list(divmod(worst, err.shape[-1])) if err.dim() == 2 else [worst]
        over = int((excess > 0).sum()) + int(err.isnan().sum())
        agree = torch.equal(first, second) and bool((first.isnan() == second.isnan()).all())
        reproduced = torch.equal(first, original)
        evidence = {"max_error": float(err.flatten()[worst]), "bound": float(bound.flatten()[worst]),
                    "elements_over_bound": over, "worst": idx,
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


_INT_VIEWS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
              torch.bfloat16: torch.int16}


def _second_device(device: torch.device) -> torch.device | None:
    """Another accelerator of the same kind, when there is one (CPU evidence has none)."""
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        return torch.device("cuda", (device.index or 0) + 1 if (device.index or 0) + 1 < torch.cuda.device_count()
                            else 0)
    return None
