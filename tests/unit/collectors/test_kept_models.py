"""Models the training keeps but never calls are found among the variables of the code that called
step() (collectors/hooks.py `_modules_in`); whatever a variable holds, looking never fails."""

from __future__ import annotations

import sys

import torch.nn as nn

from bitguard.collectors.hooks import _modules_in


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


class _Owner:
    def __init__(self):
        self.ema = nn.Linear(2, 2)
        self.proxy = _Raising()

    def frame(self):
        model = nn.Linear(3, 3)  # noqa: F841 - found as a local
        return sys._getframe()


def test_locals_and_the_attributes_of_self_are_found_by_name():
    owner = _Owner()
    found = dict(_modules_in(owner.frame()))
    assert set(found) == {"model", "ema"} and found["ema"] is owner.ema


def test_a_proxy_that_raises_and_an_owner_without_a_dict_are_passed_over():
    proxy = _Raising()  # noqa: F841 - a local that fails when looked at
    assert _modules_in(sys._getframe()) == []
    assert _modules_in(_Slots().frame()) == []  # (its slot is not looked into: no __dict__)
