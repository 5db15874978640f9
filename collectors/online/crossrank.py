"""The cross-rank sensor: what data parallelism keeps alike on every rank must be bitwise alike.

After the backward pass, a DistributedDataParallel module's gradients are what its all-reduce
delivered: the same bytes on every rank of its process group. After the optimizer step its
parameters (all of them, each a replica) are the same bytes on every rank too, as long as every
replica applied the same update to the same values. So at the optimizer step pre hook the
gradients' digests are taken, at the step's end the parameters' (bitguard.cuda.fingerprint),
and the ranks exchange them in one all_gather of a small int64 tensor over a gloo group of its
own, created when the first step ends with torch.distributed initialised: the training's
collectives, their order and their numbers are left alone. A parameter whose digests differ
across its group is a replica divergence (BLOOM's), named on the step it starts: the ranks outside
a strict majority are named; with no majority (two ranks) every rank of the tie is, and the
evidence says which is wrong is not known. The alert is raised on each named rank, once per
divergence (a diverged replica stays diverged: later steps are not new alerts), as `replica`
(parameters) or `allreduce` (gradients: the reduced values disagree, the collective or what came
after it on one rank).

The verifier re-reads the suspect rank's copies of the differing tensors (copied at raise time)
twice: confirmed when both reads give the digest the rank exchanged (the replica holds other bytes
than its group's majority, or than the other side of a tie), cleared when they give the majority's
digest (the first read was wrong), transient when the two reads disagree.

The same exchange carries each rank's largest normalised checksum gap of the step per operator
kind (from the checksum sensor, when it runs): a rank whose gap is over OUTLIER times the P90 of
the other ranks' is a *warning* (AEGIS §5.4), never confirmed.

Every rank takes part in every exchange, at the same steps (a stride every rank agrees on, the
largest any rank's budget asks for, carried in the exchange itself), so no rank waits in a
collective the others skip; a rank whose digests failed sends a marker instead. Not supported:
parameters sharded across ranks (FSDP1/2's, tensor parallelism's DTensors): they are not
replicas, their ranks' bytes differ by design; they are left out and said so once, rather than
false alarms. Buffers are not compared. A training that changes a replica's gradients on one rank
on purpose (per-rank scaling) is a false alarm here. This module knows nothing of how the other
sensors work beyond the checksum sensor's per-check gap.
"""

from __future__ import annotations

import functools
import gc
import math
import struct
import sys
import warnings
import weakref
from collections import Counter
from datetime import timedelta

import torch

from bitguard.collectors.online.sensor import Alert, Sensor
from bitguard.cuda.fingerprint import digest_many, resolve

NAME = "crossrank"
GAP_OPS = ("linear", "linear.dgrad", "linear.wgrad")  # checksum operator kinds whose gaps are compared
OUTLIER = 1e3  # a rank's gap over this many times the P90 of the others' is a warning
MAX_COPY_BYTES = 64 << 20  # evidence copies of the differing tensors (the first ones, up to this size)
MAX_NAMED = 10  # differing parameters named in the evidence
SHARE = 0.5  # of the budget, what the exchanges may take (the rest is the other sensors')
EMA = 0.3  # weight of the latest exchange in its cost estimate
TIMEOUT = timedelta(seconds=300)  # the side group's: a rank that never comes fails the exchange, never hangs
_HEADER = 4  # step, status, stride proposal, parameter count
GRADS_MISSING, PARAMS_MISSING = 1, 2  # status bits: a rank sends markers instead of these digests


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _unsigned(s: int) -> int:
    return s + (1 << 64) if s < 0 else s


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", i))[0]


def verdict_of(group: list[int], values: dict[int, object]) -> tuple[list[int], object, bool]:
    """(suspect ranks, the majority's value or None, whether a strict majority exists) of one
    tensor's digests on the ranks of `group`; no suspects when they all agree."""
    counts = Counter(values[r] for r in group)
    if len(counts) <= 1:
        return [], next(iter(counts), None), True
    value, n = counts.most_common(1)[0]
    if n * 2 > len(group):
        return [r for r in group if values[r] != value], value, True
    return list(group), None, False  # a tie: which side is wrong is not known


def p90(values: list[float]) -> float | None:
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return None
    return finite[min(len(finite) - 1, math.ceil(0.9 * len(finite)) - 1)]


class CrossRankSensor(Sensor):
    name = NAME

    def __init__(self, outlier: float = OUTLIER):
        self.outlier = outlier
        self.monitor = None
        self._ddps: weakref.WeakSet = weakref.WeakSet()
        self._patched: list = []
        self._handles: list = []
        self._ready = False  # the side group and the replicated parameters are known
        self._off: str | None = None  # why the sensor does nothing (one process, not supported, failed)
        self._group = None  # the gloo side group (every rank)
        self._params: list[tuple[str, torch.nn.Parameter]] = []
        self._dp: list[int] = []  # this rank's data-parallel group, as global ranks
        self._rank = 0
        self._world = 1
        self._next = 0  # next step with an exchange
        self._last = -1  # the last step with one
        self._since = 0  # first step the current exchange covers (a stride over 1 leaves steps between)
        self._stride = 1
        self._cost: float | None = None  # seconds one exchange costs (gradient digests included), averaged
        self._pre_s = 0.0  # this step's gradient digests
        self._grads = None  # this step's gradient digests (at the optimizer step pre hook)
        self._gaps: dict[str, float] = {}  # op kind -> the step's largest normalised checksum gap
        self._open: dict[str, tuple] = {}  # kind -> (differing names, suspects) of a divergence still on
        self._warned: dict[str, int] = {}  # gap op -> step of its last outlier warning
        self._unsupported: list[str] = []
        self._calls = self._checked = 0
        self._seconds = 0.0
        self._exchanges = 0

    # -- installation ------------------------------------------------------------------------------
    def install(self, monitor) -> None:
        self.monitor = monitor
        try:
            from torch.nn.parallel import DistributedDataParallel as DDP
        except Exception:  # noqa: BLE001 - no distributed build: nothing to compare
            DDP = None
        if DDP is not None:
            init, seen = DDP.__init__, self._ddps

            @functools.wraps(init)
            def __init__(ddp, *args, **kwargs):
                init(ddp, *args, **kwargs)
                seen.add(ddp)

            DDP.__init__ = __init__
            self._patched.append((DDP, "__init__", init))
        from torch.optim import optimizer as optim

        self._handles.append(optim.register_optimizer_step_pre_hook(monitor.guard(self._step_pre)))
        checksum = monitor.sensor("checksum") if hasattr(monitor, "sensor") else None
        if checksum is not None and hasattr(checksum, "_judge"):
            self._watch_gaps(checksum)

    def _watch_gaps(self, checksum) -> None:
        """Keep the step's largest normalised gap per operator kind of the checksum sensor's checks."""
        judge, gaps = checksum._judge, self._gaps

        @functools.wraps(judge)
        def watched(state, key, gap, *args, **kwargs):
            if isinstance(gap, float) and gap == gap and gap > gaps.get(state.op, -1.0):
                gaps[state.op] = gap
            return judge(state, key, gap, *args, **kwargs)

        checksum._judge = watched
        self._patched.append((checksum, "_judge", None))

    def remove(self) -> None:
        for owner, name, old in reversed(self._patched):
            if old is None:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, old)
        self._patched.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- setup at the first step's end -------------------------------------------------------------
    def _setup(self) -> None:
        import torch.distributed as dist

        self._ready = True
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            self._off = "one process: no replicas to compare"
            return
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._group = dist.new_group(backend="gloo", timeout=TIMEOUT)  # every rank, at this step's end
        ddps, self._unsupported = _scan()
        ddps = list(self._ddps) or ddps
        groups = set()
        for ddp in ddps:
            ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
            for name, p in ddp.module.named_parameters():
                if name in ignored or name.startswith(tuple(i + "." for i in ignored)):
                    continue
                if type(p) not in (torch.nn.Parameter, torch.Tensor):  # a DTensor (tensor parallelism)
                    self._unsupported.append(f"{name}: a {type(p).__name__} parameter (sharded)")
                    continue
                self._params.append((name, p))
            groups.add(tuple(dist.get_process_group_ranks(ddp.process_group)))
        self._dp = list(groups.pop()) if len(groups) == 1 else list(range(self._world))
        if len(groups) > 0:
            self._unsupported.append("DDP modules on different process groups: compared over the whole world")
        counts = self._gather(torch.tensor([len(self._params), len(self._dp)], dtype=torch.int64))
        if len({tuple(c) for c in counts}) != 1:
            self._off = "the ranks hold different numbers of DDP parameters: not compared"
        elif not self._params:
            self._off = "no DistributedDataParallel module found: no replicas to compare"
        if self._unsupported:
            print(f"bitguard: online crossrank: not supported, left out (parameters sharded across ranks are not "
                  f"replicas): {'; '.join(self._unsupported[:3])}", file=getattr(self.monitor, "_out", sys.stderr))

    def _gather(self, t: torch.Tensor) -> list[list[int]]:
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(self._world)]
        dist.all_gather(out, t, group=self._group)
        return [o.tolist() for o in out]

    # -- digests -----------------------------------------------------------------------------------
    def _exchanging(self) -> bool:
        return self._ready and self._off is None and self.monitor.step >= self._next

    def _step_pre(self, optimizer, args, kwargs) -> None:
        if self._grads is not None or not self._exchanging():
            return
        t0 = self.monitor.budget.clock()
        self._grads = self._digests([p.grad for _, p in self._params])
        self._pre_s = self._charge(t0)

    def _digests(self, tensors) -> list[tuple[int, int]] | None:
        """(xor, pos) of each tensor ((0, 0) for None), or None when digesting failed."""
        try:
            present = [t for t in tensors if isinstance(t, torch.Tensor)]
            answers = iter(resolve(digest_many([t.detach() for t in present])))
            return [next(answers) if isinstance(t, torch.Tensor) else (0, 0) for t in tensors]
        except Exception as exc:  # noqa: BLE001 - the exchange goes on with a marker: no rank waits
            self.monitor._fail("crossrank digests", exc)
            return None

    def _charge(self, t0: float) -> float:
        seconds = self.monitor.budget.clock() - t0
        self._seconds += seconds
        self.monitor.budget.charge(NAME, "exchange", seconds)
        return seconds

    # -- the exchange at the step's end ------------------------------------------------------------
    def on_step_end(self, step: int) -> None:
        if not self._ready:
            self._setup()
        gaps, self._gaps = dict(self._gaps), {}
        if not self._exchanging():
            self._grads = None
            return
        t0 = self.monitor.budget.clock()
        entry = self.monitor.budget.op(NAME, "exchange")
        entry.calls += 1
        entry.checked += 1
        n = len(self._params)
        grads, self._grads = self._grads, None
        params = self._digests([p for _, p in self._params])
        status = (GRADS_MISSING if grads is None or len(grads) != n else 0) | (PARAMS_MISSING if params is None else 0)
        words = [step, status, self._proposal(), n]
        for digests, missing in ((grads, status & GRADS_MISSING), (params, status & PARAMS_MISSING)):
            for x, p in (digests if not missing else [(0, 0)] * n):
                words += [_signed(x), _signed(p)]
        words += [_float_bits(gaps.get(op, math.nan)) for op in GAP_OPS]
        try:
            rows = self._gather(torch.tensor(words, dtype=torch.int64))
        except Exception as exc:  # noqa: BLE001 - a rank that never came: stop exchanging, on every rank alike
            self._off = f"an exchange failed ({type(exc).__name__}: {exc})"
            raise
        self._exchanges += 1
        self._since = self._last + 1
        self._last = step
        self._stride = max(r[2] for r in rows)
        self._next = step + self._stride
        self._calls += 2 * n
        missing = 0
        for r in self._dp:
            missing |= rows[r][1]
        self._checked += n * ((not missing & GRADS_MISSING) + (not missing & PARAMS_MISSING))
        self._compare(step, rows, grads, params, missing)
        self._outliers(step, rows)
        cost = self._charge(t0) + self._pre_s
        self._pre_s = 0.0
        if self._exchanges > 1:  # the first one also connects the side group: not what exchanges cost
            self._cost = cost if self._cost is None else (1 - EMA) * self._cost + EMA * cost

    def _proposal(self) -> int:
        """The stride this rank's budget asks for: one exchange every k steps, k such that one
        exchange's measured cost (an average over exchanges) spread over k steps stays within
        SHARE of the budget of the last step's time; k at most doubles from one exchange to the next."""
        step_s = self.monitor.budget.last_step_s
        if not step_s or self._cost is None:
            return self._stride
        allowance = SHARE * self.monitor.budget.fraction * step_s
        wanted = math.ceil(self._cost / allowance) if allowance > 0 else 1024
        return max(1, min(1024, 2 * self._stride, wanted))  # at most doubling from one exchange to the next

    def _compare(self, step: int, rows: list[list[int]], grads, params, missing: int) -> None:
        n = len(self._params)
        for kind, op, base, mine, flag in (("grads", "allreduce", _HEADER, grads, GRADS_MISSING),
                                           ("params", "replica", _HEADER + 2 * n, params, PARAMS_MISSING)):
            if missing & flag:  # a rank has no digests of this kind this step (the first step's gradients)
                continue
            differing, suspects, majority_of, tie = [], set(), {}, False
            for i in range(n):
                values = {r: (rows[r][base + 2 * i], rows[r][base + 2 * i + 1]) for r in self._dp}
                named, majority, strict = verdict_of(self._dp, values)
                if named:
                    differing.append(i)
                    suspects.update(named)
                    majority_of[i] = majority
                    tie = tie or not strict
            if not differing:
                self._open.pop(kind, None)
                continue
            key = (tuple(differing), tuple(sorted(suspects)))
            previous = self._open.get(kind)
            self._open[kind] = key
            if previous is not None and set(previous[0]) >= set(differing) and previous[1] == key[1]:
                continue  # the divergence already raised goes on
            if self._rank in suspects:
                self._raise(step, kind, op, rows, base, differing, sorted(suspects), majority_of, tie, mine)

    def _raise(self, step, kind, op, rows, base, differing, suspects, majority_of, tie, mine) -> None:
        names = [self._params[i][0] for i in differing]
        first = differing[0]
        digests = {str(r): f"{_unsigned(rows[r][base + 2 * first]):016x}:{_unsigned(rows[r][base + 2 * first + 1]):016x}"
                   for r in self._dp}
        what = "reduced gradients" if kind == "grads" else "parameters"
        if tie:
            whom = (f"ranks {', '.join(map(str, suspects))} disagree with no majority (group "
                    f"{','.join(map(str, self._dp))}): which replica is wrong is not known")
        else:
            whom = f"rank(s) {', '.join(map(str, suspects))} differ from the majority of group " \
                   f"{','.join(map(str, self._dp))}"
        evidence = {"summary": f"{what} of {len(names)} replicated parameter(s) differ across ranks: {whom}",
                    "kind": kind, "group": self._dp, "suspects": suspects, "majority": not tie,
                    "count": len(names), "params": names[:MAX_NAMED], "digests": digests,
                    "since_step": self._since}
        if self._since < step:
            evidence["summary"] += f" (it started in steps {self._since} to {step}: exchanges every {self._stride})"
        copies, size = [], 0
        for i in differing:
            _, p = self._params[i]
            t = p.grad if kind == "grads" else p
            if not isinstance(t, torch.Tensor) or size + t.numel() * t.element_size() > MAX_COPY_BYTES:
                break
            copies.append((i, t.detach().clone()))
            size += t.numel() * t.element_size()
        payload = {"copies": copies, "own": {i: mine[i] for i, _ in copies},
                   "majority": {i: majority_of[i] for i, _ in copies}, "tie": tie}
        self.monitor.raise_alert(Alert(NAME, names[0], op, "alert", evidence), payload=payload)

    def _outliers(self, step: int, rows: list[list[int]]) -> None:
        n = len(self._params)
        base = _HEADER + 4 * n
        for j, op in enumerate(GAP_OPS):
            gaps = {r: _bits_float(rows[r][base + j]) for r in self._dp}
            mine = gaps[self._rank]
            others = p90([g for r, g in gaps.items() if r != self._rank])
            if not math.isfinite(mine) or not others or mine <= self.outlier * others:
                continue
            if step - self._warned.get(op, -(1 << 30)) < 100:
                continue  # one warning per operator kind per 100 steps
            self._warned[op] = step
            evidence = {"summary": f"checksum gap {mine:.2e} of {op} is {mine / others:.2e}× the P90 of the other "
                                   f"ranks' ({others:.2e})", "gap": mine, "p90_others": others,
                        "ratio": mine / others, "gaps": {str(r): g for r, g in gaps.items()}}
            self.monitor.raise_alert(Alert(NAME, f"checksum {op}", op, "warning", evidence, threshold=self.outlier))

    # -- verification ------------------------------------------------------------------------------
    def verify(self, task) -> tuple[str, dict]:
        p = task.payload
        if not p["copies"]:
            return "transient", {"summary": "no copy kept (the tensors are over the evidence cap): the digests "
                                            "exchanged differ, which cannot be read again"}
        first = [resolve(digest_many([t]))[0] for _, t in p["copies"]]
        second = [resolve(digest_many([t]))[0] for _, t in p["copies"]]
        if first != second:
            return "transient", {"summary": "the copy reads differently twice (memory that does not hold)"}
        own = [p["own"][i] for i, _ in p["copies"]]
        if first == own:
            who = "the other side of a tie" if p["tie"] else "its group's majority"
            return "confirmed", {"summary": f"this replica holds other bytes than {who}: read again, the same "
                                            f"digest", "persistent": True}
        if not p["tie"] and first == [p["majority"][i] for i, _ in p["copies"]]:
            return "cleared", {"summary": "read again, this replica holds the majority's bytes: the first digest "
                                          "misread them"}
        return "transient", {"summary": "read again, the copy gives another digest than the one exchanged"}

    def stats(self) -> list[dict]:
        rows = [{"sensor": NAME, "op": None, "calls": self._calls, "checked": self._checked,
                 "rate": 1.0 / self._stride if self._off is None and self._ready else None,
                 "seconds": self._seconds, "flops_seen": None, "flops_checked": None, "threshold": None}]
        self._calls = self._checked = 0
        self._seconds = 0.0
        return rows if self._ready and self._off is None else []

    def coverage(self) -> dict:
        return {"sees": "DistributedDataParallel modules' reduced gradients (at the optimizer step) and "
                        "parameters (after it), across their data-parallel group; checksum gap outliers",
                "not": "sharded parameters (FSDP, tensor parallelism), buffers, one-process runs",
                "off": self._off, "unsupported": self._unsupported[:20], "params": len(self._params),
                "group": self._dp, "exchanges": self._exchanges, "stride": self._stride}


def _scan() -> tuple[list, list[str]]:
    """The DistributedDataParallel modules alive in the process (made before the sensor was
    installed) and what is sharded across ranks (not supported): FSDP1 and FSDP2 modules. One
    pass over the garbage collector's objects, once, at the first step's end."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    fsdp = sys.modules.get("torch.distributed.fsdp")
    sharded = [(label, cls) for label, cls in (("FSDP", getattr(fsdp, "FullyShardedDataParallel", None)),
                                               ("fully_shard", getattr(fsdp, "FSDPModule", None))) if cls is not None]
    ddps, found = [], set()
    with warnings.catch_warnings():  # isinstance() on some objects (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        for o in objects:
            if isinstance(o, DDP):
                ddps.append(o)
            for label, cls in sharded:
                if isinstance(o, cls):
                    found.add(label)
    return ddps, [f"{label} modules (parameters sharded across ranks)" for label in sorted(found)]
