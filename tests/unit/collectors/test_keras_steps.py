"""A Keras optimizer's update ends a step once, however its optimizers nest, and not when a
torch.optim step ran inside it (collectors/keras_steps.py)."""

from __future__ import annotations

import sys
import types

from bitguard.collectors import keras_steps


def _fake_keras(monkeypatch):
    """Keras' three optimizer classes whose `apply` the watch wraps: a base, and two that call another's."""
    made = {}

    class BaseOptimizer:
        def __init__(self, torch_steps=0):
            self.torch_steps = torch_steps

        def apply(self, grads, variables=None):
            stepped[0] += self.torch_steps  # (a torch.optim step inside)

    class LossScaleOptimizer(BaseOptimizer):
        def __init__(self, inner):
            self.inner = inner

        def apply(self, grads, variables=None):
            self.inner.apply(grads, variables)

    class MultiOptimizer(BaseOptimizer):
        def __init__(self, inner):
            self.inner = inner

        def apply(self, grads, variables=None):
            for optimizer in self.inner:
                optimizer.apply(grads, variables)

    for name, cls in zip(keras_steps.OPTIMIZERS, (BaseOptimizer, LossScaleOptimizer, MultiOptimizer)):
        module = types.ModuleType(name)
        setattr(module, cls.__name__, cls)
        monkeypatch.setitem(sys.modules, name, module)
        made[cls.__name__] = cls
    return made


stepped = [0]


def test_each_outermost_update_ends_one_step(monkeypatch):
    k = _fake_keras(monkeypatch)
    ended = []
    watch = keras_steps.KerasStepWatch(lambda: stepped[0], lambda: ended.append(1)).install()
    try:
        k["BaseOptimizer"]().apply([])
        k["LossScaleOptimizer"](k["BaseOptimizer"]()).apply([])
        k["MultiOptimizer"]([k["BaseOptimizer"](), k["BaseOptimizer"]()]).apply([])
        assert len(ended) == 3  # one a step, however many optimizers the update ran
        k["BaseOptimizer"](torch_steps=1).apply([])
        assert len(ended) == 3  # a torch.optim step ended it already
    finally:
        watch.remove()
    k["BaseOptimizer"]().apply([])
    assert len(ended) == 3  # removed: nothing wrapped
