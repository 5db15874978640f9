"""The values a training reads out of its tensors: an evaluation's loss or accuracy, a logged metric,
predictions turned into NumPy. No module boundary and no gradient carries them, so a change only in
what the code makes of a model's outputs (a metric's averaging, predictions post-processed) left
every recorded tensor equal and compared identical (helper 33). Each becomes a `read` row of
`api_events`, its value a computed field (backend/api_diff.py): runs whose tensors all match and
whose reads differ are inconclusive (`computed`), not identical.

`Reads(recorder)` wraps, while a recording runs, `torch.Tensor.item`, `__float__`, `__int__`,
`__format__` (an f-string's text: its own `item` call is torch's), `tolist`, `numpy`, `__array__`
(NumPy's way in), `__repr__` (a tensor printed or logged as text: helper 44), `__bool__` and
`__index__` (a condition or an index taken from a tensor: `if acc > best:`, `range(n)`) and
`equal` and `allclose` (as methods and as torch's functions: a Python bool; helper 46): a read made
on the main thread by code outside torch's and bitguard's folders (Adam reads each parameter's step
count with `.item()`: not a row), or by torch's TensorBoard writer (what the user logs with
`add_scalar`), is a row, a number as it is, many numbers as the digests of the tensor read, taken
at once, before its memory changes. And each torchmetrics `Metric.compute()`'s value (Lightning
computes and logs it, so no user code reads it): the wrapper torchmetrics puts around every
metric's `compute` at its construction is wrapped again, once torchmetrics is imported. The first
`MAX_READS` a step; a thread's reads other than the main one's are not rows (they interleave
differently from run to run). A warning torch gives on a read by the training's code is
the reader's line's, as without the wrapper: the read is called as a line of the reader's code
(`_at`), python's warning filters untouched (swapping them for each read made a warning shown once a
place show again after every read, and took other threads' warnings). Knows nothing of how rows are stored.
"""

from __future__ import annotations

import functools
import importlib.util
import linecache
import os
import re
import sys
import threading
import types

import torch

from bitguard.collectors.compiled import is_compiling, jit_tracing
from bitguard.collectors.patching import Patch
from bitguard.collectors.saved import AfterImport
from bitguard.cuda.fingerprint import digest_async, resolve
from bitguard.timed import clock_of
from bitguard.tracebacks import READ_CALL

# Tensor methods read (`__repr__`: `print(t)`, `str(t)`, logging's `%s`, what a metric logged as a tensor shows)
METHODS = ("item", "__float__", "__int__", "__format__", "tolist", "numpy", "__array__", "__repr__",
           # a value a branch or an index is taken from (`if acc > best:`, `range(n)`), and comparisons
           # that answer a Python bool (helper 46: an evaluation read only these compared identical)
           "__bool__", "__index__", "equal", "allclose")
FUNCTIONS = ("equal", "allclose")  # the same reads as torch's functions: `torch.equal(a, b)`
MANY = ("tolist", "numpy", "__array__", "__repr__")  # reads of many numbers: their digests
MAX_READS = 1024  # `read` rows a step at most
_ASSIGNED = re.compile(r"\s*([A-Za-z_][\w.]*)\s*(?::[^=]+)?=(?!=)")  # a line's assignment target (`_time_at`)
METRICS = "torchmetrics.metric"  # the module whose Metric wraps each instance's compute
# whose reads are not rows: torch's own (Adam reads its step count), bitguard's (its packages, wherever installed)
_OWN_CODE = tuple(dict.fromkeys(os.path.join(folder, "") for name in ("torch", "bitguard", "bitguard.collectors",
                                                                      "bitguard.backend", "bitguard.cuda")
                                for folder in importlib.util.find_spec(name).submodule_search_locations))
# but what torch's TensorBoard writer reads is what the user logs (`writer.add_scalar("loss", loss)`)
_LOGGED = tuple(os.path.join(folder, "utils", "tensorboard", "")
                for folder in importlib.util.find_spec("torch").submodule_search_locations)


# a call made as a line of the caller's code: a warning (or error) torch gives in `original` names the
# reader's file, line, module and once-per-line registry, as without the wrapper (tracebacks.py leaves it out)
_CALL = lambda original, args, kwargs: original(*args, **kwargs)  # noqa: E731 - one line: its code is the line's
_AT_LINE: dict = {}  # (caller's code, line) -> the call as that line's
_AT_LINE_MAX = 4096  # (a notebook's cells are new code each time: beyond this, made for each read)


def _at(caller):
    """`_CALL` as made by line `caller.f_lineno` of the caller's code, in the caller's globals."""
    key = (caller.f_code, caller.f_lineno)
    call = _AT_LINE.get(key)
    if call is None:
        code = _CALL.__code__.replace(co_filename=caller.f_code.co_filename, co_firstlineno=caller.f_lineno,
                                      co_name=READ_CALL, co_qualname=READ_CALL)
        call = types.FunctionType(code, caller.f_globals, READ_CALL)
        if len(_AT_LINE) < _AT_LINE_MAX:
            _AT_LINE[key] = call
    return call


class Reads:
    """`recorder` (collectors/api_events.py ApiRecorder) gives `enabled`, `naming.step()`, `_add` and
    `_guarded`; `remove()` puts back what `install()` wrapped."""

    def __init__(self, recorder, number):
        self._recorder, self._number = recorder, number  # number: a float as JSON holds it
        self._count = (None, 0)  # (step, reads in it so far)
        self._main = threading.main_thread().ident
        self._local = threading.local()  # `inside`: a row in the making (what it reads is not the training's)
        self._patches: list[Patch] = []
        self._finder: AfterImport | None = None
        self._timed: dict[tuple[str, int], bool] = {}  # a reader's place -> does its line read a time (`_time_at`)

    def install(self) -> Reads:
        for attr in METHODS:
            self._wrap(torch.Tensor, attr)
        for name in FUNCTIONS:
            self._wrap(torch, name)
        module = sys.modules.get(METRICS)
        if module is not None:
            self._wrap_metrics(module)
        else:  # wrapped as soon as the training imports torchmetrics
            self._finder = AfterImport({METRICS}, self._wrap_metrics)
            sys.meta_path.insert(0, self._finder)
        return self

    def remove(self) -> None:
        for patch in self._patches:
            patch.remove()
        self._patches.clear()
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)

    def _reading(self) -> bool:
        """A read to record now: recording, on the main thread, not inside a row's making nor dynamo."""
        return (self._recorder.enabled and threading.get_ident() == self._main
                and not getattr(self._local, "inside", False) and not is_compiling() and jit_tracing() is None)

    def _record(self, target: str, value, tensor, caller=None) -> None:
        self._local.inside = True
        try:
            self._recorder._guarded(self._row, target, value, tensor, caller)
        finally:
            self._local.inside = False

    def _wrap(self, owner, attr: str) -> None:
        reads = self

        def make(original, patch):
            def wrapper(*args, **kwargs):
                if is_compiling():  # (dynamo traces this: the original alone, as without the recording)
                    return original(*args, **kwargs)
                caller = sys._getframe(1)
                users = not caller.f_code.co_filename.startswith(_OWN_CODE) or caller.f_code.co_filename.startswith(_LOGGED)
                if not (users and patch.active) or threading.get_ident() != reads._main:
                    value = original(*args, **kwargs)
                else:  # (a warning torch gives here is the caller's line's, as without this wrapper)
                    value = _at(caller)(original, args, kwargs)
                if users and patch.active and reads._reading():
                    reads._record(attr, value, args[0] if args else None, caller)
                return value
            return wrapper

        self._patches.append(Patch(owner, attr, make))

    def _wrap_metrics(self, module) -> None:
        metric = getattr(module, "Metric", None)
        if metric is None or "_wrap_compute" not in metric.__dict__:
            return
        reads = self

        def make(original, patch):
            def wrap_compute(self, compute):
                wrapped = original(self, compute)

                @functools.wraps(wrapped)
                def computed(*args, **kwargs):
                    value = wrapped(*args, **kwargs)
                    if patch.active and reads._reading():
                        reads._record(f"{type(self).__name__}.compute", value, None)
                    return value
                return computed
            return wrap_compute

        self._patches.append(Patch(metric, "_wrap_compute", make))

    def _row(self, target: str, value, tensor, caller=None) -> None:
        step = self._recorder.naming.step()
        n = self._count[1] + 1 if self._count[0] == step else 0
        self._count = (step, n)
        if n < MAX_READS:
            row = self._value(target, value, tensor)
            if caller is not None:  # the reader's line: shown beside a difference, never compared (api_diff.PLACES)
                row["at"] = f"{caller.f_code.co_filename}:{caller.f_lineno}"
                if self._time_at(caller.f_code.co_filename, caller.f_lineno):
                    row["timed"] = True  # (its value is not compared: api_diff.differences)
            self._recorder._add("read", target.strip("_"), row, step=step)
        elif n == MAX_READS:  # (an evaluation that reads every sample: the step's first values say enough)
            self._recorder._add("read", "more", {"beyond": MAX_READS}, step=step)

    def _time_at(self, filename: str, line: int) -> bool:
        """Does the reader's line read a time: what it reads is assigned to a name that names one
        (bitguard/timed.py: `batch_time = timedelta(seconds=t[0].item())`, composer's Trainer agreeing on
        a batch's wall-clock time across ranks, helper 60; `elapsed_s = ...`), or made a `timedelta` of?
        Once a place."""
        key = (filename, line)
        known = self._timed.get(key)
        if known is None:
            text = linecache.getline(filename, line)
            target = _ASSIGNED.match(text)
            known = self._timed[key] = "timedelta(" in text or (
                target is not None and clock_of("." + target.group(1).rpartition(".")[2]) in ("duration", "instant"))
        return known

    def _value(self, target: str, value, tensor) -> dict:
        if target in MANY:
            return self._digested(tensor)
        if isinstance(value, torch.Tensor):  # (a metric's value: one number, or many)
            return {"value": self._plain(value.item())} if value.numel() == 1 else self._digested(value)
        if isinstance(value, dict):  # (a metric collection's, or a metric of several values)
            return {"value": {str(k): self._value(target, v, None).get("value") for k, v in value.items()}}
        if isinstance(value, (list, tuple)):
            return {"value": [self._value(target, v, None).get("value") for v in value]}
        return {"value": self._plain(value)}

    def _plain(self, value):
        """A Python value as JSON holds it: floats through `number`, a complex number as two, other
        objects as their repr."""
        if isinstance(value, complex):
            return [self._number(value.real), self._number(value.imag)]
        if isinstance(value, float):
            return self._number(value)
        return value if value is None or isinstance(value, (int, bool, str)) else repr(value)

    @staticmethod
    def _digested(tensor: torch.Tensor) -> dict:
        read = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
        try:
            xor, pos = resolve([digest_async(tensor.detach())])[0]
            read["value"] = f"{xor:016x}:{pos:016x}"
        except Exception as exc:  # noqa: BLE001 - a layout the digest refuses: the read is noted, not compared
            read["unread"] = type(exc).__name__
        return read
