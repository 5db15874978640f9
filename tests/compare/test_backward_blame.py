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


class _Hooked(nn.Module):
    def __init__(self, clamp: float):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 1)
        self.clamp = clamp

    def forward(self, x):
        h = self.l1(x).tanh()
        if h.requires_grad:
            h.register_hook(lambda g: g.clamp(-self.clamp, self.clamp))  # the training's own, on l2's input
        return self.l2(h)


def test_a_backward_source_names_a_hook_on_its_input_as_a_cause(tmp_path):
    """Helper 35: a gradient clamp in a Tensor.register_hook on l2's input was blamed on l2's backward
    as a source with no word of what could do that besides its kernel."""
    import torch

    for name, clamp in (("a", 0.01), ("b", 0.011)):
        torch.manual_seed(0)
        model = _Hooked(clamp)
        with bitguard.record(tmp_path / name, determinism=False):
            model(torch.randn(8, 4)).pow(2).sum().backward()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["phase"], fd["boundary"], fd["blame"]) == ("backward", "l2", "source"), fd
    assert "Tensor.register_hook" in fd["blame_window"]["detail"], fd["blame_window"]


class _Scaled(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 1)
        self.l2.register_full_backward_hook(lambda m, gin, gout: (gin[0] * scale,))

    def forward(self, x):
        import torch

        return self.l2(torch.relu(self.l1(x)))  # (a functional op between the two: no observed event made l2's input)


def test_a_backward_fault_propagates_through_a_functional_op_to_the_modules_before(tmp_path):
    """Helper 35: a backward hook scaling l2's input gradient was found at l2, and its propagation
    "reached 1 node": l1's gradient is relu's, which no observed event returned."""
    import torch

    for name, scale in (("a", 0.5), ("b", 0.51)):
        torch.manual_seed(0)
        model = _Scaled(scale)
        with bitguard.record(tmp_path / name, determinism=False):
            model(torch.randn(8, 4)).pow(2).sum().backward()
    c = bitguard.compare(tmp_path / "a", tmp_path / "b")
    fd = c.first_divergence
    assert (fd["phase"], fd["boundary"]) == ("backward", "l2"), fd
    edges = {(e["source"], e["target"], e["kind"]) for e in c.to_dict()["propagation"]["edges"]}
    assert any("l2" in s and "l1" in t and kind == "inferred" for s, t, kind in edges), edges


def test_a_loss_module_fed_a_view_of_the_output_reaches_the_models_backward(tmp_path):
    """Helper 88 (CTC fed `logp.transpose(0, 1)`, as CTC wants (T, N, C)): a changed label smoothing of a loss
    module given a transposed view of the model's output "reached 2 nodes" (the loss's forward and backward)
    while every gradient and weight after it differed: the model's backward receives the view's gradient, which
    no observed backward returned, and a root's backward was never hung off the one before it."""
    import torch

    for name, smoothing in (("a", 0.0), ("b", 0.1)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        loss_fn = nn.CrossEntropyLoss(label_smoothing=smoothing)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                opt.zero_grad()
                loss_fn(model(torch.randn(5, 2, 4)).transpose(1, 2), torch.randint(0, 3, (5, 2))).backward()
                opt.step()
    c = bitguard.compare(tmp_path / "a", tmp_path / "b")
    assert (c.first_divergence["boundary"], c.first_divergence["blame"]) == ("CrossEntropyLoss", "source")
    edges = {(e["source"].split(":", 1)[1], e["target"].split(":", 1)[1]) for e in c.to_dict()["propagation"]["edges"]}
    assert ("backward:module:CrossEntropyLoss", "backward:module:Sequential") in edges, edges
    assert ("backward:grad:0.weight", "optimizer:step:0.weight") in edges, edges


def test_a_forward_source_pivot_names_the_forward_hooks_that_can_change_it(tmp_path):
    """Helper 92: a global forward pre-hook (register_module_forward_pre_hook) scaling the last Linear's input at
    step 1 gave a source pivot at that Linear, "blame window: none", and no word of hooks, which run inside the
    call, after its inputs were read."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    for name, scale in (("a", 1.0), ("b", 1.01)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        at = {"step": 0}
        handle = register_module_forward_pre_hook(
            lambda m, args: (args[0] * scale,) if m is model[2] and at["step"] == 1 else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            with bitguard.record(tmp_path / name, determinism=False):
                for at["step"] in range(2):
                    opt.zero_grad()
                    model(torch.ones(2, 4)).pow(2).mean().backward()
                    opt.step()
        finally:
            handle.remove()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["boundary"], fd["blame"]) == (1, "2", "source"), fd
    assert "register_module_forward_pre_hook" in fd["blame_window"]["detail"], fd["blame_window"]
