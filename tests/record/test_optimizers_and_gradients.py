"""Optimizers not of torch.optim's making (Keras-like, wrapping another, made after the last step,
updating in the gradient) and gradients edited between backward and step are recorded and blamed there."""

import shutil

import pytest

from incli import run_cli

from .conftest import as_older_schema
from .spots import compare_json, planted_pair, sgd_steps, tiny_mlp

pytestmark = pytest.mark.slow


def test_a_tensor_only_an_optimizer_holds_edited_between_steps_is_blamed_there(tmp_path):
    """Helper 18: SAC's `log_alpha`, a learned temperature only its optimizer holds, edited between
    two steps was blamed on the gradient reaching the model's output (the loss). Such tensors get a
    params event at each step's first root call, as a root's parameters do."""
    import torch

    import bitguard

    def train(name, edit):
        model, opt = tiny_mlp()
        log_alpha = torch.zeros(1, requires_grad=True)
        alpha_opt = torch.optim.Adam([log_alpha], lr=1e-2)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(4):
                if edit and step == 2:
                    with torch.no_grad():
                        log_alpha.add_(0.5)
                loss = (model(torch.randn(2, 4)) * log_alpha.exp()).pow(2).mean()
                opt.zero_grad()
                alpha_opt.zero_grad()
                loss.backward()
                opt.step()
                alpha_opt.step()

    for name, edit in (("a", False), ("b", False), ("c", True)):
        train(name, edit)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["boundary"], fd["module_type"], fd["step"], fd["fault_class"], fd["blame"]) == \
        ("params", "Adam", "optimizer", 2, "params", "source"), fd
    assert "only Adam steps" in fd["blame_window"]["detail"]
    shutil.copytree(tmp_path / "b", tmp_path / "old")
    as_older_schema(tmp_path / "old", 9)  # recorded before these events were: left out of both sides
    assert bitguard.compare(tmp_path / "old", tmp_path / "a").verdict == "identical"


def test_a_tensor_only_an_optimizer_holds_edited_through_data_after_the_last_step_differs_at_the_end(tmp_path):
    """Helper 72: `log_alpha.data.mul_(2)` after the last step compared identical: its final row
    reused the digest taken at the last step, the version counter being one `.data` does not move."""
    import torch

    import bitguard

    def train(name, edit):
        model, opt = tiny_mlp()
        log_alpha = torch.zeros(1, requires_grad=True)
        opt.add_param_group({"params": [log_alpha]})
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(3):
                loss = (model(torch.randn(2, 4)) * log_alpha.exp()).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            if edit:
                log_alpha.data.mul_(2.0)

    for name, edit in (("a", False), ("b", False), ("c", True)):
        train(name, edit)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["boundary"], fd["module_type"], fd["fault_class"]) == \
        ("final", "SGD", "optimizer", "final_state"), fd
    assert "compared only here" not in fd["blame_window"]["detail"]  # (its params events were taken at each step)


def test_tensors_trained_with_no_module_have_steps_and_their_edit_is_blamed_there(tmp_path):
    """Helper 42: a loop training tensors no module holds (a linear model written by hand, stepped by
    torch.optim) never called a module, so its steps never advanced: every event was step 0, and an
    edit of `w` before step 3 was blamed on `b`'s gradient. A step now begins at its first gradient."""
    import torch

    import bitguard
    from bitguard.backend.report import render_text

    def train(name, edit):
        torch.manual_seed(0)
        w, b = torch.zeros(3, requires_grad=True), torch.zeros((), requires_grad=True)
        x, y = torch.randn(16, 3), torch.randn(16)
        opt = torch.optim.Adam([w, b], lr=0.05)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(5):
                if edit == "w" and step == 3:
                    with torch.no_grad():
                        w.add_(1e-3)
                if edit == "y" and step == 2:
                    y = y * 1.5
                opt.zero_grad()
                ((x @ w + b - y) ** 2).mean().backward()
                opt.step()

    for name, edit in (("a", None), ("b", None), ("c", "w"), ("d", "y")):
        train(name, edit)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["boundary"], fd["step"], fd["fault_class"], fd["blame"]) == \
        ("params", "Adam", 3, "params", "source"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == [".param_groups[0][0]"], fd["tensors"]
    c = bitguard.compare(tmp_path / "a", tmp_path / "d")  # (the targets changed: a gradient, of no module)
    fd = c.to_dict()["first_divergence"]
    assert (fd["step"], fd["kind"]) == (2, "grad"), fd
    assert "step 2, backward of Adam.param_groups[0][1] (call 0)" in render_text(c), render_text(c)


def test_a_gradient_edited_between_backward_and_step_on_one_rank_is_said_to_be_an_edit(tmp_path):
    """Helper 17: on a single-rank run, noise or clipping added to .grad by a wrapping optimizer (Opacus'
    DPOptimizer) was explained as "a reduction across ranks"; one rank has none."""
    import bitguard

    def train(out, clip):
        model, opt = tiny_mlp()
        with bitguard.record(out, determinism=False):
            sgd_steps(model, opt, 2, clip=clip)

    for name, clip in (("a", 1e-3), ("b", 2e-3)):
        train(tmp_path / name, clip)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["blame"]) == (0, "optimizer", "consumer"), fd
    detail = fd["blame_window"]["detail"]
    assert "an edit of .grad: clipping" in detail and "across ranks" not in detail, detail


KERAS_LIKE = '''
class BaseOptimizer:  # (as Keras': its own update of the weights, no torch.optim)
    def __init__(self, lr):
        self.lr = lr

    def apply(self, grads, variables):
        import torch
        with torch.no_grad():
            for g, v in zip(grads, variables):
                v -= self.lr * g
'''


def test_a_keras_optimizer_s_update_ends_the_step(tmp_path, monkeypatch):
    """Helper 19: with Keras' own optimizers (its PyTorch backend: no torch.optim) the step never
    moved, and a whole training was step 0. `BaseOptimizer.apply` ends a step, also when Keras is
    imported after the recording began; what it wrote is the next step's params event's."""
    import importlib
    import sys

    import duckdb
    import torch

    import bitguard

    package = tmp_path / "pkgs" / "keras" / "src" / "optimizers"
    package.mkdir(parents=True)
    for folder in (package.parent.parent, package.parent, package):
        (folder / "__init__.py").write_text("")
    (package / "base_optimizer.py").write_text(KERAS_LIKE)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    for name in [m for m in sys.modules if m == "keras" or m.startswith("keras.")]:
        monkeypatch.delitem(sys.modules, name)

    def train(out, lr):
        model, _ = tiny_mlp()
        with bitguard.record(out, determinism=False):
            base = importlib.import_module("keras.src.optimizers.base_optimizer")  # (imported once recording)
            opt = base.BaseOptimizer(0.1)
            for step in range(3):
                opt.lr = lr if step == 1 else 0.1
                model.zero_grad()
                model(torch.randn(2, 4)).pow(2).mean().backward()
                opt.apply([p.grad for p in model.parameters()], list(model.parameters()))
        for name in [m for m in sys.modules if m == "keras" or m.startswith("keras.")]:
            del sys.modules[name]

    for name, lr in (("a", 0.1), ("b", 0.1), ("c", 0.2)):
        train(tmp_path / name, lr)
    with duckdb.connect(str(tmp_path / "a" / "rank-0.duckdb"), read_only=True) as con:
        assert con.sql("SELECT DISTINCT step FROM events WHERE kind = 'batch' ORDER BY step").fetchall() == \
            [(0,), (1,), (2,)]
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["step"], fd["kind"], fd["blame"]) == (2, "params", "source"), fd
    assert "another library's optimizer, as Keras'" in fd["blame_window"]["detail"], fd["blame_window"]


def test_an_optimizer_that_makes_its_update_in_the_gradient_is_blamed_as_computing_differently(tmp_path):
    """Helper 54 (Keller Jordan's Muon: `update = grad.lerp_(momentum, beta)`): the gradient rows of an
    optimizer's events were read after step(), which had written its update into them: another beta
    was said to have changed the gradient "between backward and step()", and the same update written
    out of place to differ. They are the gradients step() was given, digested before it ran."""
    import torch

    import bitguard

    class Nesterov(torch.optim.Optimizer):
        def __init__(self, params, beta, in_place):
            super().__init__(params, {"lr": 0.1, "beta": beta})
            self.in_place = in_place

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - group["beta"])
                    update = (p.grad.lerp_ if self.in_place else p.grad.lerp)(buf, group["beta"])
                    p.add_(update, alpha=-group["lr"])

    def train(name, beta, in_place=True):
        model, _ = tiny_mlp()
        opt = Nesterov(model.parameters(), beta, in_place)
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 3)

    for name, beta, in_place in (("a", 0.95, True), ("b", 0.95, False), ("c", 0.9, True)):
        train(name, beta, in_place)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0  # (the same parameters and state at every step)
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert (code, fd["step"], fd["phase"], fd["blame"], fd["fault_class"]) == (1, 0, "optimizer", "source", "optimizer"), fd
    assert [t["role"] for t in fd["tensors"] if t["differs"]] != ["grad"], fd["tensors"]


def test_the_state_of_an_optimizer_wrapping_the_stepped_one_is_compared_at_the_end(tmp_path):
    """Helper 54 (torch_optimizer's Lookahead): a wrapper whose step() calls its inner optimizer's and that
    keeps slow weights in its own state never calls Optimizer.__init__, so no step hook runs for it: its
    slow weights halved after the last step compared identical. It is found as the `self` of the code that
    called the inner step(), and its state is compared when the recording ends, as the inner one's."""
    import torch

    import bitguard

    class Lookahead(torch.optim.Optimizer):
        def __init__(self, optimizer):  # (no Optimizer.__init__, as torch_optimizer's)
            self.optimizer, self.param_groups, self.state = optimizer, optimizer.param_groups, {}

        def step(self, closure=None):
            self.optimizer.step()
            for p in (p for group in self.param_groups for p in group["params"]):
                slow = self.state.setdefault(p, {}).setdefault("slow_param", p.detach().clone())
                slow.lerp_(p.detach(), 0.5)

        def zero_grad(self, set_to_none=True):
            self.optimizer.zero_grad(set_to_none)

    def train(name, edit):
        model, sgd = tiny_mlp()
        opt = Lookahead(sgd)
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 3)
            if edit:
                for state in opt.state.values():
                    state["slow_param"].mul_(0.5)

    for name, edit in (("a", False), ("b", False), ("c", True)):
        train(name, edit)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    assert code == 3 and d["verdict"] == "inconclusive", d["verdict"]
    reasons = [r for r in d["certification"]["reasons"] if r["code"] == "final_settings"]
    assert reasons and "Lookahead" in reasons[0]["message"], d["certification"]["reasons"]


@pytest.mark.parametrize("how", ["state", "lr"])
def test_an_optimizer_made_after_the_last_step_is_compared_at_the_end(tmp_path, how):
    """Helper 65: an optimizer re-created after the last step(), its state loaded from the stepped one in one run
    and not in the other (or made with another learning rate), was never stepped, so no step hook met it, and the
    runs compared identical; a training that went on with it would differ. Every optimizer made while recording
    has its settings and state compared when the recording ends."""
    import torch

    import bitguard

    def train(name, changed):
        model, _ = tiny_mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 3)
            again = torch.optim.Adam(model.parameters(), lr=2e-2 if changed and how == "lr" else 1e-2)
            if how == "state" and not changed:  # (a loaded state brings its learning rates along)
                again.load_state_dict(opt.state_dict())
            opt = again

    for name, changed in (("a", False), ("b", False), ("c", True)):
        train(name, changed)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    assert code == 3 and d["verdict"] == "inconclusive", d["verdict"]
    assert [r["code"] for r in d["certification"]["reasons"] if r["code"] == "final_settings"], d["certification"]


def test_an_optimizer_s_state_paired_across_another_optimizer_names_both_sides(tmp_path):
    """Helper 54 (a parameter moved from torch.optim.Muon to AdamW): the pivot's state row paired with the
    other optimizer's showed run A's name alone (`['momentum_buffer']` for AdamW's `exp_avg`)."""
    import torch

    import bitguard

    def train(name, adam):
        model, _ = tiny_mlp()
        opt = torch.optim.Adam(model.parameters(), lr=0.1) if adam else \
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, 2)

    train("a", False)
    train("b", True)
    fd = compare_json(tmp_path / "a", tmp_path / "b")[1]["first_divergence"]
    paired = {(t["role"], t["path"]): t.get("path_b") for t in fd["tensors"] if t["role"] == "state"}
    assert paired.get(("state", "['momentum_buffer']")) == "['exp_avg']", fd["tensors"]
    shown = run_cli("compare", tmp_path / "a", tmp_path / "b").stdout
    assert "state[0]['momentum_buffer'] (B: ['exp_avg'])" in shown, shown


def test_a_gradient_changed_in_a_root_s_own_code_is_windowed_there(tmp_path):
    """Helper 68: a root that detaches half of its child's output computes the same loss and another gradient.
    Its parts are not named under it, so no named ancestor was found, and the pivot (the child's backward) was
    said to get its gradient from the loss or code outside the model, though the root's own backward began
    from a matching one. The window is the root's own code."""
    import torch

    import bitguard

    class M(torch.nn.Module):
        def __init__(self, detach):
            super().__init__()
            self.lin, self.detach = torch.nn.Linear(4, 4), detach

        def forward(self, x):
            h = self.lin(x)
            if self.detach:
                h = torch.cat([h[:, :2], h[:, 2:].detach()], 1)
            return (h * h).mean()

    def train(name, detach):
        torch.manual_seed(0)
        model = M(detach)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 4)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                model(x).backward()
                opt.step()
                opt.zero_grad()

    train("a", False), train("b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"]) == (0, "backward", "lin", "consumer"), fd
    window = fd["blame_window"]
    assert (window["module"], window["excluding_children"]) == ("M", ["lin"]), window
    assert "the gradient reaching M's output matched" in window["detail"], window


def test_a_hook_on_a_module_s_output_that_scales_its_gradient_is_named_among_the_causes(tmp_path):
    """Helper 79: a Tensor.register_hook the training put on a module's output after the call returned changes
    the gradient after bitguard read it: the weight gradient's difference was said to be the module's backward
    or a regulariser, "the gradient reaching its module matched"."""
    import torch

    import bitguard

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

        def forward(self, x):
            h = self.l1(x)
            if self.hook:
                h.register_hook(lambda g: g * 1.01)
            return self.l2(torch.tanh(h))

    def train(out, hook_at):
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with bitguard.record(out, determinism=False):
            for step in range(2):
                opt.zero_grad()
                net.hook = step == hook_at
                net(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()

    fd = planted_pair(tmp_path, train, None, 1)
    assert (fd["step"], fd["phase"], fd["blame"]) == (1, "backward", "source"), fd
    assert "a hook the training put on the module's output after its call returned" in fd["blame_window"]["detail"]


def test_a_parameter_of_one_of_two_roots_of_a_type_is_not_said_to_be_held_by_no_module(tmp_path):
    """A bare Linear's own parameter is named `bias`, no module in its name: with two such roots in a step, its
    module was not told, and the gradient was said to be of "a tensor no module holds" (the text of Pyro's)."""
    import torch

    import bitguard

    def train(out, scale_at):
        torch.manual_seed(0)
        l1, l2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
        opt = torch.optim.SGD([*l1.parameters(), *l2.parameters()], lr=0.1)
        with bitguard.record(out, determinism=False):
            for step in range(2):
                opt.zero_grad()
                h = l1(torch.randn(8, 4))
                if step == scale_at:
                    h.register_hook(lambda g: g * 1.01)
                l2(torch.tanh(h)).pow(2).mean().backward()
                opt.step()

    fd = planted_pair(tmp_path, train, None, 1)
    assert (fd["step"], fd["phase"], fd["module_type"]) == (1, "backward", "Linear"), fd
    assert "a tensor no module holds" not in fd["blame_window"]["detail"], fd["blame_window"]
    assert "several roots of that type ran in this step" in fd["blame_window"]["detail"], fd["blame_window"]


@pytest.mark.parametrize("change", ["lr", "patience"])
def test_an_optimizer_or_scheduler_freed_before_the_recording_ends_is_compared_as_it_was_then(tmp_path, change):
    """Most scripts train inside a function: its optimizer and scheduler are freed when it returns, before the
    recording ends, and a learning rate set after the last step() there compared identical (only a script's
    globals were read at the end). A ReduceLROnPlateau's patience, which no recorded step used, compared
    identical without a word (helper 81). Each is read when it is freed (collectors/settings.py)."""
    import torch

    import bitguard

    def train(changed):
        model, _ = tiny_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=4 if changed and change == "patience" else 9)
        sgd_steps(model, opt, 2)
        plateau.step(1.0)
        if changed and change == "lr":
            opt.param_groups[0]["lr"] = 0.05

    for name, changed in (("a", False), ("b", False), ("c", True)):
        with bitguard.record(tmp_path / name, determinism=False):
            train(changed)
        assert "__del__" not in vars(torch.optim.Optimizer), "the finalizer outlived the recording"
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    assert code == 3 and [r["code"] for r in d["inconclusive"]["reasons"]] == ["final_settings"], d["verdict"]
    said = "groups[0].lr differs after the last optimizer step" if change == "lr" else \
        "ReduceLROnPlateau#0): state.patience differs when the recording ended (step 2: 9 in A, 4 in B)"
    assert said in d["inconclusive"]["reasons"][0]["message"], d["inconclusive"]["reasons"]


@pytest.mark.parametrize("plateau_in", ["a", "b"])
def test_a_scheduler_stepped_after_the_last_step_in_one_run_names_that_run(tmp_path, plateau_in):
    """Helper 86 (a ReduceLROnPlateau that never reduced, added in run B): "scheduler_step (ReduceLROnPlateau#0)
    is called after the last optimizer step in run A only": A was named because it has rows there too (its
    optimizer's settings at the end)."""
    import torch

    import bitguard

    def train(path, plateau):
        model, opt = tiny_mlp()
        with bitguard.record(path, determinism=False):
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt) if plateau else None
            sgd_steps(model, opt, 2)
            if scheduler is not None:
                scheduler.step(1.0)

    for name in ("a", "b"):
        train(tmp_path / name, name == plateau_in)
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    assert code == 3 and [r["code"] for r in d["inconclusive"]["reasons"]] == ["final_settings"], d["verdict"]
    said = f"scheduler_step (ReduceLROnPlateau#0) is called after the last optimizer step (step 2) in run " \
           f"{plateau_in.upper()} only"
    assert said in d["inconclusive"]["reasons"][0]["message"], d["inconclusive"]["reasons"]


@pytest.mark.parametrize("call", ["backward", "step"])
def test_a_backward_or_step_one_run_alone_makes_unobserved_is_no_identical(tmp_path, call):
    """Helper 83 (a BoTorch script that never called `fit_gpytorch_mll`, whose gpytorch modules are called past
    nn.Module's call, against one that did): every recorded event equal, "backward (loss): called in A, not
    called in B" in a note, and the verdict identical."""
    import torch

    import bitguard

    def train(path, extra):
        model, _ = tiny_mlp()
        w = torch.ones(3, requires_grad=True)  # (no module holds it, no optimizer steps it before)
        opt = torch.optim.SGD([w], lr=0.1) if call == "step" else None
        with bitguard.record(path, determinism=False):
            model(torch.randn(2, 4))
            if extra:
                (w * 2).sum().backward()
                if opt is not None:
                    opt.step()

    for name, extra in (("a", False), ("b", False), ("c", True)):
        train(tmp_path / name, extra)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "c", tmp_path / "a")
    if call == "step":  # (the step it took moves the end of the recording: a structure divergence there)
        assert code == 1 and d["first_divergence"]["kind"] == "final", d["first_divergence"]
        return
    assert code == 3, d["verdict"]
    (reason,) = d["inconclusive"]["reasons"]
    assert reason["code"] == "computed" and "backward (loss) is called at step 0 in run A only" in reason["message"], \
        reason


def test_a_hook_on_a_parameter_is_named_among_the_causes_of_an_accumulation_pivot(tmp_path):
    """Helper 85 (`fc.weight.register_hook(lambda g: g * 0.5)` from step 2, four micro-batches a step): the pivot
    said "a missed zero_grad, a wrong accumulate" only, where no zero_grad call differed."""
    import torch

    import bitguard

    def train(path, hooked):
        model, opt = tiny_mlp()
        with bitguard.record(path, determinism=False):
            for step in range(3):
                if hooked and step == 2:
                    model[2].weight.register_hook(lambda g: g * 0.5)
                opt.zero_grad()
                for x in torch.arange(16.0).reshape(4, 1, 4) / 16:
                    model(x).pow(2).mean().backward()
                opt.step()

    train(tmp_path / "a", False), train(tmp_path / "b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["fault_class"]) == (2, "accumulation"), fd
    assert "a hook on the parameter (param.register_hook" in fd["blame_window"]["detail"], fd["blame_window"]



def test_a_run_that_failed_is_not_said_to_lack_the_calls_it_never_reached(tmp_path):
    """Helper 87 (torchvision detection, eval() forgotten: the model raised in run B's step 2): besides `incomplete`,
    compare said "backward (loss) is called at step 2 in run A only ... outside every recorded boundary"."""
    import torch

    import bitguard

    def train(path, fail):
        model, opt = tiny_mlp()
        try:
            with bitguard.record(path, determinism=False):
                sgd_steps(model, opt, 2)
                loss = model(torch.randn(2, 4)).pow(2).mean()
                if fail:
                    raise RuntimeError("the model raised")
                loss.backward()
                opt.step()
        except RuntimeError:
            pass

    train(tmp_path / "a", False), train(tmp_path / "b", True)
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    assert code == 3 and "computed" not in [r["code"] for r in d["inconclusive"]["reasons"]], d["inconclusive"]
