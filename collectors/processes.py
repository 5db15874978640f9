"""Processes the training starts: what a recording cannot see, said; what it must not touch, left alone.

A process started through `multiprocessing` (Hogwild training, `torch.multiprocessing.spawn`, a
`Process(target=train)`) runs code the recording does not observe: a spawned one is a fresh
Python without bitguard, a forked one inherits the collector but not its writer thread. So:

- `ProcessWatch` wraps `multiprocessing`'s `BaseProcess.start` while a recording runs and reports
  (`report(message)`, a collector error: the comparison cannot be certified) each process started
  with a target that is not one of the helpers that only serve the training (a DataLoader
  worker, a manager's server; a process pool's worker when torch's own code starts it, as
  inductor's compile workers), and each `os.fork()` outside such a start (seen in the parent);
- in a forked child (`os.fork`, the fork start method, DataLoader workers on Linux) every active
  watch's `forked()` runs first thing: the collector stops there, so that the child neither waits
  for a writer it does not have (a step barrier timed out for 30 s at every step) nor writes into
  the parent's run.

It knows nothing of events or stores: the collector passes both callbacks.
"""

from __future__ import annotations

import multiprocessing.process
import os
import sys
import threading
import weakref

from bitguard.collectors.patching import Patch

# targets that serve the training's own process and compute none of its numbers
_HELPERS = frozenset({
    "torch.utils.data._utils.worker._worker_loop",  # a DataLoader worker (its batches are recorded here)
    "multiprocessing.managers.BaseManager._run_server",
    # environments stepped in worker processes: what they compute reaches the training as the observations its
    # policy is called on, recorded here (helper 62: torchrl's ParallelEnv made identical reruns inconclusive)
    "torchrl.envs.batched_envs._run_worker_pipe_shared_mem", "torchrl.envs.batched_envs._run_worker_pipe_direct",
    "gymnasium.vector.async_vector_env._async_worker", "gym.vector.async_vector_env._worker",
    "gym.vector.async_vector_env._worker_shared_memory",
    "stable_baselines3.common.vec_env.subproc_vec_env._worker",
})
# a process pool's workers run whatever is submitted: helpers only when torch's own code starts them
# (inductor's compile workers); started from the script's code they may train
_POOL_WORKERS = frozenset({"concurrent.futures.process._process_worker", "multiprocessing.pool.worker"})
_TORCH_OWN = ("torch._inductor", "torch._dynamo", "torch.utils.data")
# Data preparation whose processes (forked, or a pool's) only compute what the training then reads as
# batches, which its events compare: Hugging Face datasets' `map`/`filter` with `num_proc` (through the
# `multiprocess` package, whose processes fork outside multiprocessing's start; helper 24)
_DATA_PREP = ("datasets",)
_ACTIVE: list[weakref.ref] = []  # the installed watches (one per recording in this process)
_starting = threading.local()  # inside a watched Process.start: its fork is that process's, not os.fork's


def _watches() -> list:
    return [w for w in (ref() for ref in list(_ACTIVE)) if w is not None]


def _in_child() -> None:
    for watch in _watches():
        watch.forked()


def _in_parent() -> None:
    watches = _watches()  # (every fork of the process comes here: no stack walk when nothing records)
    if watches and not getattr(_starting, "now", False) and not _called_from(_DATA_PREP):
        for watch in watches:
            watch.report("the script forked (os.fork): what the child computes is not observed nor compared")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child, after_in_parent=_in_parent)


def _called_from(modules: tuple[str, ...], frames: int = 60) -> bool:
    """Whether code of `modules` (packages or modules, and what is in them) is among the callers of
    the caller."""
    f = sys._getframe(2)
    within = tuple(m + "." for m in modules)
    for _ in range(frames):
        if f is None:
            return False
        name = f.f_globals.get("__name__", "")
        if name in modules or name.startswith(within):
            return True
        f = f.f_back
    return False


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
        self._patch: Patch | None = None

    def install(self) -> ProcessWatch:
        watch = self

        def make(original, patch):
            def start(process):
                if patch.active:
                    try:
                        watch.started(process)
                    except Exception:  # noqa: BLE001 - the process starts whatever the watch makes of it
                        pass
                _starting.now = True
                try:
                    return original(process)
                finally:
                    _starting.now = False
            return start

        self._patch = Patch(multiprocessing.process.BaseProcess, "start", make)
        _ACTIVE.append(weakref.ref(self))
        return self

    def started(self, process) -> None:
        name = target_name(process)
        if name is None or name in _HELPERS or (name in _POOL_WORKERS and _called_from(_TORCH_OWN + _DATA_PREP)):
            return
        method = getattr(process, "_start_method", None) or multiprocessing.get_start_method(allow_none=True) \
            or "default"
        what = "a process pool's tasks" if name in _POOL_WORKERS else name
        # (helper 33: Lightning's ddp_spawn said what was not observed, not what to do instead)
        self.report(f"{what} ran in another process ({method}), not observed: what it computed is not compared; "
                    f"to record training that runs in several processes, launch them with "
                    f"'torchrun --nproc-per-node N -m bitguard record --out DIR -- SCRIPT' (Lightning and Fabric: "
                    f"strategy 'ddp', which uses the processes torchrun started)")

    def report(self, message: str) -> None:
        self._report(message)

    def remove(self) -> None:
        if self._patch is not None:
            self._patch.remove()  # (wrapped again since by someone else: ours stays in their chain, reporting nothing)
        _ACTIVE[:] = [ref for ref in _ACTIVE if ref() is not None and ref() is not self]
