"""The deterministic-recompute sensor: where training already runs a region twice (activation
checkpointing, torch.utils.checkpoint), the two runs must agree bit for bit.

A checkpointed region's forward runs once in the forward pass and once more during backward to
rebuild its activations (collectors/recompute.py tells such a call: a module call that starts
with no module call in progress while autograd runs a backward pass, under checkpoint's
recomputation). The modules a recompute starts with (its roots: the checkpointed block, or each
module a checkpointed function calls) are learned from the first recompute they appear in; from
then on a forward call of a root, when the budget allows it, is a region run: the digests
(bitguard.cuda.fingerprint) of the inputs and outputs of every module call in it are kept, by
module and call number within the region. A recompute of the root on the same arguments (found
by their digests) is compared call by call: same inputs, same outputs, bit for bit. A call whose
inputs differ while the module calls before it agreed means something between module calls
(a functional op) differed. Non-reentrant checkpointing stops a recompute once it has rebuilt
what backward needs, so the calls after that point (often the region's last ones) are not
compared. The first step's recomputes have no reference (their roots were not known yet).

A mismatch makes one alert per region run, naming the module, and keeps the minimal evidence:
a deep copy of the root module, its arguments, the RNG state and autocast settings the recompute
ran with. At the step's end, on the training thread, the root is re-run on it twice, then the
alert is raised (so its verification never waits) (the global
RNG saved, set and restored: never from another thread, where it would change what the training
draws). The verifier classifies: *confirmed* when the two re-runs agree with each other (the
evidence says which run they reproduce: the forward, so the recompute was wrong, or not the
forward, so the forward was; a fault persistent on this input, which re-runs on the same device
reproduce, would reverse that), *transient* when they disagree with each other. A root whose
re-runs disagree `FLAKY_LIMIT` times is not bitwise deterministic here and is no longer checked
(said on stderr). A region that draws random numbers (its forward moved the RNG state) is
compared only with a recompute that starts from the RNG state its forward started from:
checkpoint restores it by default; with preserve_rng_state=False the recompute draws other
numbers by design and is not compared.

What it does not see: regions that are not module calls, recomputes outside torch.utils.checkpoint
(another library's, FlashAttention's internal one), and compiled regions (nothing runs while
dynamo traces). On CUDA a checked recompute reads its digests back at once (a sync, charged to the
budget). This module knows nothing of the other sensors.
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map

from bitguard.collectors.compiled import is_compiling
from bitguard.collectors.online.sensor import Alert, Sensor
from bitguard.collectors.recompute import in_backward_pass, recompute_kind
from bitguard.cuda.fingerprint import digest_many, resolve

NAME = "recompute"
MAX_EVIDENCE_BYTES = 256 << 20  # a mismatch's evidence copy (module and inputs) larger than this is not kept
FLAKY_LIMIT = 3  # re-runs that disagree with each other this often: the root is not deterministic here
MAX_RERUNS_PER_STEP = 2
RERUN_WAIT_S = 600.0  # how long a verification waits for the step's end, where its region is re-run  # mismatches re-run at one step's end; the others are verified on their digests only

ORIGINAL, RECOMPUTE = "original", "recompute"


def _tensors(value) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _hex(digests) -> list[str]:
    return [f"{x:016x}:{p:016x}" for x, p in digests]


def _rng_state(inputs) -> tuple:
    """The RNG states a region on these inputs draws from: the CPU generator's, and the CUDA
    generator's of the first CUDA input's device (dropout on CUDA draws there)."""
    cuda = next((t.device.index or 0 for t in inputs if t.is_cuda), None)
    return torch.get_rng_state(), None if cuda is None else (cuda, torch.cuda.get_rng_state(cuda))


def _same_rng(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (
        a[1] is None or (a[1][0] == b[1][0] and torch.equal(a[1][1], b[1][1])))


def _autocast() -> dict:
    out = {}
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                out[device] = torch.get_autocast_dtype(device)
        except (RuntimeError, TypeError, AttributeError):
            continue
    return out


@dataclass
class _Region:
    """One run of a checkpointed region: its root call and what each module call in it saw."""

    kind: str  # ORIGINAL (the forward) or RECOMPUTE (during backward)
    root: torch.nn.Module
    name: str  # the root's module path
    args: tuple  # the root's positional arguments (not copied: the evidence copies them on a mismatch)
    rng: tuple  # RNG states at the root's start
    autocast: dict
    reference: "_Region | None" = None  # a recompute's forward
    calls: dict = field(default_factory=dict)  # (id(module), n-th call of it in the region) -> (in, out digests)
    counts: dict = field(default_factory=dict)  # id(module) -> calls so far
    drew: bool = False  # the forward moved the RNG state (it draws random numbers)
    kwargs: bool = False  # the root was called with keyword arguments (a re-run cannot pass them)
    output: tuple | None = None  # the root's output digests, once it returned
    done: bool = False  # a mismatch was raised: nothing more of this region is compared

    def enter(self, module) -> tuple:
        n = self.counts.get(id(module), 0)
        self.counts[id(module)] = n + 1
        return id(module), n


class RecomputeSensor(Sensor):
    name = NAME

    def __init__(self):
        self.monitor = None
        self._tls = threading.local()
        self._roots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root module -> its name (or None)
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module in a region -> its name
        self._root_names: set[str] = set()  # every root seen (for coverage(), after the model is gone)
        self._regions: dict[tuple, _Region] = {}  # (id(root), its arguments' digests) -> the step's forward runs
        self._handles: list = []
        self._pending: list[tuple] = []  # (alert, payload) of the step's mismatches: re-run, then raised, at its end
        self._calls = self._checked = self._unmatched = self._mismatches = self._rng_not_restored = 0
        self._seconds = 0.0
        self._disabled: set[int] = set()  # id() of roots found not bitwise deterministic here
        self._flaky: dict[int, int] = {}  # id() of a root -> verdicts whose re-runs disagreed

    # -- hooks -------------------------------------------------------------------------------------
    def install(self, monitor) -> None:
        """Wait for the first checkpoint: global module hooks would put every module call of a training
        without one on torch's slow path for nothing. torch.utils.checkpoint's non-reentrant form makes
        a `_checkpoint_hook` in each checkpointed forward, its reentrant form recomputes in
        `CheckpointFunction.backward`: both are class attributes (seen however checkpoint was imported),
        wrapped to install the module hooks on their first call and otherwise call torch's own."""
        self.monitor = monitor
        from torch.utils import checkpoint as cp

        sensor = self
        if not (hasattr(cp, "_checkpoint_hook") and "backward" in vars(getattr(cp, "CheckpointFunction", object))):
            self._patched = []  # a torch without these two: the module hooks from the start, as before
            self._activate()
            return
        hook_init, backward = cp._checkpoint_hook.__init__, cp.CheckpointFunction.backward

        def __init__(self, *args, **kwargs):
            sensor._activate()
            hook_init(self, *args, **kwargs)

        def checkpoint_backward(ctx, *args):
            sensor._activate()
            return backward(ctx, *args)

        __init__.__wrapped__, checkpoint_backward.__wrapped__ = hook_init, backward
        self._patched = [(cp._checkpoint_hook, "__init__", hook_init, __init__),
                         (cp.CheckpointFunction, "backward", cp.CheckpointFunction.__dict__["backward"],
                          staticmethod(checkpoint_backward))]
        for owner, attr, _, new in self._patched:
            setattr(owner, attr, new)

    def _activate(self) -> None:
        """The module hooks, from the first checkpoint on (once)."""
        if self._handles or self.monitor is None or not self.monitor.enabled:
            return
        from torch.nn.modules import module as nn_module

        self._handles.append(nn_module.register_module_forward_pre_hook(self.monitor.guard(self._pre)))
        self._handles.append(nn_module.register_module_forward_hook(self.monitor.guard(self._post), with_kwargs=True,
                                                                    always_call=True))  # the stack stays whole

    def remove(self) -> None:
        for owner, attr, old, new in reversed(getattr(self, "_patched", [])):
            if owner.__dict__.get(attr) is new:
                setattr(owner, attr, old)
        self._patched = []
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._raise_pending()  # a mismatch in the last, unfinished step
        self._regions.clear()

    def _stack(self) -> list:
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def _pre(self, module, args) -> None:
        if is_compiling():
            return
        stack = self._stack()
        parent = stack[-1] if stack else None
        entry = None
        if getattr(self._tls, "rerunning", False):
            pass
        elif parent is not None:  # a module call inside a region being compared
            region = parent[0]
            entry = (region, region.enter(module))
            if region.kind == ORIGINAL and module not in self._names:
                self._names[module] = self.monitor.module_name(module)
        elif not stack and in_backward_pass() and recompute_kind() is not None:
            entry = self._recompute_root(module, args)
        elif module in self._roots and not in_backward_pass() and id(module) not in self._disabled:
            entry = self._forward_root(module, args)
        stack.append(entry)

    def _forward_root(self, module, args) -> tuple | None:
        if self._roots[module] is None:
            self._roots[module] = self._names[module] = self.monitor.module_name(module)  # its real path
            self._root_names.add(self._roots[module])
        name = self._roots[module]
        if not self.monitor.budget.allow(NAME, name):
            self._calls += 1  # a region run not checked (its module calls inside are not counted)
            return None
        t0 = self.monitor.budget.clock()
        arg_tensors = _tensors(args)
        region = _Region(ORIGINAL, module, name, args, _rng_state(arg_tensors), {})
        self._regions[(id(module), tuple(resolve(digest_many(arg_tensors))))] = region
        self._charge(name, t0)
        return region, region.enter(module)

    def _recompute_root(self, module, args) -> tuple | None:
        if module not in self._roots:
            self._roots[module] = None  # learned: its forward calls are watched from now on
            return None
        t0 = self.monitor.budget.clock()
        arg_tensors = _tensors(args)
        forward = self._regions.pop((id(module), tuple(resolve(digest_many(arg_tensors)))), None)
        rng = _rng_state(arg_tensors)
        entry = None
        if forward is None:
            self._unmatched += 1  # its forward was not sampled, or ran on other arguments
        elif forward.drew and not _same_rng(forward.rng, rng):
            self._rng_not_restored += 1  # preserve_rng_state=False: other random numbers by design
        else:
            region = _Region(RECOMPUTE, module, forward.name, args, rng, _autocast(), reference=forward)
            entry = (region, region.enter(module))
        self._charge(self._roots[module] or type(module).__name__, t0)
        return entry

    def _post(self, module, args, *rest) -> None:
        """(module, args, kwargs, output); (module, args, None) when the call raised (torch calls an
        always_call hook so then), e.g. checkpoint stopping a recompute once it has what it needs."""
        if is_compiling():
            return
        stack = self._stack()
        entry = stack.pop() if stack else None
        if entry is None or len(rest) != 2:
            return
        region, key = entry
        if region.done:
            return
        kwargs, output = rest
        t0 = self.monitor.budget.clock()
        inputs = _tensors((args, kwargs))
        digests = resolve(digest_many(inputs + _tensors(output)))
        seen = (tuple(digests[:len(inputs)]), tuple(digests[len(inputs):]))
        if module is region.root and key[1] == 0:
            region.output = seen[1]
            region.kwargs = bool(kwargs)
            if region.kind == ORIGINAL:
                region.drew = not _same_rng(region.rng, _rng_state(inputs))
        if region.kind == ORIGINAL:
            region.calls[key] = seen
            self._calls += 1
        else:
            reference = region.reference.calls.get(key)
            if reference is None:
                self._unmatched += 1
            else:
                self._checked += 1
                if seen != reference:
                    self._mismatch(module, region, "inputs" if seen[0] != reference[0] else "outputs",
                                   reference, seen)
        self._charge(region.name, t0)

    def _charge(self, name: str, t0: float) -> None:
        seconds = self.monitor.budget.clock() - t0
        self._seconds += seconds
        self.monitor.budget.charge(NAME, name, seconds)

    # -- a mismatch ----------------------------------------------------------------------------------
    def _mismatch(self, module, region: _Region, what: str, forward: tuple, recompute: tuple) -> None:
        """Raise the region's alert (one per region run) and keep what its re-run needs."""
        region.done = True
        self._mismatches += 1
        name = self._names.get(module) or type(module).__name__
        side = 0 if what == "inputs" else 1
        differing = [i for i, (a, b) in enumerate(zip(forward[side], recompute[side])) if a != b]
        where = (f"the inputs of {name} differ from its forward's (something between the module calls of "
                 f"{region.name} computed another value)" if what == "inputs" else
                 f"the output of {name} differs from its forward's on the same inputs")
        evidence = {"summary": f"recompute of {region.name}: {where}", "region": region.name, "module": name,
                    "module_type": type(module).__name__, "differs": what, "tensors": differing,
                    "forward": _hex(forward[side]), "recompute": _hex(recompute[side])}
        rerun = None
        root = region.root
        size = sum(t.numel() * t.element_size() for t in _tensors(region.args) + list(root.parameters()))
        if region.reference.kwargs:
            evidence["not_rerun"] = "the region's root takes keyword arguments, which its hooks do not see"
        elif size > MAX_EVIDENCE_BYTES:
            evidence["not_rerun"] = f"the evidence ({size:,} bytes) is over the {MAX_EVIDENCE_BYTES:,}-byte cap"
        elif len(self._pending) >= MAX_RERUNS_PER_STEP:
            evidence["not_rerun"] = f"more than {MAX_RERUNS_PER_STEP} mismatches in one step"
        else:
            try:
                with torch.no_grad():
                    rerun = {"module": copy.deepcopy(root), "rng": region.rng, "autocast": region.autocast,
                             "args": tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                                              region.args)}
            except Exception as exc:  # noqa: BLE001 - a module that cannot be copied is verified on digests
                evidence["not_rerun"] = f"the region's root could not be copied ({type(exc).__name__}: {exc})"
        payload = {"forward": region.reference.output, "rerun": rerun, "reruns": None, "root": id(root),
                   "name": region.name}
        # raised at the step's end, once its region was re-run: the verifier never waits for the step
        self._pending.append((Alert(NAME, name, "recompute", "alert", evidence), payload))

    def on_step_end(self, step: int) -> None:
        """Re-run the step's mismatched regions on their evidence (on the training thread: the global
        RNG is set for them and restored), raise their alerts, drop the step's unmatched forward runs."""
        t0 = self.monitor.budget.clock()
        if self._raise_pending():
            self.monitor.budget.charge_fixed(self.monitor.budget.clock() - t0)
        self._regions.clear()

    def _raise_pending(self) -> int:
        pending, self._pending = self._pending, []
        for alert, payload in pending:
            if payload["rerun"] is not None and len([p for _, p in pending if p["reruns"]]) < MAX_RERUNS_PER_STEP:
                try:
                    payload["reruns"] = [self._rerun(payload["rerun"]) for _ in range(2)]
                except Exception as exc:  # noqa: BLE001 - the verdict says so; the training goes on
                    payload["rerun_error"] = f"{type(exc).__name__}: {exc}"
            elif payload["rerun"] is not None:
                alert.evidence["not_rerun"] = f"more than {MAX_RERUNS_PER_STEP} mismatches in one step"
            payload["rerun"] = None  # the copies go
            self.monitor.raise_alert(alert, payload=payload)
        return len(pending)

    def _rerun(self, rerun: dict) -> tuple:
        self._tls.rerunning = True
        cpu, cuda = rerun["rng"]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[cuda[0]] if cuda else []):
                torch.set_rng_state(cpu)
                if cuda:
                    torch.cuda.set_rng_state(cuda[1], cuda[0])
                with _autocast_as(rerun["autocast"]):
                    out = rerun["module"](*rerun["args"])
                return tuple(resolve(digest_many(_tensors(out))))
        finally:
            self._tls.rerunning = False

    def verify(self, task) -> tuple[str, dict]:
        """Two re-runs of the region on its saved evidence against the forward's output."""
        p = task.payload
        if p["reruns"] is None:
            why = p.get("rerun_error") or "the alert's evidence says why"
            return "transient", {"summary": f"not re-run ({why}): the forward and its recompute differ bitwise; "
                                            f"which of them was wrong is not known"}
        first, second = p["reruns"]
        if first != second:
            p["flaky"] = True
            return "transient", {"summary": "two re-runs of the region on the saved evidence disagree with each "
                                            "other: the fault did not come back to one answer, or the region is not "
                                            "bitwise deterministic here", "reruns": [_hex(r) for r in p["reruns"]]}
        caveat = ("re-runs on the same device reproduce a fault that is persistent on this input: then the other "
                  "run was the right one")
        if first == p["forward"]:
            return "confirmed", {"summary": "the re-runs reproduce the forward: the recompute during backward "
                                            "computed a wrong value", "wrong": "recompute", "unless": caveat}
        return "confirmed", {"summary": "the re-runs agree with each other, not with the forward: the forward "
                                        "computed a wrong value", "wrong": "forward", "rerun": _hex(first),
                             "forward": _hex(p["forward"] or ()), "unless": caveat}

    def on_verdict(self, task, verdict: str) -> None:
        if task.payload.get("flaky"):
            root = task.payload["root"]
            self._flaky[root] = self._flaky.get(root, 0) + 1
            if self._flaky[root] == FLAKY_LIMIT:
                self._disabled.add(root)
                print(f"bitguard: online recompute: {task.payload['name']} re-ran differently {FLAKY_LIMIT} times "
                      f"on the same evidence: it is not bitwise deterministic here and is no longer checked",
                      file=getattr(self.monitor, "_out", None))

    def stats(self) -> list[dict]:
        rows = [{"sensor": NAME, "op": None, "calls": self._calls, "checked": self._checked,
                 "rate": None, "seconds": self._seconds, "flops_seen": None, "flops_checked": None,
                 "threshold": None}]
        self._calls = self._checked = self._unmatched = self._mismatches = self._rng_not_restored = 0
        self._seconds = 0.0
        return rows

    def coverage(self) -> dict:
        return {"sees": "every module call inside a checkpointed region (torch.utils.checkpoint) that its "
                        "recompute runs: inputs and outputs against the forward's",
                "not": "regions whose root is not a module call, the first step (roots not learned yet), other "
                       "libraries' recomputes, compiled regions",
                "roots": sorted(self._root_names)}


class _autocast_as:
    """Enter the autocast settings a recompute ran under (device -> dtype), nothing else."""

    def __init__(self, settings: dict):
        self._contexts = [torch.autocast(device, dtype=dtype) for device, dtype in settings.items()]

    def __enter__(self):
        for c in self._contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self._contexts):
            c.__exit__(*exc)
