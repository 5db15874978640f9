"""A Keras optimizer's update ends a step once, however its optimizers nest, and not when a
torch.optim step ran inside it (collectors/foreign_steps.py)."""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence

import pytest

from bitguard.collectors import foreign_steps


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

    for name, cls in zip(foreign_steps.OPTIMIZERS, (BaseOptimizer, LossScaleOptimizer, MultiOptimizer)):
        module = types.ModuleType(name)
        setattr(module, cls.__name__, cls)
        monkeypatch.setitem(sys.modules, name, module)
        made[cls.__name__] = cls
    return made


stepped = [0]


def test_each_outermost_update_ends_one_step(monkeypatch):
    k = _fake_keras(monkeypatch)
    ended = []
    watch = foreign_steps.ForeignStepWatch(lambda: stepped[0], lambda optimizer: ended.append(1)).install()
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


def test_fastai_s_own_optimizer_ends_each_step(monkeypatch, tmp_path):
    """Helper 23: a fastai Learner steps with fastai's own `Optimizer` (not torch.optim): every event
    of a training was step 0 and `--steps 2:4` recorded nothing. Its `step` ends a step now."""
    import torch

    import bitguard
    from bitguard.backend.ingest import load_rank, open_run

    class Optimizer:  # (fastai.optimizer.Optimizer's shape: param groups of tensors, `step` updates them)
        def __init__(self, params, lr):
            self.params, self.lr = list(params), lr

        def step(self):
            with torch.no_grad():
                for p in self.params:
                    p -= self.lr * p.grad

        def zero_grad(self):
            for p in self.params:
                p.grad = None

    module = types.ModuleType("fastai.optimizer")
    module.Optimizer = Optimizer
    monkeypatch.setitem(sys.modules, "fastai.optimizer", module)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = Optimizer(model.parameters(), 0.1)
    for name, steps in (("all", None), ("window", "1:2")):
        with bitguard.record(tmp_path / name, determinism=False, steps=steps):
            for _ in range(3):
                model(torch.randn(2, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    steps_of = {name: sorted(set(load_rank(open_run(tmp_path / name), 0)[0]["step"].to_list())) for name in ("all", "window")}
    assert steps_of["all"][:3] == [0, 1, 2], steps_of
    assert 1 in steps_of["window"] and 0 not in steps_of["window"], steps_of


def test_a_keras_optimizer_s_state_edited_after_its_last_update_is_no_identical(monkeypatch, tmp_path):
    """Helper 50: Keras' momentum variables (or its learning rate, a variable too) changed after the
    last update compared identical: the end-of-recording settings were torch.optim's only. Another
    library's optimizer is taken too, by its variables (a stand-in with Keras' shape)."""
    import torch

    import bitguard

    class Variable:  # (a KerasVariable: its tensor is `value`, its name `path`)
        def __init__(self, path, value):
            self.path, self.value = path, value

    class BaseOptimizer:
        def __init__(self, params, lr):
            self.params = list(params)
            self.variables = [Variable("lr", torch.tensor(lr))] + [
                Variable(f"momentum_{i}", torch.zeros_like(p)) for i, p in enumerate(self.params)]

        def apply(self, grads, variables=None):
            with torch.no_grad():
                for p, g, m in zip(self.params, grads, self.variables[1:]):
                    m.value.mul_(0.9).add_(g)
                    p -= self.variables[0].value * m.value

    module = types.ModuleType("keras.src.optimizers.base_optimizer")
    module.BaseOptimizer = BaseOptimizer
    monkeypatch.setitem(sys.modules, "keras.src.optimizers.base_optimizer", module)
    for name, edit in (("a", False), ("b", False), ("c", True)):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = BaseOptimizer(model.parameters(), 0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                model.zero_grad()
                model(torch.randn(2, 4)).pow(2).mean().backward()
                opt.apply([p.grad for p in opt.params])
            if edit:
                opt.variables[1].value.mul_(0.5)  # (after the last update)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    c = bitguard.compare(tmp_path / "a", tmp_path / "c")
    assert [r["code"] for r in c.blocking_reasons()] == ["final_settings"], c.blocking_reasons()
    assert "optimizer_settings (BaseOptimizer#0): the optimizer's state" in c.blocking_reasons()[0]["message"]


class _L:
    """fastcore's `L` in small: a sequence that is not a list."""

    def __init__(self, items):
        self.items = list(items)

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


Sequence.register(_L)


def _fake_fastai(monkeypatch):
    """fastai.optimizer's shapes: an `Optimizer` whose settings are `hypers`, an `L` of dicts, and a
    `Lookahead` that steps it and keeps its slow weights in its own attribute."""
    import torch

    class Optimizer:  # (a group of parameters a layer, as fastai's splitters make them)
        def __init__(self, groups, lr):
            self.param_lists = _L(_L(group) for group in groups)
            self.hypers = _L({"lr": lr, "mom": 0.9} for _ in groups)
            self.state = {}

        @property
        def param_groups(self):  # (fastai's: torch.optim's shape, made of its lists)
            return [{"params": group, **hypers} for group, hypers in zip(self.param_lists, self.hypers)]

        def step(self):
            with torch.no_grad():
                for group, hypers in zip(self.param_lists, self.hypers):
                    for p in group:
                        p -= hypers["lr"] * p.grad

        def zero_grad(self):
            for group in self.param_lists:
                for p in group:
                    p.grad = None

    class Lookahead:  # (fastai's steps its `opt`, then every k steps pulls the weights to its slow ones)
        def __init__(self, opt, k=2, alpha=0.5):
            self.opt, self.k, self.alpha, self.count, self.slow_weights = opt, k, alpha, 0, None

        def step(self):
            if self.slow_weights is None:
                self.slow_weights = _L(_L(p.detach().clone() for p in group) for group in self.opt.param_lists)
            self.opt.step()
            self.count += 1
            if self.count % self.k == 0:
                with torch.no_grad():
                    for slow_group, fast_group in zip(self.slow_weights, self.opt.param_lists):
                        for slow, fast in zip(slow_group, fast_group):
                            slow.add_(fast - slow, alpha=self.alpha)
                            fast.copy_(slow)

    module = types.ModuleType("fastai.optimizer")
    module.Optimizer, module.Lookahead = Optimizer, Lookahead
    monkeypatch.setitem(sys.modules, "fastai.optimizer", module)
    return module


@pytest.mark.parametrize("edit", ["lr", "slow_weights"])
def test_fastai_s_settings_and_a_lookahead_s_slow_weights_changed_after_fit_are_no_identical(monkeypatch, tmp_path, edit):
    """Helper 75: fastai's `hypers` is an `L`, not a list, so its learning rate was never read (set after fit:
    identical); its Lookahead keeps its slow weights in an attribute of its own (halved after fit: identical)."""
    import torch

    import bitguard

    fastai = _fake_fastai(monkeypatch)
    for name, edited in (("a", False), ("b", False), ("c", True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        opt = fastai.Lookahead(fastai.Optimizer([model[0].parameters(), model[2].parameters()], 0.1))
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(3):
                model(torch.randn(2, 4)).pow(2).mean().backward()
                opt.step()
                opt.opt.zero_grad()
            if edited and edit == "lr":
                opt.opt.hypers[0]["lr"] = 0.5
            elif edited:
                opt.slow_weights[0][0].mul_(0.5)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    c = bitguard.compare(tmp_path / "a", tmp_path / "c")
    if edit == "slow_weights":  # (a layer's slow weights, a run of the model's parameters' shapes: kept tensors whose
        fd = c.first_divergence  # final state is compared, as an EMA's; before, the optimizer's state digest said it)
        assert (c.verdict, fd["kind"], fd["boundary"][:12]) == ("diverged", "final", "slow_weights"), fd
        return
    assert [r["code"] for r in c.blocking_reasons()] == ["final_settings"], (c.verdict, c.first_divergence)


def test_a_fastai_update_that_differs_is_found_at_its_step(monkeypatch, tmp_path):
    """Helper 75: fastai's lr raised from step 4 was found at step 5, in the weights that step began from, as an
    update "outside torch.optim" with no setting named. An optimizer of torch.optim's shape (fastai's) now has an
    event per parameter it updated, as torch.optim's has: the pivot is its step, with the lr that differs."""
    import torch

    import bitguard

    fastai = _fake_fastai(monkeypatch)
    for name, raised in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        opt = fastai.Optimizer([model[0].parameters(), model[2].parameters()], 0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                model(torch.randn(2, 4)).pow(2).mean().backward()
                if raised and step == 1:
                    opt.hypers[1]["lr"] = 0.2
                opt.step()
                opt.zero_grad()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"]) == (1, "optimizer", "2.weight", "source"), fd
    assert any(d["field"] == "groups[1].lr" for d in fd["api_differences"]["differences"]), fd["api_differences"]
