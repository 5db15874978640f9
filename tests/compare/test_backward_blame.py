"""A parameter's gradient at the pivot whose module already received a different gradient: the
window climbs to the innermost enclosing module whose incoming gradient matched (helper 14: peft's
LoRA scaling, applied in the wrapper's own code, was blamed on the adapter's Linear alone, and the
drill then traced only that Linear)."""

from __future__ import annotations

import torch.nn as nn

import bitguard

from .recorded_sgd import record_sgd


class _Adapted(nn.Module):
    """As peft's lora.Linear: a base layer and an adapter pair whose output is scaled here."""

    def __init__(self, scaling: float):
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.down = nn.Linear(4, 2, bias=False)
        self.up = nn.Linear(2, 4, bias=False)
        nn.init.zeros_(self.up.weight)  # (LoRA's B: the forward matches at the start, the gradients do not)
        self.scaling = scaling

    def forward(self, x):
        return self.base(x) + self.up(self.down(x)) * self.scaling


def _run(path, scaling: float):
    record_sgd(path, lambda: nn.Sequential(_Adapted(scaling), nn.Tanh(), nn.Linear(4, 1)))


def test_the_window_of_a_gradient_whose_module_got_a_different_one_is_where_the_gradients_matched(tmp_path):
    _run(tmp_path / "a", 2.0)
    _run(tmp_path / "b", 4.0)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["kind"], fd["boundary"], fd["blame"]) == \
        (0, "backward", "grad", "0.up.weight", "consumer"), fd
    window = fd["blame_window"]
    assert window["module"] == "0" and "0.up" in window["excluding_children"], window
    assert window["detail"].startswith("the gradient reaching 0.up's output already differed"), window
