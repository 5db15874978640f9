"""Weights changed outside torch.optim (by hand, through `.data`, through functional_call or
tensordict's to_module, lazily made, made trainable mid-run) are recorded and blamed where they changed."""

import contextlib

import pytest

from .conftest import record_together
from .spots import BLIND_SPOTS, compare_json, planted_pair, tiny_mlp

pytestmark = pytest.mark.slow


def test_parameters_updated_outside_torch_optim_differ_in_the_final_state(tmp_path):
    record_together(*(dict(out=tmp_path / name, script_args=("manual", lr), script=BLIND_SPOTS) for name, lr in
                      (("a", "0.01"), ("b", "0.5"), ("c", "0.01"))))
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["fault_class"], fd["boundary"]) == ("final", "final_state", "Sequential")
    assert "outside torch.optim" in fd["blame_window"]["detail"]
    assert compare_json(tmp_path / "a", tmp_path / "c")[0] == 0  # and a rerun is identical, final state included


@pytest.mark.parametrize("what, same, changed, step, call, detail", [
    ("init", "1.0", "1.5", 0, 0, "the initialisation"),
    ("clamp", "0.05", "0.02", 2, 0, "outside torch.optim changed them after the last step()"),
    # no optimizer: every call is in step 0, the third after the second update
    ("manual1", "0.01", "0.5", 0, 2, "no optimizer step was recorded"),
    ("lbfgs", "0.5", "0.75", 2, 1, "inside the step"),  # the closure's second call
    # an evaluation before the step's training call, then an edit through .data (helper 13, Lightning's
    # validation): taken again when the mode changes back
    ("validate", "1.0", "1.5", 2, 1, "inside the step"),
])
def test_weights_changed_between_steps_are_blamed_on_the_parameters(tmp_path, what, same, changed, step, call,
                                                                     detail):
    """An initialisation, a clamp through .data after step() (a WGAN critic), a hand-written
    update: what changes the weights between two steps used to be blamed on the first module that
    read them, as if its kernel computed differently. A root's parameters are recorded at its first
    call in each step (a `params` event), where the difference shows first."""
    record_together(*(dict(out=tmp_path / name, script_args=(what, value), script=BLIND_SPOTS) for name, value in
                      (("a", same), ("b", same), ("c", changed))))
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["step"], fd["phase"], fd["kind"], fd["boundary"], fd["blame"], fd["fault_class"]) == \
        (step, "optimizer", "params", "Sequential", "source", "params"), fd
    assert detail in fd["blame_window"]["detail"] and fd["call"] == call
    differing = sorted(t["path"] for t in fd["tensors"] if t["differs"])
    assert differing == ([".2.weight"] if what in ("init", "validate") else [".0.bias", ".0.weight", ".2.bias", ".2.weight"])


def test_a_weight_edited_between_micro_batches_is_blamed_on_the_edit(tmp_path):
    """Helper 21 (ignite's gradient accumulation, an edit in a handler): the params event a later call
    of a step gets when the weights moved since its first is on one side only, and was reported as
    `structure (extra)`, "a module was skipped or added"; it is the edit's own place."""
    import torch

    import bitguard

    def train(name, edit):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                opt.zero_grad()
                for micro in range(2):
                    if edit and (step, micro) == (1, 1):
                        with torch.no_grad():
                            model[0].weight[0, 0] += 1e-3
                    model(torch.randn(2, 4)).pow(2).mean().backward()
                opt.step()

    for name, edit in (("a", False), ("c", True)):
        train(name, edit)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["step"], fd["call"], fd["blame"], fd["fault_class"]) == ("params", 1, 1, "source", "params"), fd
    assert "changed between two of its calls in step 1" in fd["blame_window"]["detail"]


def test_each_functional_call_of_a_step_has_the_weights_it_ran_on_recorded(tmp_path):
    """An ensemble run member by member through functional_call (pytorch/tutorials' ensembling,
    without vmap): a params event was taken at a root's first call of a step only, so a member's
    edited weight was blamed on the first module reading it, `source (forward)`, as if that module
    computed differently. Each such call now records the weights it ran on; the stacked tensors,
    which only the optimizer holds, have their own params event at the step's start, first."""
    import torch
    from torch.func import functional_call, stack_module_state

    import bitguard

    def train(out, edit):
        torch.manual_seed(0)
        members = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)) for _ in range(3)]
        params, _ = stack_module_state(members)
        base = members[0]
        opt = torch.optim.SGD(params.values(), lr=0.1)
        with bitguard.record(out, determinism=False):
            for step in range(3):
                x = torch.randn(2, 4)
                loss = sum(functional_call(base, {k: v[i] for k, v in params.items()}, (x,)).pow(2).mean()
                           for i in range(3))
                opt.zero_grad()
                loss.backward()
                opt.step()
                if edit and step == 0:
                    with torch.no_grad():
                        params["2.weight"][2, 0, 3] += 1e-3  # member 2's last layer, by hand

    for name, edit in (("a", False), ("b", True)):
        train(tmp_path / name, edit)
    fd = compare_json(tmp_path / "a", tmp_path / "b")[1]["first_divergence"]
    assert (fd["step"], fd["kind"], fd["boundary"], fd["blame"], fd["fault_class"]) == \
        (1, "params", "SGD", "source", "params"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == [".param_groups[0][2]"], fd["tensors"]


@pytest.mark.parametrize("change", ["unfreeze", "grow", "replace"])
def test_parameters_that_become_trainable_have_their_gradients_from_their_first_step(tmp_path, change):
    """Parameters a model did not train when first called (frozen, added later, or replaced) had no
    gradient hook: the first trainable step's gradients of them went unrecorded, and a user's hook
    scaling one was blamed on the optimizer as "not observed". They are hooked at the model's next
    call; and new weights made differently are said to be new, not edited."""
    import duckdb
    import torch

    import bitguard

    def train(out, scale, init):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        if change == "unfreeze":
            model[0].requires_grad_(False)
        opt = torch.optim.SGD((p for p in model.parameters() if p.requires_grad), lr=0.1)
        with bitguard.record(out, determinism=False):
            for step in range(4):
                if step == 2:  # the warm-up is over
                    if change == "unfreeze":
                        model[0].requires_grad_(True)
                    elif change == "grow":
                        model.append(torch.nn.Linear(1, 1))
                    else:
                        model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
                    new = model[-1] if change == "grow" else model[0]
                    with torch.no_grad():
                        new.weight[0, 0] += init
                    opt.add_param_group({"params": list(new.parameters()) if change != "replace" else [new.weight]})
                    new.weight.register_hook(lambda g: g * scale)
                opt.zero_grad()
                model(torch.randn(2, 4)).pow(2).mean().backward()
                opt.step()

    for name, scale, init in (("a", 1.0, 0.0), ("b", 1.0, 0.0), ("c", 1.5, 0.0), ("d", 1.0, 1e-3)):
        train(tmp_path / name, scale, init)
    new = "3.weight" if change == "grow" else "0.weight"
    with duckdb.connect(str(tmp_path / "a" / "rank-0.duckdb"), read_only=True) as con:
        steps = con.sql(f"SELECT step FROM events WHERE kind = 'grad' AND boundary = '{new}' ORDER BY step").fetchall()
    assert steps == ([(0,), (1,), (2,), (3,)] if change == "replace" else [(2,), (3,)])
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["kind"], fd["boundary"], fd["blame"]) == \
        (2, "backward", "grad", new, "source"), fd
    fd = bitguard.compare(tmp_path / "a", tmp_path / "d").to_dict()["first_divergence"]
    assert (fd["step"], fd["kind"], fd["blame"]) == (2, "params", "source"), fd
    detail = fd["blame_window"]["detail"]
    if change == "replace":  # (the weight it replaced stepped under its name: weights copied in, as load_state_dict)
        assert "outside torch.optim changed them" in detail and "weights copied in" in detail, detail
    else:
        assert detail.startswith(f"{new} differs at the start of this step, and no optimizer step before updated "
                                 "them: parameters new to the model or to its training"), detail


@contextlib.contextmanager
def _to_module(weights: dict, net):
    """What tensordict's `TensorDict.to_module` does (0.14): each tensor given takes its parameter's slot
    out of the module's `_parameters` and sits in its `__dict__`, put back on the way out."""
    import torch

    taken = []
    for key, tensor in weights.items():
        path, _, name = key.rpartition(".")
        module = net.get_submodule(path)
        taken.append((module, name, module._parameters.pop(name)))
        module.__dict__[name] = tensor
    try:
        yield
    finally:
        for module, name, p in taken:
            del module.__dict__[name]
            module._parameters[name] = p
    assert all(isinstance(p, torch.nn.Parameter) for p in net.parameters())


@pytest.mark.parametrize("how", ["functional_call", "to_module"])
def test_a_target_network_given_its_weights_inside_a_loss_s_forward_is_blamed_on_them(tmp_path, how):
    """Helper 47 (torchrl's DQNLoss + SoftUpdate): a target network's weights, kept in a dict and
    soft-updated by hand, given to the trained network's modules through functional_call inside the
    loss module's forward. A soft update computed differently was blamed "source (forward)" on the
    first module that ran on them, as if it computed differently: its inputs matched. Such a call of a
    module inside another's has the weights it ran on recorded (a `params` event), and the blame is on
    them, a copy kept beside the trained parameters. Helper 62: also when they are given as tensordict's
    `to_module` gives them, in the module's `__dict__` with its parameters' slots emptied."""
    import torch
    from torch.func import functional_call

    import bitguard

    def given(net, target, x):
        if how == "functional_call":
            return functional_call(net, target, (x,))
        with _to_module(target, net):
            return net(x)

    class QLoss(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net
            self.target = {k: v.detach().clone() for k, v in net.named_parameters()}

        def forward(self, x, r):
            with torch.no_grad():
                tq = given(self.net, self.target, x).max(1).values
            return ((self.net(x).max(1).values - (r + 0.9 * tq)) ** 2).mean()

    def train(out, tau):
        torch.manual_seed(0)
        loss = QLoss(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
        opt = torch.optim.Adam(loss.net.parameters(), lr=1e-2)
        with bitguard.record(out, determinism=False):
            for step in range(3):
                opt.zero_grad()
                loss(torch.randn(16, 4), torch.randn(16)).backward()
                opt.step()
                with torch.no_grad():  # (the soft update)
                    for k, p in loss.net.named_parameters():
                        loss.target[k].lerp_(p, tau if step == 0 else 0.05)

    fd = planted_pair(tmp_path, train, 0.05, 0.5)
    assert (fd["step"], fd["kind"], fd["boundary"], fd["blame"]) == (1, "params", "net.0", "source"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == [".weight", ".bias"], fd["tensors"]
    assert "a teacher or target network" in fd["blame_window"]["detail"], fd["blame_window"]


def test_weights_trained_through_functional_call_without_torch_optim_are_not_certified(tmp_path):
    """torch.func.functional_call on a dict of weights updated by hand: the weights after the last
    update are used by nothing observed, so a different last learning rate compared identical. Such
    a run is now inconclusive (a collector error that says why)."""
    record_together(*(dict(out=tmp_path / name, script_args=("functional", lr), script=BLIND_SPOTS) for name, lr in
                      (("a", "0.1"), ("b", "0.5"))))
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    assert code == 3 and d["verdict"] == "inconclusive", d["verdict"]
    assert any("in place of its parameters (functional_call)" in r["message"] for r in d["certification"]["reasons"]), \
        d["certification"]["reasons"]


def test_a_model_s_own_parameters_given_to_functional_call_under_torch_func_grad_are_its_weights(tmp_path):
    """Helper 72: `grad(loss)(dict(model.named_parameters()), ...)` wraps the module's own Parameters, which
    functional_call then puts in their slots, updated by hand through `.data`: the collector said the
    final weights were not observed (inconclusive), but they are the module's own, which its final event
    holds. Two unchanged runs compare identical, and a last update that differs is found there."""
    import torch
    from torch.func import functional_call, grad

    import bitguard

    def train(out, lr):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        params = dict(model.named_parameters())

        def loss_fn(prm, x):
            return functional_call(model, prm, (x,)).pow(2).mean()

        with bitguard.record(out, determinism=False):
            for step in range(3):
                grads = grad(loss_fn)(params, torch.randn(4, 4))
                for k, p in params.items():
                    p.data.sub_(grads[k] * (lr if step == 2 else 0.1))

    fd = planted_pair(tmp_path, train, 0.1, 0.5)
    assert (fd["kind"], fd["boundary"]) == ("final", "Sequential"), fd


def test_weights_a_module_reads_in_place_of_its_parameters_trained_by_hand_are_not_certified(tmp_path):
    """Helper 19: Keras' stateless_call swaps values in for a layer's variables (no functional_call, the
    parameters stay in place, untrained) and the training updates its own tensors by hand: a different
    last update compared identical. Gradients that flowed through the modules yet reached none of their
    parameters, with no optimizer step, make the run inconclusive."""
    import torch

    import bitguard

    class Scoped(torch.nn.Linear):  # (as a Keras layer inside a StatelessScope: the scope's value is read)
        scope = None

        def forward(self, x):
            return torch.nn.functional.linear(x, self.scope if self.scope is not None else self.weight)

    def train(out, last_lr):
        torch.manual_seed(0)
        layer = Scoped(4, 1, bias=False)
        weight = layer.weight.detach().clone().requires_grad_(True)
        with bitguard.record(out, determinism=False):
            for step in range(3):
                layer.scope = weight
                (grad,) = torch.autograd.grad(layer(torch.randn(2, 4)).pow(2).mean(), [weight])
                with torch.no_grad():
                    weight -= (last_lr if step == 2 else 0.1) * grad
        torch.save(weight, out.parent / f"{out.name}.not-a-recorded-save")  # (after the recording)

    for name, lr in (("a", 0.1), ("b", 0.2)):
        train(tmp_path / name, lr)
    c = bitguard.compare(tmp_path / "a", tmp_path / "b")
    assert c.verdict == "inconclusive", c.to_dict()["verdict"]
    assert "none reached a parameter of theirs" in " ".join(c.run_a.manifest["collector_errors"])


@pytest.mark.parametrize("log", [False, True])
def test_a_model_whose_call_skips_torchs_has_its_parameters_taken_each_step(tmp_path, log):
    """Helper 46 (gpytorch): its modules' `__call__` calls `forward` directly, so the only module call
    seen is a Softplus shared by every constraint; a clamp of one raw parameter between two steps
    was blamed on that Softplus's input as data. The first call of a step, whatever holds it, now
    takes what only the optimizer holds, and a later call takes it again once it was written (`log`:
    the scale logged after the step is the next step's first call, and the clamp comes after it)."""
    import torch

    import bitguard

    softplus = torch.nn.Softplus()  # (one for every constraint, as gpytorch's)

    class Direct(torch.nn.Module):
        def __call__(self, *args):
            return self.forward(*args)

    class Model(Direct):
        def __init__(self):
            super().__init__()
            self.raw_noise, self.raw_scale = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return (x / softplus(self.raw_scale)).sin() + softplus(self.raw_noise) * x

    def train(name, clamp):
        torch.manual_seed(0)
        model = Model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.linspace(0, 1, 8)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(4):
                if clamp and step == 2:
                    with torch.no_grad():
                        model.raw_scale.clamp_(min=0.5)
                opt.zero_grad()
                ((model(x) - x.cos()) ** 2).mean().backward()
                opt.step()
                if log:  # (the scale logged after the step: a call that begins the next step, before the clamp)
                    softplus(model.raw_scale).item()

    for name, clamp in (("a", False), ("b", False), ("c", True)):
        train(name, clamp)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["boundary"], fd["step"], fd["blame"]) == ("params", "SGD", 2, "source"), fd
    if not log:
        assert [t["path"] for t in fd["tensors"] if t["differs"]] == [".model.raw_scale"], fd["tensors"]


@pytest.mark.parametrize("then", [None, "tanh", "window"])
def test_weights_no_recorded_call_holds_initialised_differently_are_blamed_at_the_first_step(tmp_path, then):
    """Helper 56: a model run only through `.forward()` (as gpytorch's modules are) and initialised
    differently was blamed at step 0 on "the gradient step() used", or (`then`: a module called on its
    output) on the data: nothing had observed its weights before the step updated them. They are now
    taken before the first step() (its pre-hook, a params event named apart), and the pivot is that
    event, or the called module's input, said to come from those weights. With a --steps window begun
    after the first step, they are adopted before the window as in the whole run, and their params
    event at the window's first call is the pivot."""
    import torch

    import bitguard

    def train(name, init):
        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 1)
        with torch.no_grad():
            linear.weight[0, 0] += init
        opt = torch.optim.SGD(linear.parameters(), lr=0.1)
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        with bitguard.record(tmp_path / name, determinism=False, steps=(1, None) if then == "window" else None):
            for _ in range(3):
                opt.zero_grad()
                out = linear.forward(x)
                ((torch.nn.Tanh()(out) if then else out) - y).pow(2).mean().backward()
                opt.step()

    for name, init in (("a", 0.0), ("b", 0.0), ("c", 1e-3)):
        train(name, init)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    if then == "window":  # (adopted before the window, as the whole run adopts them: their params event at its start)
        assert (fd["kind"], fd["boundary"], fd["step"], fd["blame"], fd["fault_class"]) == \
            ("params", "SGD", 1, "source", "params"), fd
        assert "(linear.weight, linear.bias: " in fd["blame_window"]["detail"], fd["blame_window"]
        return
    if then:
        assert (fd["kind"], fd["boundary"], fd["step"], fd["blame"], fd["fault_class"]) == \
            ("module", "Tanh", 0, "consumer", "params"), fd
        assert "already differ as its first step() finds them" in fd["blame_window"]["detail"], fd["blame_window"]
        return
    assert (fd["kind"], fd["boundary"], fd["step"], fd["blame"], fd["fault_class"]) == \
        ("params", "SGD (before its first step)", 0, "source", "params"), fd
    assert "as the first step() found them" in fd["blame_window"]["detail"], fd["blame_window"]
    # (named as the code that holds the model names it, helper 68: `.param_groups[0][0]` before)
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == [".linear.weight"], fd["tensors"]


@pytest.mark.parametrize("read", ["before", "after"])
def test_a_model_trained_through_another_method_initialised_differently_is_blamed_on_its_weights(tmp_path, read):
    """Helper 68: a flow trained through a method, never called, reads its own parameter before its part's call
    (`.inverse()`: that part's input was blamed on the data) or after it (`.nll()`, a learned base scale: its
    gradient was said to come from the loss). Initialised differently, its weights, as the optimizer's step()
    finds them later in the step, already differ: they are blamed."""
    import torch

    import bitguard

    class Flow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = torch.nn.Parameter(torch.zeros(4))
            self.net = torch.nn.Linear(4, 4)

        def inverse(self, x):
            return self.net(x * torch.exp(self.s)).pow(2).mean()

        def nll(self, x):
            z = self.net(x)
            return (self.s + 0.5 * (z / self.s.exp()) ** 2).sum(-1).mean()

    def train(name, s):
        torch.manual_seed(0)
        model = Flow()
        with torch.no_grad():
            model.s.fill_(s)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 4)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                (model.inverse(x) if read == "before" else model.nll(x)).backward()
                opt.step()
                opt.zero_grad()

    train("a", 0.0), train("b", 0.5)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["boundary"], fd["blame"], fd["fault_class"]) == \
        (0, "net" if read == "before" else "s", "consumer", "params"), fd
    assert "the weights of Flow (s)" in fd["blame_window"]["detail"], fd["blame_window"]


def test_a_regularised_parameter_of_a_bare_root_module_is_windowed_at_that_module(tmp_path):
    """Helper 69: the whole model a bare `nn.Linear`, an L2 penalty of another weight in the loss: the bias's
    gradient was said to have "no backward of its module recorded", though the Linear's backward was, and
    matched (its parameters are named `weight` and `bias`, with no module path before them)."""
    import torch

    import bitguard

    def train(name, lam):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2)
        anchor = [p.detach().clone() + 0.5 for p in m.parameters()]
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                loss = ((m(x) - y) ** 2).mean() + lam * sum(((p - a) ** 2).sum() for p, a in zip(m.parameters(), anchor))
                loss.backward()
                opt.step()
                opt.zero_grad()

    train("a", 0.1), train("b", 0.2)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["kind"], fd["blame"]) == (0, "grad", "source"), fd
    assert fd["blame_window"]["module"] == "Linear", fd["blame_window"]
    assert "while the gradient reaching its module matched" in fd["blame_window"]["detail"], fd["blame_window"]


def test_parameters_a_module_makes_inside_its_call_are_blamed_as_made_there(tmp_path):
    """Helper 78: Pyro's AutoNormal makes its parameters in its first forward, from the shapes it meets: a
    changed init_scale was blamed on that forward computing differently, and the drill of a params pivot was
    not supported. They are a params event as the call that made them ends (torch's parameter registration
    hook), before its forward event; the drill traces that call."""
    import torch

    import bitguard
    from bitguard.backend.drill import plan
    from bitguard.backend.ingest import open_run

    class Made(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, x):
            if not hasattr(self, "w"):
                self.w = torch.nn.Parameter(torch.randn(4) * self.scale)
            return x * self.w

    def train(name, scale):
        torch.manual_seed(0)
        net, made, opt = torch.nn.Linear(4, 4), Made(scale), None
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                out = made(net(torch.randn(2, 4)))
                opt = opt or torch.optim.SGD([*net.parameters(), *made.parameters()], lr=0.1)
                opt.zero_grad()
                out.pow(2).mean().backward()
                opt.step()

    for name, scale in (("a", 1.0), ("b", 1.0), ("c", 1.1)):
        train(name, scale)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["boundary"], fd["step"], fd["fault_class"], fd["blame"]) == (
        "params", "Made", 0, "params", "source"), fd
    assert "w was made during this forward call of Made" in fd["blame_window"]["detail"]
    window = plan(open_run(tmp_path / "a"), open_run(tmp_path / "c"), fd)
    assert (window.boundary, window.phase, window.call) == ("Made", "forward", 0)


def test_a_target_network_called_inside_the_policy_s_call_has_its_weights_recorded_there(tmp_path):
    """Helper 80 (Tianshou's DQN, `policy(batch, model=model_old)`): a target network given to another
    module's forward and called there, not one of that root's parts, had no params event: a sync at another
    step, or an edit by hand, was blamed on its first Linear computing differently. Such a call's weights are
    taken as a root's are."""
    import copy

    import torch

    import bitguard

    class Policy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

        def forward(self, x, model=None):
            return (model or self.model)(x)

    def train(out, edit_at):
        torch.manual_seed(0)
        policy = Policy()
        target = copy.deepcopy(policy.model)
        opt = torch.optim.SGD(policy.parameters(), lr=0.1)
        with bitguard.record(out, determinism=False):
            for step in range(3):
                with torch.no_grad():
                    if step == edit_at:
                        target[0].weight[0, 0] += 1e-3
                    goal = policy(torch.randn(8, 4), model=target).max(1).values
                opt.zero_grad()
                (policy(torch.randn(8, 4)).max(1).values - goal).pow(2).mean().backward()
                opt.step()

    fd = planted_pair(tmp_path, train, None, 1)
    assert (fd["step"], fd["kind"], fd["blame"], fd["fault_class"]) == (1, "params", "source", "params"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == [".0.weight"], fd["tensors"]
    assert "a teacher or target network" in fd["blame_window"]["detail"], fd["blame_window"]


def test_a_step_window_records_the_tensors_only_an_optimizer_holds_as_the_whole_run_does(tmp_path):
    """Helper 92: a learned temperature no module holds gets a params event at each step's first root call, from
    the step its optimizer first stepped it; a window that began later (a drill's replay of step 2) adopted it only
    at the window's own optimizer step, so the replay lacked the event, and drill said "not reproduced:
    nondeterminism or a changed environment"."""
    import polars as pl
    import torch

    import bitguard
    from bitguard.backend.ingest import load_rank, open_run

    def train(path, steps):
        torch.manual_seed(0)
        model, log_t = torch.nn.Linear(4, 3), torch.zeros((), requires_grad=True)
        opt = torch.optim.SGD([*model.parameters(), log_t], lr=0.1)
        with bitguard.record(path, determinism=False, steps=steps):
            for _ in range(3):
                opt.zero_grad()
                (model(torch.randn(5, 4)) / log_t.exp()).pow(2).mean().backward()
                opt.step()

    def step_two(path):
        events = load_rank(open_run(path), 0)[0].filter((pl.col("step") == 2) & (pl.col("kind") != "final"))
        return events.select("phase", "kind", "boundary").rows()  # (the end's final state: the window's, at step 2)

    train(tmp_path / "whole", None)
    train(tmp_path / "window", (2, 3))
    assert ("optimizer", "params", "SGD") in step_two(tmp_path / "whole")
    assert step_two(tmp_path / "window") == step_two(tmp_path / "whole")


def test_parameters_never_written_after_to_empty_are_said_to_hold_the_fill(tmp_path, capfd):
    """Helper 92: a model made on the meta device and moved with to_empty() whose last layer's reset_parameters()
    was forgotten trains on uninitialised memory: the determinism controls fill it with NaN (every loss NaN, two
    recordings identical) where a plain run reads whatever the memory held, and nothing said so."""
    import torch

    import bitguard

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with bitguard.record(tmp_path / "run"):
        model = model.to_empty(device="cpu")
        model[0].reset_parameters()  # (not model[1]'s)
        model(torch.ones(2, 4)).sum().backward()
    err = capfd.readouterr().err
    assert "2 parameter(s) of Sequential hold NaN in every element as it is first called (1.weight, 1.bias)" in err, err
    assert "the determinism controls fill with NaN" in err, err


def test_a_call_given_other_weights_through_functional_call_says_so(tmp_path):
    """Helpers 85 and 92: a teacher pass through functional_call with 0.9 x the weights (0.8 x at step 1 in run B),
    after the student's own call: the pivot, the params event of that second call, was explained as weights that
    "changed inside the step" (LBFGS, SAM, an edit through .data), though nothing edited them."""
    import torch
    from torch.func import functional_call

    import bitguard

    def train(out, scale_at_1):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(out, determinism=False):
            for step in range(3):
                x = torch.randn(2, 4)
                scale = scale_at_1 if step == 1 else 0.9
                teacher = {k: v.detach() * scale for k, v in model.named_parameters()}
                loss = (model(x) - functional_call(model, teacher, (x,))).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()

    train(tmp_path / "a", 0.9)
    train(tmp_path / "b", 0.8)
    fd = compare_json(tmp_path / "a", tmp_path / "b")[1]["first_divergence"]
    assert (fd["step"], fd["kind"], fd["call"]) == (1, "params", 1), fd
    assert "other tensors than its earlier call met" in fd["blame_window"]["detail"], fd["blame_window"]
