"""A step the loss scaler skipped is still a step.

`GradScaler.step(optimizer)` does not call `optimizer.step()` when a gradient holds an inf or a
NaN: no optimizer step hook runs, so the collector's step counter stood still and the next step's
events were numbered as the skipped one's. Two runs of which one skipped a step then compared as
events of different steps paired (an "extra data event"), not as the step run B skipped.
`ScalerWatch` wraps `torch.amp.GradScaler.step` while a recording runs and calls `skipped()` when
the call returned without an optimizer step hook having run (`stepped()` says whether one did).
It knows nothing of events.
"""

from __future__ import annotations

from functools import wraps

import torch


class ScalerWatch:
    def __init__(self, stepped, skipped):
        self._stepped = stepped  # () -> a count of the optimizer steps seen so far
        self._skipped = skipped
        self._original = self._wrapper = None

    def install(self) -> ScalerWatch:
        original = self._original = torch.amp.GradScaler.step
        watch = self

        @wraps(original)
        def step(scaler, optimizer, *args, **kwargs):
            if watch._wrapper is None:
                return original(scaler, optimizer, *args, **kwargs)
            before = watch._stepped()
            out = original(scaler, optimizer, *args, **kwargs)
            if watch._stepped() == before:
                watch._skipped()
            return out

        torch.amp.GradScaler.step = self._wrapper = step
        return self

    def remove(self) -> None:
        # (wrapped again since by someone else: ours stays in their chain, passing calls through)
        if torch.amp.GradScaler.__dict__.get("step") is self._wrapper is not None:
            torch.amp.GradScaler.step = self._original
        self._original = self._wrapper = None
