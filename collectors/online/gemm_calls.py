"""The checksum sensor's functional GEMMs: `torch.matmul`, `torch.mm`, `torch.bmm`, `torch.addmm`
and the Tensor methods `@`, `.matmul`, `.mm`, `.bmm`, wherever they are called from Python (the
attention's score and value products, transformers' GPT-2 `Conv1D`, which is an addmm, torch's own
Python such as multi-head attention's bmm).

Each is wrapped where it is looked up (the `torch` module attribute, the Tensor class), so only
those calls pay: the wrapper calls the original, then, on the training thread, outside a
torch.compile trace and outside the sensor's own work, hands (call site, operands, output) to the
sensor. An operator is a CALL SITE: the Python line that called it, named `file:line (function)`
(path relative to the working directory when under it); its three budget entries are
`matmul` (the product), `matmul.dgrad` and `matmul.wgrad` (the gradients of its left and right
operands, through a post hook on the output's own MmBackward0 / AddmmBackward0 / BmmBackward0 node,
as for nn.Linear).

What a call is checked as (every element of it, by column sums, as checksum.py says):
- two 2-D operands, or an N-D left operand times a 2-D right one (folded to one 2-D product, as
  matmul does itself): the host's fused pass or torch's, as for nn.Linear; an addmm's bias must be a
  row (shape (q,) or (1, q)) with alpha = beta = 1;
- batched operands (bmm, N-D matmul, broadcast batch dimensions expanded): torch ops in float64,
  per column of each batch's matrix; the worst batch's matrix is judged, and its index goes into
  the alert's evidence (`batch`).
Not checked: 1-D operands (vector products), `out=` calls, an addmm with a full-matrix input or
other alpha / beta, integer and complex dtypes, tensor subclasses (DTensor) and functorch's wrapped
tensors, calls from other threads (a DataLoader's, the verifier's own), calls made by bitguard
itself, `F.linear` outside nn.Linear, and C++ callers (scaled_dot_product_attention's kernels,
`nn.Linear` itself, which checksum.py sees whole).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import weakref
from dataclasses import dataclass

import torch

from bitguard.collectors.online.budget import Countdown

_SKIP = object()  # a call site whose calls are bitguard's own
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # operands whose values are the call's (not DTensor, not a fake)


def targets():
    """(owner, attribute, kind) of every wrapped function; kind: how its arguments read."""
    return [(torch, "matmul", "matmul"), (torch, "mm", "matmul"), (torch, "bmm", "matmul"),
            (torch, "addmm", "addmm"), (torch.Tensor, "__matmul__", "matmul"), (torch.Tensor, "matmul", "matmul"),
            (torch.Tensor, "mm", "matmul"), (torch.Tensor, "bmm", "matmul")]


@dataclass(eq=False)
class CallSite:
    """One Python line that calls a GEMM: its name and its three operators' budget entries."""

    name: str
    owner: object  # a weak reference to the module whose method calls it (or one returning None)
    key: str  # the product's op key
    forward: object  # budget.OpBudget of matmul, matmul.dgrad, matmul.wgrad
    dgrad: object
    wgrad: object
    countdown: Countdown  # the three operators' countdowns to their next checked call
    calls: int = 0  # this step


class GemmPatch:
    """Wraps the functional GEMMs; `callback(site, kind, args, kwargs, out)` runs after each call
    that the sensor may look at, guarded by the monitor. `site(frame)` gives the caller's CallSite
    (or _SKIP: site_finder). Patches stack like LinearPatch's: remove() restores only what is still its own."""

    def __init__(self, monitor, site, callback):
        self.monitor = monitor
        self.site = site
        self.callback = callback
        self.busy = False  # the sensor's own torch work: calls made inside it are not observed
        self._saved: list[tuple] = []

    def install(self) -> None:
        monitor, callback, site_of, patch = self.monitor, self.monitor.guard(self.callback), self.site, self
        is_compiling = torch.compiler.is_compiling
        thread = threading.get_ident()
        getframe, get_ident = sys._getframe, threading.get_ident

        def wrap(original, kind):
            def gemm(*args, **kwargs):
                out = original(*args, **kwargs)
                if monitor.enabled and not is_compiling() and not patch.busy and get_ident() == thread:
                    site = site_of(getframe(1))
                    if site is not _SKIP:
                        callback(site, kind, args, kwargs, out)
                return out

            gemm.__wrapped__ = original
            gemm.__name__ = getattr(original, "__name__", "gemm")
            gemm.__doc__ = getattr(original, "__doc__", None)
            return gemm

        for owner, attribute, kind in targets():
            original, own = getattr(owner, attribute), attribute in vars(owner)
            wrapper = wrap(original, kind)
            setattr(owner, attribute, wrapper)
            self._saved.append((owner, attribute, original, wrapper, own))

    def remove(self) -> None:
        for owner, attribute, original, wrapper, own in reversed(self._saved):
            if getattr(owner, attribute) is wrapper:
                if own:
                    setattr(owner, attribute, original)
                else:  # a method Tensor inherits from TensorBase: inherited again, as before install
                    delattr(owner, attribute)
        self._saved.clear()


@dataclass(frozen=True)
class Family:
    """How a GEMM's backward operators are named and laid out: `prefix` of their op names, and
    whether the weight gradient is reported in nn.Linear's weight layout (W, with y = x·Wᵀ) or in
    the product's right operand's own (B, with y = x·B)."""

    prefix: str
    weight_layout: bool


LINEAR = Family("linear", True)  # nn.Linear: linear.dgrad, linear.wgrad in W's layout
MATMUL = Family("matmul", False)  # torch.matmul and the like: matmul.dgrad, matmul.wgrad in B's layout


def site_finder(make, module_name):
    """A function from a caller's frame to its CallSite, `make(name)` making one the first time, or
    _SKIP for bitguard's own frames; memoised per (code object, line, the caller's module). A call
    from a module's method is named by the module (`module_name(module)`, one site per layer) and
    the line: `blocks.1.attn (model.py:57)`; any other by its line and function: `model.py:57 (attend)`."""
    cache: dict = {}
    cwd = os.getcwd()
    own = _own_folders()
    Module = torch.nn.Module

    def find(frame):
        code = frame.f_code
        owner = frame.f_locals.get("self") if "self" in code.co_varnames[:code.co_argcount] else None
        if not isinstance(owner, Module):
            owner = None
        where = (code, frame.f_lineno, id(owner))
        got = cache.get(where)
        if got is None or (owner is not None and got is not _SKIP and got.owner() is not owner):
            path = os.path.abspath(code.co_filename)
            if path.startswith(own):
                got = _SKIP
            else:
                line = f"{_shown(path, cwd)}:{frame.f_lineno}"
                got = make(f"{module_name(owner)} ({line})" if owner is not None
                           else f"{line} ({getattr(code, 'co_qualname', code.co_name)})",
                           weakref.ref(owner) if owner is not None else _no_owner)
            cache[where] = got
        return got

    return find


def _shown(path: str, cwd: str) -> str:
    """A source file as a user reads it: from its package for an installed one
    (`transformers/pytorch_utils.py`), else relative to the working directory, else its name."""
    installed = path.rpartition(os.sep + "site-packages" + os.sep)[2] if "site-packages" in path else None
    if installed:
        return installed
    return os.path.relpath(path, cwd) if path.startswith(cwd + os.sep) else os.path.basename(path)


def _no_owner():
    return None


def _own_folders() -> tuple[str, ...]:
    """The folders of bitguard's own packages (its checks' and verifier's torch calls are not the training's)."""
    import importlib.util

    folders = []
    for name in ("bitguard", "bitguard.collectors", "bitguard.backend", "bitguard.cuda"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            folders.append(os.path.dirname(os.path.abspath(spec.origin)) + os.sep)
    return tuple(folders)


def operands(kind: str, args: tuple, kwargs: dict, out):
    """(a, b, bias) of a call as a product out = a·b (+ bias), a and b as the call gave them, or
    None when the call is not one the sensor checks (see the module's docstring)."""
    if kwargs.get("out") is not None or type(out) is not torch.Tensor:
        return None
    if kind == "addmm":
        if len(args) != 3 or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
            return None
        bias, a, b = args[0], args[1], args[2]
        if type(bias) not in _PLAIN or not 1 <= bias.dim() <= 2 or bias.shape[-1] != out.shape[-1] \
                or (bias.dim() == 2 and bias.shape[0] != 1):
            return None  # (a full-matrix or scalar input is not a bias the column sums take)
        bias = bias.reshape(-1)
    else:
        if len(args) != 2 or kwargs:
            return None
        (a, b), bias = args, None
    for t in (a, b):
        if type(t) not in _PLAIN or t.dim() < 2 or not t.dtype.is_floating_point or t.device.type == "meta" \
                or _wrapped(t):
            return None
    if not out.dtype.is_floating_point or out.numel() == 0 or a.shape[-1] == 0:
        return None
    return a, b, bias


_IS_WRAPPED = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


def _wrapped(t: torch.Tensor) -> bool:
    """A functorch wrapper (vmap's batched tensor, grad's tracked one): its values are not the call's."""
    return _IS_WRAPPED is not None and bool(_IS_WRAPPED(t))


def as_batches(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
    """(c, a, b) as one 2-D product (N-D left times 2-D right folded: m·rows of a) or as 3-D batches
    (broadcast batch dimensions expanded), or None when the shapes do not read as a product."""
    m, p, q = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.shape[-2] != p or out.shape[-1] != q:
        return None
    if b.dim() == 2:
        if out.numel() != a.numel() // p * q:
            return None
        return out.reshape(-1, q), a.reshape(-1, p), b
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if tuple(out.shape) != (*batch, m, q):
        return None
    return (out.reshape(-1, m, q), a.expand(*batch, m, p).reshape(-1, m, p), b.expand(*batch, p, q).reshape(-1, p, q))


def batched_gaps(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """(normalised gaps, raw gaps, reference), float64 tensors of shape (batches, q), of c[i] = a[i]·b[i]:
    |1ᵀc_i − (1ᵀa_i)·b_i| over ‖a_i‖_F·‖b_i,j‖, every sum in float64 (torch ops on c's device)."""
    lhs = c.sum(1, dtype=torch.float64)
    bd = b.double()
    rhs = torch.bmm(a.sum(1, dtype=torch.float64).unsqueeze(1), bd).squeeze(1)
    scale = torch.linalg.vector_norm(a.reshape(a.shape[0], -1), dim=1, dtype=torch.float64)[:, None] * \
        torch.linalg.vector_norm(bd, dim=1)
    raw = (lhs - rhs).abs()
    return raw / scale.clamp_min(1e-300), raw, rhs


class GemmChecks:
    """The checksum sensor's part for functional GEMMs (mixed into ChecksumSensor: it uses its
    `_check`, `_judged_by`, `_judge`, `_hook_backward`, `_unobserved`, `_charged`, `_state`, `_rescale`,
    `_epoch` and budget; it gives the Linear hook `_passed`). install_gemms() after the Linear patch."""

    def install_gemms(self, monitor) -> None:
        self._sites: list[CallSite] = []
        self.gemm_skipped = 0  # calls of a wrapped function not read as a product (since install)
        self._gemm = GemmPatch(monitor, site_finder(self._site, monitor.module_name), self._on_gemm)
        self._gemm.install()

    def remove_gemms(self) -> None:
        if getattr(self, "_gemm", None) is not None:
            self._gemm.remove()

    def reset_sites(self) -> None:
        for site in getattr(self, "_sites", ()):
            site.calls = 0

    def rescale_sites(self, budget) -> None:
        for site in getattr(self, "_sites", ()):
            site.countdown.rescale(budget)

    def count_passed_sites(self, budget) -> None:
        for site in getattr(self, "_sites", ()):
            site.countdown.count_passed(budget)

    def _passed(self, holder, budget, t0: float) -> bool:
        """The hooks' fast path (`holder` a CallSite or an nn.Linear's ops: a `countdown` and
        `calls`): True when none of its operators is due on this call, which is then counted and its
        time charged as fixed cost. The countdowns are rescaled first when a step's end changed the
        rates."""
        if self._epoch != budget.epoch:
            self._rescale(budget)
        if not holder.countdown.passes():
            return False
        holder.calls += 1
        budget.charge_fixed(budget.clock() - t0)
        return True

    def _site(self, name: str, owner) -> CallSite:
        budget = self.monitor.budget
        entries = tuple(budget.op(self.name, f"{op}:{name}") for op in ("matmul", "matmul.dgrad", "matmul.wgrad"))
        site = CallSite(name, owner, f"matmul:{name}", *entries, Countdown(budget, entries))
        self._sites.append(site)
        return site

    def _on_gemm(self, site: CallSite, kind: str, args: tuple, kwargs: dict, out) -> None:
        """Every wrapped call from the training's Python: the product and its operands' gradients
        (when they will have them) are each checked at their rate, counting down to their next
        checked call as nn.Linear's do (budget.Countdown: a call before any is due reads nothing, and
        is counted as the site's last call looked at); operands touched only for a checked one; the
        call's own time outside its checks is charged as fixed cost."""
        budget = self.monitor.budget
        t0 = budget.clock()
        if self._passed(site, budget, t0):
            return
        got = operands(kind, args, kwargs, out)
        if got is None:
            self.gemm_skipped += 1
            return
        a, b, bias = got
        call = site.calls
        site.calls = call + 1
        backward = out.requires_grad and torch.is_grad_enabled()
        forward, dgrad, wgrad = site.countdown.due(
            budget, 2.0 * out.numel() * a.shape[-1], float(out.numel() + a.numel() + b.numel()),
            (True, backward and a.requires_grad, backward and b.requires_grad))
        self._checks_s = 0.0
        if forward or dgrad or wgrad:
            self._gemm.busy = True
            try:
                self._gemm_checks(site, a, b, bias, out, call, forward, dgrad, wgrad)
            finally:
                self._gemm.busy = False
        budget.charge_fixed(budget.clock() - t0 - self._checks_s)

    def _gemm_checks(self, site: CallSite, a, b, bias, out, call: int, forward: bool, dgrad: bool,
                     wgrad: bool) -> None:
        shaped = as_batches(a.detach(), b.detach(), out.detach())
        if shaped is None:
            self.gemm_skipped += 1
            return
        c, a2, b2 = shaped
        # (under autocast the GEMM ran on the operands cast to the output's dtype: check that product)
        a2, b2 = a2.to(c.dtype), b2.to(c.dtype)
        bias = None if bias is None else bias.detach().to(c.dtype)
        if c.dim() == 2:
            if forward:
                self._check(site.key, site.name, "matmul", c, a2, b2, bias, call)
            if dgrad or wgrad:
                self._hook_backward(site.name, out, a2, b2.T, call, dgrad, wgrad, MATMUL)
            return
        if forward:
            self._check_batched(site.key, site.name, "matmul", c, a2, b2, call, tuple(out.shape[:-2]))
        if dgrad or wgrad:
            self._hook_batched_backward(site.name, out, a2, b2, call, dgrad, wgrad)

    def _check_batched(self, key: str, name: str, op: str, c, a, b, call: int, batch_shape: tuple = ()) -> None:
        """Every element of each batch's c[i] = a[i]·b[i] by its column sums; the worst batch judged
        (its evidence: `batch`, its index among `batches`, and `batch_index`, that index in the
        output's batch dimensions `batch_shape`)."""
        budget = self.monitor.budget
        t0 = budget.clock()
        self._alert_s = 0.0
        state = self._state(key, name, op)
        with torch.no_grad():
            gaps, raw, rhs = batched_gaps(c, a, b)
            self._judged_by(state, a.shape[1], a.shape[2], c, torch.float64)
            worst = int(gaps.nan_to_num(nan=math.inf).flatten().argmax())
            i, j = divmod(worst, gaps.shape[1])
            gap = float(gaps[i, j])
            if math.isfinite(gap) or bool(rhs.isfinite().all()):
                self._judge(state, key, gap, float(raw[i, j]), gaps[i].cpu().numpy(), call, (c[i], a[i], b[i], None, False),
                            extra={"batch": i, "batches": gaps.shape[0], "batch_shape": list(batch_shape),
                                   "batch_index": _unravel(i, batch_shape)})
            else:
                state.nonfinite += 1
        spent = budget.clock() - t0
        budget.charge(self.name, key, spent - self._alert_s, 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2])
        budget.charge_fixed(self._alert_s)
        self._checks_s += spent

    def _hook_batched_backward(self, name: str, y, a, b, call: int, dgrad: bool, wgrad: bool) -> None:
        """dA = g·Bᵀ and dB = Aᵀ·g of a bmm, through a post hook on the output's BmmBackward0 node."""
        from bitguard.collectors.online.checksum import gemm_node

        node = gemm_node(y)
        if node is None or type(node).__name__ != "BmmBackward0":
            self._unobserved(name, "matmul")
            return
        monitor, sensor, handle = self.monitor, self, None

        def post(grad_inputs, grad_outputs):
            handle.remove()
            monitor.guard(sensor._on_batched_backward)(name, grad_inputs[0] if dgrad else None,
                                                       grad_inputs[1] if wgrad else None, grad_outputs[0], a, b, call)

        handle = node.register_hook(post)

    def _on_batched_backward(self, name: str, da, db, g, a, b, call: int) -> None:
        if g is not None:
            self._charged(self._check_batched_backward, name, da, db, g, a, b, call)

    def _check_batched_backward(self, name: str, da, db, g, a, b, call: int) -> None:
        g = g.reshape(a.shape[0], a.shape[1], b.shape[2]).to(a.dtype)
        if da is not None:
            self._check_batched(f"matmul.dgrad:{name}", name, "matmul.dgrad", da, g, b.transpose(1, 2), call,
                                (a.shape[0],))
        if db is not None:
            self._check_batched(f"matmul.wgrad:{name}", name, "matmul.wgrad", db, a.transpose(1, 2), g, call,
                                (a.shape[0],))


def _unravel(i: int, shape: tuple) -> list[int]:
    """The flat batch index i in the batch dimensions `shape` (row-major)."""
    index = []
    for size in reversed(shape or (i + 1,)):
        i, r = divmod(i, size)
        index.append(r)
    return index[::-1]
