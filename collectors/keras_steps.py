"""A Keras optimizer's update ends a training step, as torch.optim's `step()` does.

On Keras' PyTorch backend, `model.fit` updates the weights with Keras' own optimizers (torch ops
on the variables, no torch.optim): no optimizer step hook ran, the collector's step counter never
moved, and a whole training was step 0 (helper 19), nothing made durable step by step.
`KerasStepWatch` wraps `BaseOptimizer.apply` (and the wrappers that call another optimizer's,
`LossScaleOptimizer` and `MultiOptimizer`) once Keras is imported, and calls `ended()` when the
outermost call returns without a torch.optim step having run in it (`stepped()` counts those).
The weights it wrote are the next step's `params` event's. Knows nothing of events.
"""

from __future__ import annotations

import sys
import threading

from bitguard.collectors.patching import Patch
from bitguard.collectors.saved import AfterImport

# module -> the class whose own `apply` is wrapped there
OPTIMIZERS = {"keras.src.optimizers.base_optimizer": "BaseOptimizer",
              "keras.src.optimizers.loss_scale_optimizer": "LossScaleOptimizer",
              "keras.src.optimizers.multi_optimizer": "MultiOptimizer"}


class KerasStepWatch:
    def __init__(self, stepped, ended):
        self._stepped = stepped  # () -> a count of the torch.optim steps seen so far
        self._ended = ended
        self._patches: list[Patch] = []
        self._local = threading.local()  # how deep in `apply` calls this thread is
        self._finder: AfterImport | None = None

    def install(self) -> KerasStepWatch:
        lazy = set()
        for name in OPTIMIZERS:
            module = sys.modules.get(name)
            if module is not None:
                self._wrap(module)
            else:
                lazy.add(name)
        if lazy:  # wrapped as soon as the training imports Keras
            self._finder = AfterImport(lazy, self._wrap)
            sys.meta_path.insert(0, self._finder)
        return self

    def _wrap(self, module) -> None:
        owner = getattr(module, OPTIMIZERS[module.__name__], None)
        if owner is None or "apply" not in owner.__dict__:
            return
        watch = self

        def make(original, patch):
            def apply(optimizer, *args, **kwargs):
                if not patch.active:
                    return original(optimizer, *args, **kwargs)
                depth = getattr(watch._local, "depth", 0)
                watch._local.depth = depth + 1
                before = watch._stepped()
                try:
                    return original(optimizer, *args, **kwargs)
                finally:
                    watch._local.depth = depth
                    if depth == 0 and watch._stepped() == before:
                        watch._ended()
            return apply

        self._patches.append(Patch(owner, "apply", make))

    def remove(self) -> None:
        for patch in self._patches:
            patch.remove()
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
