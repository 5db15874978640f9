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

import torch

from bitguard.collectors.patching import Patch


class ScalerWatch:
    def __init__(self, stepped, skipped):
        self._stepped = stepped  # () -> a count of the optimizer steps seen so far
        self._skipped = skipped
        self._patch: Patch | None = None

    def install(self) -> ScalerWatch:
        watch = self

        def make(original, patch):
            def step(scaler, optimizer, *args, **kwargs):
                if not patch.active:
                    return original(scaler, optimizer, *args, **kwargs)
                before = watch._stepped()
                out = original(scaler, optimizer, *args, **kwargs)
                if watch._stepped() == before:
                    watch._skipped()
                return out
            return step

        self._patch = Patch(torch.amp.GradScaler, "step", make)
        return self

    def remove(self) -> None:
        if self._patch is not None:
            self._patch.remove()
