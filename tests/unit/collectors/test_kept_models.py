"""Models and shadow weights the training keeps but never calls are found among the variables of
the code that called step() (collectors/kept.py); whatever a variable holds, looking never fails."""

from __future__ import annotations

import sys
import types
import weakref

import torch
import torch.nn as nn

from bitguard.collectors.kept import found_in


class _Raising:
    """A proxy whose every attribute lookup fails (a lazy import, a remote object)."""

    def __getattribute__(self, name):
        raise RuntimeError("do not look at me")


class _Slots:
    __slots__ = ("ema",)

    def __init__(self):
        self.ema = nn.Linear(2, 2)

    def frame(self):
        return sys._getframe()


class _ShadowEMA:
    """As diffusers' EMAModel: no module, a list of tensors updated in place."""

    def __init__(self, model):
        self.shadow_params = [p.detach().clone() for p in model.parameters()]
        self.decay = 0.9


class _Owner:
    def __init__(self):
        self.ema = nn.Linear(2, 2)
        self.in_dict = {"m": nn.Linear(2, 2)}
        self.proxy = _Raising()

    def frame(self):
        model = nn.Linear(3, 3)  # noqa: F841 - found as a local
        state = {"ema": nn.Linear(4, 4), 1: nn.Linear(4, 4), (2,): nn.Linear(4, 4)}  # noqa: F841 - string and
        # int keys (by position: a hook's handle number counts the process's hooks), no other
        emas = [nn.Linear(5, 5)]  # noqa: F841
        shadow = _ShadowEMA(nn.Linear(6, 6))  # noqa: F841
        by_name = {n: p.detach().clone() for n, p in nn.Linear(6, 6).named_parameters()}  # noqa: F841
        net = nn.Linear(7, 7)
        net.ema = _ShadowEMA(nn.Linear(6, 6))  # an object a module keeps as its attribute
        net.profiler = types.SimpleNamespace(model=weakref.proxy(model))  # (Lightning's: passed over)
        loop = types.SimpleNamespace(batch=[torch.zeros(2)])  # noqa: F841 - no model's shapes: not shadow weights
        return sys._getframe()


def test_locals_containers_objects_and_the_attributes_of_self_are_found_by_name():
    owner = _Owner()
    triples = found_in(owner.frame(), shapes={((6, 6), (6,))})
    found = {name: value for name, value, _ in triples}
    assert set(found) == {"model", "ema", "in_dict.m", "state.ema", "state.1", "emas.0", "shadow.shadow_params",
                          "by_name", "net", "net.ema.shadow_params"}, set(found)
    assert found["ema"] is owner.ema and isinstance(found["shadow.shadow_params"], list)
    assert isinstance(found["by_name"], dict)
    places = {name: place for name, _, place in triples}  # (where a list is held: read again at the end)
    assert places["net.ema.shadow_params"][1] == "shadow_params" and places["model"] is None
    assert places["net.ema.shadow_params"][0].shadow_params is found["net.ema.shadow_params"]
    # lists of tensors are shadow weights only where their shapes are a model's parameters'
    assert {"shadow.shadow_params", "by_name", "net.ema.shadow_params"}.isdisjoint(name for name, _, _ in found_in(owner.frame()))


def test_a_proxy_that_raises_and_an_owner_without_a_dict_are_passed_over():
    proxy = _Raising()  # noqa: F841 - a local that fails when looked at
    assert found_in(sys._getframe()) == []
    assert found_in(_Slots().frame()) == []  # (its slot is not looked into: no __dict__)


def test_shadow_weights_five_containers_down_are_found():
    """Helper 60 (composer's EMA: `trainer.state.algorithms[0].ema_model.named_parameters_dict`, a dict of
    shadow tensors five containers below the trainer): not found, an EMA made with another smoothing
    compared identical."""
    model = nn.Linear(6, 6)
    ema_model = types.SimpleNamespace(named_parameters_dict={n: p.detach().clone() for n, p in model.named_parameters()})
    trainer = types.SimpleNamespace(state=types.SimpleNamespace(model=model, algorithms=[
        types.SimpleNamespace(ema_model=ema_model)]))  # noqa: F841 - found as a local
    found = {name for name, _, _ in found_in(sys._getframe(), shapes={((6, 6), (6,))})}
    assert "trainer.state.algorithms.0.ema_model.named_parameters_dict" in found, found


class _LazyModule(types.ModuleType):
    """SpeechBrain's lazy redirect module in small: any attribute not in its namespace imports what it stands for."""

    imported: list = []

    def __getattr__(self, name):
        _LazyModule.imported.append(name)
        raise AttributeError(name)


def test_looking_at_a_lazy_module_imports_nothing():
    """Helper 82: the look read each module's `__file__` through getattr, and a lazy module's __getattr__
    imported what it stands for: under `bitguard record`, `import speechbrain` pulled transformers, accelerate
    and a thousand modules more into the training's process."""
    lazy = _LazyModule("lazy_integrations")  # noqa: F841 - found by the look, as a global of a script is
    _LazyModule.imported.clear()
    found_in(sys._getframe())
    assert _LazyModule.imported == []
