"""Runs whose shape differs from a plain loop (one stops early, a model rebuilt mid-run, another model
trained after, TorchScript, torch.func transforms, a skipped scaler step) are compared and said to be so."""

import pytest

from incli import run_cli

from .conftest import SCRIPTS, as_schema_5, record_together
from .spots import BLIND_SPOTS, compare_json, run_events, sgd_steps, tiny_mlp

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["saliency", "params"])
def test_a_second_backward_through_a_retained_graph_is_observed(tmp_path, mode):
    """A module call's backward event was taken once: the gradients of a second pass through a
    retained graph (a saliency map, a gradient penalty) went unobserved, and a fault there
    compared identical (saliency) or was blamed on a parameter's weight gradient (params)."""
    script = SCRIPTS / "retained_graph.py"
    record_together(*(dict(out=tmp_path / name, script_args=(mode, scale), script=script) for name, scale in
                      (("a", "1.0"), ("b", "1.0"), ("c", "1.5"))))
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["step"], fd["phase"], fd["boundary"], fd["call"], fd["blame"], fd["fault_class"]) == \
        (2, "backward", "1", 1, "source", "backward"), fd


def test_a_run_that_stops_early_is_said_to_end_where_the_other_goes_on(tmp_path):
    """Helper 33 (Lightning's EarlyStopping): the run that stopped after fewer steps read as "run A
    lacks the final state of M that the other run records", A being the run that trained on."""
    import bitguard

    def train(name, steps):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            sgd_steps(model, opt, steps)

    train("a", 4), train("b", 2)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["kind"], fd["cause"], fd["missing_side"]) == (2, "final", "structure", "a"), fd
    assert fd["blame_window"]["detail"].startswith("run B's recording ends here"), fd
    text = run_cli("compare", tmp_path / "a", tmp_path / "b").stdout
    assert "step 2: run B takes the final state of Sequential (Sequential) here, where run A goes on" in text, text


def test_a_model_rebuilt_mid_run_is_not_said_to_end_the_run(tmp_path):
    """Helper 52: a model and optimizer rebuilt and loaded in the same process (an in-process resume,
    the numbers bitwise the same) read as "run B ends here" at the old model's final state."""
    import bitguard

    def train(name, rebuild):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(4):
                if rebuild and step == 2:
                    state, opt_state = model.state_dict(), opt.state_dict()
                    model, opt = tiny_mlp()
                    model.load_state_dict(state)
                    opt.load_state_dict(opt_state)
                sgd_steps(model, opt, 1)

    train("a", False), train("b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    # (which comes first, the old model's final state or the new one's first call, is when Python lets go of the old
    # one: the frame's variables are read at the new model's first call, and that may free it first)
    assert (fd["step"], fd["cause"], fd["missing_side"]) == (2, "structure", "a"), fd
    if fd["kind"] == "final":
        assert fd["blame_window"]["detail"].startswith("run B took the final state of Sequential (call 0) at step 2 "
                                                       "mid-run, when the training let go of that model"), fd
    else:
        assert fd["kind"] == "params", fd
        assert fd["blame_window"]["detail"].startswith("run B meets a new model here, Sequential#2, of the class of "
                                                       "its Sequential"), fd


def test_a_model_trained_after_another_and_initialised_differently_is_said_to_be(tmp_path):
    """Helper 46 (skorch's GridSearchCV trains clones one after another): the second model, seeded
    differently in run B, was said to be "a copy the training keeps beside (an EMA) or frozen"."""
    import torch

    import bitguard

    def train(name, seed):
        with bitguard.record(tmp_path / name, determinism=False):
            model, opt = tiny_mlp()
            sgd_steps(model, opt, 2)
            torch.manual_seed(seed)  # (the next model of the sweep, built as tiny_mlp builds it)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            sgd_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)

    train("a", 0), train("b", 1)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["kind"], fd["step"], fd["blame"], fd["fault_class"]) == ("params", 2, "source", "params"), fd
    assert fd["blame_window"]["detail"].startswith(
        f"the parameters of {fd['boundary']} differ at its first call, after the training of another model"), fd


def test_a_perturbation_inside_the_first_step_is_said_to_be_one(tmp_path):
    """Helpers 27 and 29: SAM perturbs the weights between two forward passes of a step; a changed
    rho at step 0 was said to be "no optimizer step was recorded: updated outside torch.optim"."""
    import torch

    import bitguard

    def train(name, rho):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                x = torch.randn(2, 4)
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                with torch.no_grad():  # (SAM's first step: towards the sharpest nearby weights)
                    moved = [p.grad * rho for p in model.parameters()]
                    for p, e in zip(model.parameters(), moved):
                        p.add_(e)
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                with torch.no_grad():  # (its second step: back, then the base optimizer's)
                    for p, e in zip(model.parameters(), moved):
                        p.sub_(e)
                opt.step()

    for name, rho in (("a", 0.05), ("b", 0.1)):
        train(name, rho)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["kind"], fd["call"], fd["fault_class"]) == (0, "params", 1, "params"), fd
    assert "changed inside the step" in fd["blame_window"]["detail"], fd["blame_window"]


def test_a_torchscript_model_is_recorded_at_its_boundary(tmp_path):
    """Helper 21: a `torch.jit.script` model's parameters were named through `get_submodule`, which
    TorchScript refuses: collector errors made identical reruns inconclusive, and a learning rate
    changed at step 3 was blamed at step 4 as a difference from before the recorded steps. (Its
    executor's optimizations off: they would make a second training in one process compute other
    bits, as a graph is optimized after its first runs.)"""
    import torch

    import bitguard

    def train(name, lr3):
        torch.manual_seed(0)
        model = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False), torch.jit.optimized_execution(False):
            for step in range(5):
                if step == 3:
                    opt.param_groups[0]["lr"] = lr3
                sgd_steps(model, opt, 1)

    for name, lr3 in (("a", 0.1), ("b", 0.1), ("c", 0.2)):
        train(name, lr3)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (no collector error)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["step"], fd["blame"], fd["fault_class"]) == ("step", 3, "source", "optimizer"), fd


def test_a_step_the_loss_scaler_skipped_is_a_step_run_b_lacks(tmp_path):
    """GradScaler.step skips optimizer.step() on an inf gradient: the step counter stood still, the
    next step's events were numbered as the skipped one's, and the pivot was an "extra" batch."""
    record_together(*(dict(out=tmp_path / name, script_args=("scaler", at), script=BLIND_SPOTS) for name, at in
                      (("a", "-1"), ("b", "1"))))
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    fd = d["first_divergence"]
    assert code == 1 and (fd["step"], fd["phase"], fd["kind"], fd["cause"], fd["missing_side"]) == \
        (1, "optimizer", "step", "structure", "b"), fd
    steps = [e["step"] for e in run_events(tmp_path / "b") if e["kind"] == "batch"]
    assert steps == [0, 1, 2, 3], steps  # four steps, one of them skipped


def test_a_loss_scalers_schedule_that_differs_is_no_identical(tmp_path):
    """Helper 92: GradScaler(growth_factor=2) against 3, its growth interval never reached in the window, compared
    identical: a training that went on, or resumed from the scaler's state_dict, would differ."""
    import torch

    import bitguard

    def train(path, growth_factor):
        model, opt = tiny_mlp()
        scaler = torch.amp.GradScaler("cpu", growth_factor=growth_factor)
        with bitguard.record(path, determinism=False):
            for x in torch.arange(24.0).reshape(3, 2, 4) / 24:
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()

    train(tmp_path / "a", 2.0)
    train(tmp_path / "b", 3.0)
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    reasons = [r["message"] for r in d["certification"]["reasons"] if r["code"] == "final_settings"]
    assert code == 3 and reasons and "growth_factor differs" in reasons[0], (d["verdict"], d["certification"])


def test_identical_across_a_module_type_change_says_so(tmp_path):
    """A module swapped for another class that computes the same (pytorch/examples' PixelShuffle
    for a subclass): identical, and the report says the events were paired across the change."""
    record_together(*(dict(out=tmp_path / name, script_args=("shuffle", view), script=BLIND_SPOTS) for name, view in
                      (("a", "0"), ("b", "1"))))
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    assert code == 0, d["verdict"]
    notes = [r for r in d["certification"]["reasons"] if r["code"] == "retyped"]
    assert len(notes) == 1 and "(PixelShuffle in A, PixelShuffleView in B)" in notes[0]["message"], notes
    text = run_cli("compare", tmp_path / "a", tmp_path / "b").stdout
    assert "note: " in text and "paired across a change of module type" in text, text


def test_identical_numbers_from_different_settings_say_so(tmp_path):
    """Identical, and rightly (every gradient is zero, so the learning rate changes nothing), but the
    runs asked for different learning rates: the document and the report say which."""
    record_together(*(dict(out=tmp_path / name, script_args=("zero", lr), script=BLIND_SPOTS) for name, lr in
                      (("a", "0.1"), ("b", "0.2"))))
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    assert code == 0 and d["first_divergence"] is None
    api = d["api_differences"]
    assert api["rank"] == 0 and {(x["kind"], x["field"], x["a"], x["b"]) for x in api["differences"]} == \
        {("optimizer_step", "groups[0].lr", 0.1, 0.2)}, api
    text = run_cli("compare", tmp_path / "a", tmp_path / "b").stdout
    assert "called the training API differently" in text and "groups[0].lr 0.1 (A) vs 0.2 (B)" in text, text


def test_a_run_recorded_before_params_events_compares_with_a_new_one(tmp_path):
    """A run of schema version 5 has no `params` events: compared with a newer run of the same
    program, they are left out of both sides (absent by construction, not a divergence)."""
    record_together(*(dict(out=tmp_path / name, script_args=("init", "1.0"), script=BLIND_SPOTS) for name in "ab"))
    old = tmp_path / "a"
    as_schema_5(old)
    assert compare_json(old, tmp_path / "b")[0] == 0
    assert compare_json(tmp_path / "b", old)[0] == 0


def test_tensors_inside_a_torch_func_transform_are_digested_as_their_batch(tmp_path):
    """Per-sample gradients (vmap of grad over functional_call): the model's calls inside the
    transform see functorch wrappers without storage of their own. They were marked unobserved,
    so such a run was never certified; each is now digested as the whole batch it is a slice of
    (the plain tensor under the wrappers), its row giving that tensor's shape."""
    import torch
    from torch.func import functional_call, grad, vmap

    import bitguard
    from bitguard.backend.ingest import load_rank, open_run

    # (the gradient of a sum is ones expanded: its contiguous copy for the digest was wrapped again while the
    # transforms were active, and the tensor unobserved: helper 17, every Opacus functorch-mode run inconclusive)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.LayerNorm(3), torch.nn.Linear(3, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x):
        return functional_call(model, p, (x.unsqueeze(0),)).sum()  # (its gradient: ones, expanded)

    with bitguard.record(tmp_path / "run", determinism=False):
        vmap(grad(loss), in_dims=(None, 0))(params, torch.randn(5, 6, 4))
    run = open_run(tmp_path / "run")
    # (the one error: functional_call's tensors stood in for the parameters, and no optimizer step recorded them)
    assert [e for e in run.manifest["collector_errors"] if "(functional_call)" not in e] == [], \
        run.manifest["collector_errors"]
    events, tensors, _ = load_rank(run, 0)
    assert tensors["unobserved"].drop_nulls().to_list() == []
    tanh = events.filter(events["boundary"] == "1")["seq"].to_list()
    outputs = tensors.filter(tensors["seq"].is_in(tanh) & (tensors["role"] == "output"))["shape"].to_list()
    assert outputs and all(shape == [5, 1, 6, 3] for shape in outputs), outputs  # the 5 samples' batch, at once


@pytest.mark.parametrize("plant, where", [
    (None, None),
    # member 2's weight, edited after step 1's update: the stacked tensor only the optimizer holds
    ("middle", (2, "params", "SGD", [".param_groups[0][0]"])),
    ("end", (3, "final", "SGD", [".param_groups[0][2]"]))])  # after the last step: only the optimizer held it
def test_an_ensemble_trained_under_vmap_on_a_meta_base_model_is_compared(tmp_path, plant, where):
    """pytorch/tutorials' model ensembling (stack_module_state, a base model on the meta device,
    vmap over functional_call), trained with SGD on the stacked weights: every identical pair was
    inconclusive (the wrappers inside vmap unobserved, the meta base model's final state
    unreadable), an edit of one member's weight was blamed on another parameter, and one after the
    last step was observed nowhere."""
    import copy

    import torch
    from torch.func import functional_call, stack_module_state, vmap

    import bitguard

    def train(out, plant):
        torch.manual_seed(0)
        members = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)) for _ in range(3)]
        params, buffers = stack_module_state(members)
        base = copy.deepcopy(members[0]).to("meta")
        opt = torch.optim.SGD(params.values(), lr=0.1)
        with bitguard.record(out, determinism=False):
            for step in range(3):
                x = torch.randn(5, 4)
                out_ = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers, x)
                opt.zero_grad()
                out_.pow(2).mean().backward()
                opt.step()
                with torch.no_grad():
                    if (plant, step) in (("middle", 1), ("end", 2)):
                        params["2.weight" if plant == "end" else "0.weight"][2, 0, 0] += 1e-3

    train(tmp_path / "a", None)
    train(tmp_path / "b", plant)
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    if where is None:
        assert code == 0, d["certification"]
        return
    fd = d["first_divergence"]
    differing = sorted(t["path"] for t in fd["tensors"] if t["differs"])
    assert code == 1 and (fd["step"], fd["kind"], fd["boundary"], differing) == where, fd


def test_a_structure_divergence_where_every_paired_event_is_equal_says_so(tmp_path):
    """Helper 55 (timm's checkpoint_seq calls a Sequential's blocks one by one, the container never): "run B
    lacks the forward of blocks" alone, where every event both runs record is equal, left the user to find
    that out. The pivot's notes say it."""
    import torch

    import bitguard

    def train(name, by_parts):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                opt.zero_grad()
                x = torch.randn(2, 4)
                if by_parts:
                    for part in model:
                        x = part(x)
                else:
                    x = model(x)
                x.pow(2).mean().backward()
                opt.step()

    train("a", False)
    train("b", True)
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    fd = d["first_divergence"]
    assert code == 1 and fd["cause"] == "structure", fd
    assert any(n.startswith("every event both runs record has equal digests") for n in fd["notes"]), fd["notes"]


def test_an_rng_state_one_run_alone_records_is_not_said_to_be_unreadable(tmp_path):
    """Helper 58: a child's call wrapped in `fork_rng()` + `manual_seed()` in run B only; the pivot's detail said
    the parent's RNG state "could not be observed (a tensor the digest cannot read)": run A alone records it."""
    import torch

    import bitguard

    class Noisy(torch.nn.Module):
        def forward(self, x):
            return x + torch.randn_like(x)

    class M(torch.nn.Module):
        def __init__(self, plant):
            super().__init__()
            self.a, self.n, self.b, self.plant = torch.nn.Linear(4, 4), Noisy(), torch.nn.Linear(4, 1), plant

        def forward(self, x):
            h = self.a(x)
            if self.plant:
                with torch.random.fork_rng():
                    torch.manual_seed(123)
                    return self.b(self.n(h))
            return self.b(self.n(h))

    for name, plant in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = M(plant)
        with bitguard.record(tmp_path / name, determinism=False):
            model(torch.ones(2, 4)).pow(2).mean().backward()
    fd = compare_json(tmp_path / "a", tmp_path / "b")[1]["first_divergence"]
    detail = fd["blame_window"]["detail"]
    # (a call that draws in one run alone is a difference since helper 60, not a tensor unobserved: n's window is
    # M's own code between its children a and n, where run B forked and reseeded the generator)
    assert fd["boundary"] == "n" and "between its observed children, before n: after a, or before it" in detail, (fd, detail)
    assert "could not be observed" not in detail, detail


def test_an_evaluation_without_eval_is_a_mode_change_not_moved_weights(tmp_path):
    """Helper 48 (MONAI): `model.eval()` forgotten before an evaluation in run B, on a model without
    dropout or norms (the same numbers): run A's params event at the evaluation's call, taken for
    the mode change, was said to show weights "changed between two of its calls"."""
    import torch

    import bitguard

    def train(name, evaluate_in_eval_mode):
        model, opt = tiny_mlp()
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                model.train()
                sgd_steps(model, opt, 1)
                if evaluate_in_eval_mode:
                    model.eval()
                with torch.no_grad():
                    model(torch.randn(2, 4))

    train("a", True), train("b", False)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["kind"], fd["cause"], fd["blame"]) == ("params", "structure", "structure"), fd
    assert "equal to those at its first call: the weights did not move, but run A called the model again in this " \
        "step after a backward, or after its mode changed (train()/eval())" in fd["blame_window"]["detail"], fd


def test_a_parameter_free_module_drawing_from_a_reseeded_generator_is_said_to_be_the_rng(tmp_path):
    """Helper 68: a noise module (kornia's augmentations alike) given the same tensors drew from a generator reseeded in
    one run at step 1. Its RNG state was the only differing input, and the pivot said "the inputs differ ... they come
    from the training's own code or data"; it is the RNG state, as a batch's is."""
    import torch

    import bitguard

    class Noise(torch.nn.Module):
        def forward(self, x):
            return x + 0.1 * torch.randn_like(x)

    def train(name, reseed):
        torch.manual_seed(0)
        aug, net = Noise(), torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        x = torch.randn(8, 4)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                if reseed and step == 1:
                    torch.manual_seed(1)
                net(aug(x)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

    train("a", False), train("b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["boundary"], fd["blame"], fd["fault_class"]) == (1, "Noise", "data", "rng"), fd
    assert "the RNG state it began from differs" in fd["blame_window"]["detail"], fd["blame_window"]


def test_a_part_called_alone_is_named_by_its_path_in_the_model_from_its_first_call(tmp_path):
    """Helper 68: `model.nll(x)` runs `self.inner.inv(x)`, a method, which calls `self.net`: that part was named
    `net` at step 0 and `model.inner.net` from the step after (the look for kept models after the first steps found
    `model`), so a run resumed at step 2 named its first step apart from the same step of the run it resumed, and a
    correct resume diverged. The model holding the part is looked for at the part's first call, and named as a called
    model is (by its class), so that a variable renamed renames nothing (helper 70)."""
    import torch

    import bitguard

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3, 3)

        def inv(self, x):
            return self.net(x)

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def nll(self, x):
            return self.inner.inv(x).pow(2).mean()

    def train(name, steps, state=None):
        torch.manual_seed(0)
        model = Outer()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if state is not None:
            model.load_state_dict(state[0]), opt.load_state_dict(state[1])
        x = torch.arange(24.0).reshape(4, 2, 3) / 24
        with bitguard.record(tmp_path / name, determinism=False):
            for step in steps:
                model.nll(x[step]).backward()
                opt.step()
                opt.zero_grad()
        return model.state_dict(), opt.state_dict()

    train("full", range(4))
    train("resumed", range(2, 4), train("first", range(2)))
    c = bitguard.compare(tmp_path / "full", tmp_path / "resumed", resumed_at=2)
    assert c.verdict == "identical", c.to_dict()["first_divergence"]
    names = set(c.events().filter(c.events()["kind"] == "module")["boundary"].to_list())
    assert names == {"inner.net"}, names  # (as when the model calls it: its path there; helper 70, a variable renamed)


def test_a_step_ended_after_another_micro_batch_is_not_said_to_be_a_mode_change(tmp_path):
    """Helper 70: gradient accumulation over two micro-batches whose step() comes after the first in run B: run A's
    parameters taken again at its second call of step 0 were explained as a train()/eval() change, which no run made."""
    import torch

    import bitguard

    def train(name, inverted):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        xs = torch.randn(4, 2, 3)
        with bitguard.record(tmp_path / name, determinism=False):
            for it in range(2):
                for micro in range(2):
                    model(xs[it * 2 + micro]).pow(2).mean().backward()
                    if (micro == 1) != inverted:
                        opt.step()
                        opt.zero_grad()

    train("a", False), train("b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["kind"], fd["blame"]) == (0, "params", "structure"), fd
    assert "its step ended sooner (an optimizer step() after fewer micro-batches" in fd["blame_window"]["detail"], fd


def test_a_parameter_one_model_alone_has_is_the_pivot_at_its_params_event(tmp_path):
    """Helper 86 (GluonTS: a StudentT output's three projections against a Normal's two): the params event
    holding the extra head's parameters was passed over as a signature change, and the pivot came at the
    batch, "the RNG state differs" (the extra head drew its initial weights)."""
    import torch

    import bitguard

    class Heads(torch.nn.Module):
        def __init__(self, heads):
            super().__init__()
            self.body = torch.nn.Linear(4, 8)
            self.proj = torch.nn.ModuleList(torch.nn.Linear(8, 1) for _ in range(heads))

        def forward(self, x):
            h = self.body(x).relu()
            return sum(p(h) for p in self.proj)

    def train(path, heads):
        torch.manual_seed(0)
        model = Heads(heads)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(path, determinism=False):
            sgd_steps(model, opt, 2)

    for name, heads in (("a", 3), ("b", 3), ("c", 2)):
        train(tmp_path / name, heads)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["step"], fd["kind"], fd["boundary"]) == (0, "params", "Heads"), fd
    assert any("run A's model alone has 2 parameter(s) here (proj.2.weight, proj.2.bias)" in n for n in fd["notes"]), \
        fd["notes"]


@pytest.mark.parametrize("planted", [False, True])
def test_module_calls_on_another_thread_are_not_paired_by_timing(tmp_path, planted):
    """Helper 84 (MONAI's ThreadDataLoader and CacheDataset, kornia's augmentations: modules called on a
    prefetching thread): their events took the training's step by timing, and unchanged reruns diverged
    (a structure pivot, "optimizer_step called in A, not called in B"; the augmentation's draws from the
    CPU generator moved its state between the training's steps). Here the thread runs ahead of the training
    in one run and alongside it in the other. Their calls are not recorded; what they make is, as the
    model's input; the CPU generator's state is not compared there, and the report says both."""
    import queue
    import threading

    import torch

    import bitguard

    class Flip(torch.nn.Module):  # (draws from the CPU generator, as kornia's augmentations do)
        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, x):
            return x.flip(-1) if torch.rand(()) < self.p else x

    def train(path, ahead, p):
        model, opt = tiny_mlp()
        batches = torch.arange(48.0).reshape(6, 2, 4) / 48
        flip, made = Flip(p), queue.Queue(maxsize=0 if ahead else 1)
        with bitguard.record(path, determinism=False):
            producer = threading.Thread(target=lambda: [made.put(flip(b)) for b in batches], name="prefetch")
            producer.start()
            if ahead:
                producer.join()
            for _ in batches:
                opt.zero_grad()
                model(made.get()).pow(2).mean().backward()
                opt.step()
            producer.join()

    train(tmp_path / "a", True, 0.5)
    train(tmp_path / "b", False, 0.9 if planted else 0.5)
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    reasons = [r["message"] for r in d["certification"]["reasons"] if r["code"] == "threads"]
    assert reasons and "(run A: 6 on prefetch; run B: 6 on prefetch)" in reasons[0], d["certification"]["reasons"]
    if planted:  # (the flips the augmentation drew differ: the model's input does)
        fd = d["first_divergence"]
        assert code == 1 and (fd["kind"], fd["blame"]) == ("batch", "data"), fd
    else:
        assert code == 0, (d["verdict"], d["first_divergence"])


def test_a_thread_that_never_draws_leaves_the_generators_state_compared(tmp_path):
    """Module calls on another thread left the CPU generator's state out of the comparison in every case,
    also where that thread never drew from it: a reseed at step 2 that nothing drew from after (the data
    made on a prefetching thread by a module that draws nothing) compared identical. The generator is left
    out only where a thread's calls moved it."""
    import queue
    import threading

    import torch

    import bitguard

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 0.5

    def train(path, reseed):
        model, opt = tiny_mlp()
        batches = torch.arange(48.0).reshape(6, 2, 4) / 48
        scale, made = Scale(), queue.Queue()
        with bitguard.record(path, determinism=False):
            producer = threading.Thread(target=lambda: [made.put(scale(b)) for b in batches], name="prefetch")
            producer.start()
            producer.join()
            for step, _ in enumerate(batches):
                if reseed and step == 2:
                    torch.manual_seed(7)
                opt.zero_grad()
                model(made.get()).pow(2).mean().backward()
                opt.step()

    train(tmp_path / "a", False)
    train(tmp_path / "b", True)
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    fd = d["first_divergence"]
    assert code == 1 and fd["step"] == 2 and "rng" in {t.get("role") for t in fd["tensors"]}, (d["verdict"], fd)
    reasons = [r["message"] for r in d["certification"]["reasons"] if r["code"] == "threads"]
    assert reasons and "did not draw" in reasons[0], d["certification"]["reasons"]


def test_a_container_whose_random_pick_changed_is_said_to_be_the_rng(tmp_path):
    """Helper 84 (kornia's AugmentationSequential(random_apply=1), torchvision's RandomChoice, reseeded at step 2):
    the child the container picked changed, and the pivot said "a module was skipped or added, a branch changed",
    never naming the RNG state the container's call began from, which differs."""
    import torch

    import bitguard

    class Flip(torch.nn.Module):
        def forward(self, x):
            return x.flip(-1)

    class Shift(torch.nn.Module):
        def forward(self, x):
            return x + 0.01

    class PickOne(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.opts = torch.nn.ModuleList([Flip(), Shift()])

        def forward(self, x):
            return self.opts[int(torch.randint(0, 2, ()))](x)

    def train(name, reseed):
        model, opt = tiny_mlp()
        pick, batches = PickOne(), torch.arange(40.0).reshape(5, 2, 4) / 40
        with bitguard.record(tmp_path / name, determinism=False):
            for step, x in enumerate(batches):
                if reseed and step == 2:
                    torch.manual_seed(123)
                opt.zero_grad()
                model(pick(x)).pow(2).mean().backward()
                opt.step()

    train("a", False), train("b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["blame"], fd["fault_class"], fd["blame_window"]["module"]) == (2, "data", "rng", "PickOne"), fd
    assert "the RNG state the call of PickOne around it began from differs" in fd["blame_window"]["detail"]


def test_a_mode_change_a_forward_pre_hook_reads_is_listed(tmp_path):
    """Helper 85 (torch.nn.utils.spectral_norm, the hook-based one: its forward pre-hook runs the power iteration in
    training mode only): eval() at step 2 in one run was said to be "spectral norm's vectors edited", with no mode
    change listed among the training API calls that differ."""
    import torch

    import bitguard

    def train(path, evaluated):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.utils.spectral_norm(torch.nn.Linear(4, 4)), torch.nn.Tanh(),
                                    torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(path, determinism=False):
            for step in range(3):
                model[0].train(not (evaluated and step == 2))  # (the layer alone: the root's mode is listed anyway)
                opt.zero_grad()
                model(torch.ones(2, 4) * (step + 1)).pow(2).mean().backward()
                opt.step()

    train(tmp_path / "a", False), train(tmp_path / "b", True)
    api = compare_json(tmp_path / "a", tmp_path / "b")[1]["first_divergence"]["api_differences"]["differences"]
    assert [(d["step"], d["kind"], d["field"]) for d in api if d["kind"] == "modes"][:1] == [(2, "modes", "eval")], api
