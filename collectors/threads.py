"""Module calls made on threads other than the recording's (a prefetching DataLoader's augmentation, MONAI's
ThreadDataLoader and CacheDataset, an actor's policy): not recorded. Their calls interleave with the training's
steps by timing, so they would be numbered and paired by chance (helper 84: unchanged reruns diverged); what
they compute reaches the training as its inputs, which are recorded.

`OtherThreads` runs such a call and counts it by thread, outside any other call on that thread. It also says
whether the call moved a generator's state (the CPU one, and CUDA's where CUDA is initialised), comparing the
states before and after the outermost call: one that drew moved the training's generator by timing, and only
then does compare leave the generators' states out (backend/threads.py). A draw the training's own thread
makes meanwhile counts as the other thread's: that errs towards leaving the state out, never towards keeping
a state compared that timing moved. Knows nothing of frames, rows or the store.
"""

from __future__ import annotations

import threading

import torch


def _generator_states() -> list[torch.Tensor]:
    states = [torch.default_generator.get_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += [g.get_state() for g in torch.cuda.default_generators]
    return states


def _moved(before: list[torch.Tensor]) -> bool:
    after = _generator_states()
    return len(after) != len(before) or any(not torch.equal(a, b) for a, b in zip(after, before))


class OtherThreads:
    """Module calls made on other threads than the recording's, by thread name (`calls`), and those of them
    that moved a generator's state (`drew`)."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.drew: dict[str, int] = {}
        self._inside = threading.local()

    def call(self, inner, module, args, kwargs):
        """`inner(module, *args, **kwargs)`, counted where it is the outermost call on its thread."""
        if getattr(self._inside, "depth", 0):
            return inner(module, *args, **kwargs)
        name = threading.current_thread().name
        self.calls[name] = self.calls.get(name, 0) + 1
        try:
            before = _generator_states()
        except Exception:  # noqa: BLE001 - unread: taken to have drawn (the state is left out)
            before = None
        self._inside.depth = 1
        try:
            return inner(module, *args, **kwargs)
        finally:
            self._inside.depth = 0
            try:
                drew = before is None or _moved(before)
            except Exception:  # noqa: BLE001 - as above
                drew = True
            if drew:
                self.drew[name] = self.drew.get(name, 0) + 1
