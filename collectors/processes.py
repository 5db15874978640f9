"""Processes the training starts: what a recording cannot see, said; what it must not touch, left alone.

A process started through `multiprocessing` (Hogwild training, `torch.multiprocessing.spawn`, a
`Process(target=train)`) runs code the recording does not observe: a spawned one is a fresh
Python without bitguard, a forked one inherits the collector but not its writer thread. So:

- `ProcessWatch` wraps `multiprocessing`'s `BaseProcess.start` while a recording runs and reports
  (`report(message)`, a collector error: the comparison cannot be certified) each process started
  with a target that is not one of the helpers that only serve the training (a DataLoader
  worker, a process pool's or a manager's worker);
- in a forked child (`os.fork`, the fork start method, DataLoader workers on Linux) every active
  watch's `forked()` runs first thing: the collector stops there, so that the child neither waits
  for a writer it does not have (a step barrier timed out for 30 s at every step) nor writes into
  the parent's run.

It knows nothing of events or stores: the collector passes both callbacks.
"""

from __future__ import annotations

import multiprocessing.process
import os
import weakref
from functools import wraps

# targets that serve the training's own process and compute none of its numbers
_HELPERS = frozenset({
    "torch.utils.data._utils.worker._worker_loop",  # a DataLoader worker (its batches are recorded here)
    "concurrent.futures.process._process_worker",  # a process pool's worker (inductor's compile workers)
    "multiprocessing.pool.worker",
    "multiprocessing.managers.BaseManager._run_server",
})
_ACTIVE: list[weakref.ref] = []  # the installed watches (one per recording in this process)


def _in_child() -> None:
    for ref in list(_ACTIVE):
        watch = ref()
        if watch is not None:
            watch.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)


def target_name(process) -> str | None:
    """The dotted name of what `process` runs (`torch.multiprocessing.spawn`'s user function, not its
    wrapper), None when it has no target (a Process subclass with its own run())."""
    target = getattr(process, "_target", None)
    if target is None:
        return None if type(process).run is multiprocessing.process.BaseProcess.run else \
            f"{type(process).__module__}.{type(process).__qualname__}.run"
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    args = getattr(process, "_args", ())
    if name == "torch.multiprocessing.spawn._wrap" and args and callable(args[0]):
        return f"{getattr(args[0], '__module__', '?')}.{getattr(args[0], '__qualname__', repr(args[0]))}"
    return name


class ProcessWatch:
    """While installed: `report(message)` for each process started that may train, `forked()` in a
    forked child. `remove()` restores `BaseProcess.start`."""

    def __init__(self, report, forked):
        self._report = report
        self.forked = forked
        self._original = self._wrapper = None

    def install(self) -> ProcessWatch:
        original = self._original = multiprocessing.process.BaseProcess.start
        watch = self

        @wraps(original)
        def start(process):
            if watch._wrapper is not None:
                try:
                    watch.started(process)
                except Exception:  # noqa: BLE001 - the process starts whatever the watch makes of it
                    pass
            return original(process)

        multiprocessing.process.BaseProcess.start = self._wrapper = start
        _ACTIVE.append(weakref.ref(self))
        return self

    def started(self, process) -> None:
        name = target_name(process)
        if name is None or name in _HELPERS:
            return
        method = getattr(process, "_start_method", None) or multiprocessing.get_start_method(allow_none=True) \
            or "default"
        self._report(f"{name} ran in another process ({method}), not observed: what it computed is not compared; "
                     f"record each process that trains under bitguard (torchrun ... -m bitguard record)")

    def remove(self) -> None:
        # (wrapped again since by someone else: ours stays in their chain, reporting nothing)
        if multiprocessing.process.BaseProcess.__dict__.get("start") is self._wrapper is not None:
            multiprocessing.process.BaseProcess.start = self._original
        self._original = self._wrapper = None
        _ACTIVE[:] = [ref for ref in _ACTIVE if ref() is not None and ref() is not self]
