"""The SDC simulator: a fault injector for tests and the evaluation, never active unless asked.

It is switched on by the environment variable BITGUARD_SDC_SIMULATE holding a JSON spec, in an
online recording only; the spec is written into the manifest (`online.sdc_simulate`) and a loud
line goes to stderr, so no run hides it. It corrupts one nn.Linear's output the way a faulty
device would: intermittently and input-dependently, inside the operator (before any sensor sees
the output), in place and without autograd knowing (the backward pass runs on the corrupted
activations, as it would on a device).

Spec (JSON object; only `module` and one of `bit` / `scale` are required):

    module      dotted path of the nn.Linear to corrupt, as events name it ("blocks.2.mlp.fc")
    bit         flip this bit of the element (float32: 31 sign, 23-30 exponent, 0-22 mantissa;
                16-bit types: 15 sign, ...), or
    scale       add r × the operator's median clean checksum gap (in output units: AEGIS Fig. 16's
                calibrated perturbation): the checksum sensor's statistic (a call's largest
                column-sum gap), measured by the simulator itself on the clean output of every call
                of the module it corrupts, this one included, so that what is injected does not
                depend on which calls the sensor's sampling happened to check
    from_step   first step that may be corrupted (default 0); to_step: end, exclusive (default none)
    rate        probability that an eligible call is corrupted (default 1.0)
    hash_range  [lo, hi): only input rows whose hash (a fraction in [0, 1) of the row's bits) falls
                in it can be hit (default [0, 1]: any row)
    rows        at most this many hit rows corrupted per call (default 1); one element each, its
                column derived from the row's hash
    seed        the simulator's own random generator (default 0; never torch's or Python's)

Every corrupted element is a line of `sdc-injections-rank-R.jsonl` in the run directory (step, the
module, its call in the step, the row of its 2-D output view, column, bit or scale, the values
before and after), written at each step's end: the ground truth detection is scored against.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bitguard.collectors.online.sensor import LinearPatch
from bitguard.errors import BadInput

ENV = "BITGUARD_SDC_SIMULATE"
INJECTIONS_FILE = "sdc-injections-rank-{rank}.jsonl"
_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
        torch.float64: torch.int64}
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass
class Spec:
    module: str
    bit: int | None = None
    scale: float | None = None
    from_step: int = 0
    to_step: int | None = None
    rate: float = 1.0
    hash_range: tuple[float, float] = (0.0, 1.0)
    rows: int = 1
    seed: int = 0


def parse(text: str) -> Spec:
    """The spec of BITGUARD_SDC_SIMULATE; BadInput saying what is wrong."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"{ENV} is not JSON ({exc}); give e.g. '{{\"module\": \"blocks.0.mlp.fc\", \"bit\": 30}}'") from None
    if not isinstance(data, dict):
        raise BadInput(f"{ENV} must be a JSON object, e.g. '{{\"module\": \"blocks.0.mlp.fc\", \"bit\": 30}}'")
    unknown = set(data) - set(Spec.__dataclass_fields__)
    if unknown:
        raise BadInput(f"{ENV}: unknown field(s) {', '.join(sorted(unknown))}; "
                       f"use: {', '.join(Spec.__dataclass_fields__)}")
    if not isinstance(data.get("module"), str) or not data["module"]:
        raise BadInput(f"{ENV}: 'module' must name the nn.Linear to corrupt (its dotted path)")
    if (data.get("bit") is None) == (data.get("scale") is None):
        raise BadInput(f"{ENV}: give exactly one of 'bit' (a bit position to flip) or 'scale' (r x the median gap)")
    if data.get("bit") is not None and (not isinstance(data["bit"], int) or not 0 <= data["bit"] < 64):
        raise BadInput(f"{ENV}: 'bit' must be a bit position 0-63 (float32: 0-31)")
    if data.get("scale") is not None and not isinstance(data["scale"], (int, float)):
        raise BadInput(f"{ENV}: 'scale' must be a number")
    rate = data.get("rate", 1.0)
    if not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise BadInput(f"{ENV}: 'rate' must be a probability in [0, 1]")
    lo_hi = data.get("hash_range", [0.0, 1.0])
    if not (isinstance(lo_hi, list) and len(lo_hi) == 2 and all(isinstance(v, (int, float)) for v in lo_hi)
            and 0 <= lo_hi[0] < lo_hi[1] <= 1):
        raise BadInput(f"{ENV}: 'hash_range' must be [lo, hi) with 0 <= lo < hi <= 1")
    for name in ("from_step", "rows", "seed"):
        if not isinstance(data.get(name, 0), int) or data.get(name, 0) < 0:
            raise BadInput(f"{ENV}: '{name}' must be a non-negative integer")
    if data.get("to_step") is not None and not isinstance(data["to_step"], int):
        raise BadInput(f"{ENV}: 'to_step' must be an integer or null")
    return Spec(**{**data, "hash_range": tuple(float(v) for v in lo_hi),
                   "scale": None if data.get("scale") is None else float(data["scale"]), "rate": float(rate)})


def from_env(out, rank: int) -> "Simulator | None":
    text = os.environ.get(ENV)
    if not text:
        return None
    return Simulator(parse(text), Path(out) / INJECTIONS_FILE.format(rank=rank))


def row_hashes(x2: torch.Tensor) -> torch.Tensor:
    """Each row's hash as a fraction in [0, 1): its elements' bit patterns summed, mixed."""
    ints = x2.contiguous().view(_INT.get(x2.dtype, torch.int32) if x2.dtype in _INT else torch.int32)
    s = ints.to(torch.int64).sum(1)
    mixed = (s * (_GOLDEN & 0x7FFFFFFF)) & 0xFFFFFFFF
    return mixed.double() / 2.0 ** 32


class Simulator:
    def __init__(self, spec: Spec, log_path: Path | None):
        self.spec = spec
        self.log_path = log_path
        self._random = random.Random(spec.seed).random
        self.injected: list[dict] = []  # this step's, until on_step_end writes them
        self.total = 0
        self.skipped = 0
        self._calls = 0
        self._gaps: deque[float] = deque(maxlen=64)  # the corrupted module's clean calls' largest column-sum gaps
        self._patch = None
        self.monitor = None

    def spec_dict(self) -> dict:
        return {**asdict(self.spec), "hash_range": list(self.spec.hash_range)}

    def describe(self) -> str:
        what = f"bit {self.spec.bit}" if self.spec.bit is not None else f"{self.spec.scale:g} x median gap"
        return f"{self.spec.module}: {what}, rate {self.spec.rate:g}, from step {self.spec.from_step}"

    def install(self, monitor) -> None:
        self.monitor = monitor
        if self.log_path is not None:
            self.log_path.write_text("")
        self._patch = LinearPatch(monitor, self.corrupt)
        self._patch.install()

    def remove(self) -> None:
        if self._patch is not None:
            self._patch.remove()
        self.on_step_end(None)

    def corrupt(self, module, x, y) -> None:
        spec = self.spec
        if self.monitor.module_name(module) != spec.module:
            return
        call, self._calls = self._calls, self._calls + 1
        step = self.monitor.step
        if step < spec.from_step or (spec.to_step is not None and step >= spec.to_step):
            return
        if not (spec.rate >= 1 or self._random() < spec.rate) or not y.is_contiguous():
            return
        k, o = module.weight.shape[1], module.weight.shape[0]
        with torch.no_grad():
            x2, y2 = x.detach().reshape(-1, k), y.view(-1, o)
            h = row_hashes(x2)
            hit = ((h >= spec.hash_range[0]) & (h < spec.hash_range[1])).nonzero().flatten()[:spec.rows].tolist()
            if not hit:
                return
            delta = None
            if spec.scale is not None:
                median = self._median_gap(module, x2, y2)
                if not median:
                    self.skipped += 1
                    return
                delta = spec.scale * median
            for row in hit:
                col = int(h[row] * 2.0 ** 32) % o
                before = float(y2[row, col])
                if delta is None:
                    view = y2.view(_INT[y2.dtype])
                    mask = 1 << spec.bit
                    bits = view.element_size() * 8
                    view[row, col] ^= mask - (1 << bits) if mask >= 1 << (bits - 1) else mask
                else:
                    y2[row, col] += delta
                self.injected.append({"step": step, "module": spec.module, "call": call, "row": row, "col": col,
                                      "bit": spec.bit, "scale": spec.scale, "delta": delta, "before": before,
                                      "after": float(y2[row, col]), "hash": float(h[row])})
        self.total += len(hit)

    def _median_gap(self, module, x2: torch.Tensor, y2: torch.Tensor) -> float | None:
        """The median of the module's clean calls' largest raw column-sum gaps so far (this call's,
        before it is corrupted, included); None while every one was zero or not finite."""
        from bitguard.collectors.online.checksum import column_gaps

        bias = None if module.bias is None else module.bias.detach().to(y2.dtype)
        _, raw, _ = column_gaps(y2, x2.to(y2.dtype), module.weight.detach().to(y2.dtype).T, bias)
        worst = float(raw.max()) if raw.size else 0.0
        if math.isfinite(worst) and worst > 0:
            self._gaps.append(worst)
        return statistics.median(self._gaps) if self._gaps else None

    def on_step_end(self, step) -> None:
        self._calls = 0
        if self.injected and self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in self.injected))
        self.injected = []
