"""An optimizer that is not torch.optim's ends a training step with its update, as `step()` does.

On Keras' PyTorch backend, `model.fit` updates the weights with Keras' own optimizers (torch ops
on the variables, no torch.optim), and fastai's `Learner` with fastai's own `Optimizer` by
default: no optimizer step hook ran, the collector's step counter never moved, and a whole
training was step 0 (helpers 19 and 23), nothing made durable step by step, and `--steps`
recorded nothing. `ForeignStepWatch` wraps the update method of each class in OPTIMIZERS (Keras'
`BaseOptimizer.apply` and the wrappers that call another optimizer's, `LossScaleOptimizer` and
`MultiOptimizer`; fastai's `Optimizer.step`) once its library is imported, and calls `ended(optimizer)`
when the outermost call returns without a torch.optim step having run in it (`stepped()` counts
those: fastai's `OptimWrapper` steps a torch.optim optimizer). What it wrote is recorded by weights.py
(`_foreign_step`). Knows nothing of events.
"""

from __future__ import annotations

import sys
import threading

from bitguard.collectors.patching import Patch
from bitguard.collectors.saved import AfterImport

# module -> (the class, its own method that updates the weights), wrapped there
OPTIMIZERS = {"keras.src.optimizers.base_optimizer": ("BaseOptimizer", "apply"),
              "keras.src.optimizers.loss_scale_optimizer": ("LossScaleOptimizer", "apply"),
              "keras.src.optimizers.multi_optimizer": ("MultiOptimizer", "apply"),
              "fastai.optimizer": ("Optimizer", "step")}


class ForeignStepWatch:
    def __init__(self, stepped, ended):
        self._stepped = stepped  # () -> a count of the torch.optim steps seen so far
        self._ended = ended
        self._patches: list[Patch] = []
        self._local = threading.local()  # how deep in `apply` calls this thread is
        self._finder: AfterImport | None = None

    def install(self) -> ForeignStepWatch:
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
        name, method = OPTIMIZERS[module.__name__]
        owner = getattr(module, name, None)
        if owner is None or method not in owner.__dict__:
            return
        watch = self

        def make(original, patch):
            def update(optimizer, *args, **kwargs):
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
                        watch._ended(optimizer)
            return update

        self._patches.append(Patch(owner, method, make))

    def remove(self) -> None:
        for patch in self._patches:
            patch.remove()
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
