"""What the training keeps beside its weights is compared: module buffers (running statistics) at each
call of their module, and every root the training keeps (an EMA, an averaged model, clones) in its final state
when the recording ends, wherever the script holds it."""

import textwrap

import pytest

from .conftest import record_together
from .spots import BLIND_SPOTS, ShadowEMA, compare_json, planted_pair, run_events, sgd_steps, tiny_mlp

pytestmark = pytest.mark.slow


def test_a_buffer_updated_differently_is_a_divergence_at_its_module(tmp_path):
    record_together(dict(out=tmp_path / "a", script_args=("bn", "0.1"), script=BLIND_SPOTS),
                    dict(out=tmp_path / "b", script_args=("bn", "0.2"), script=BLIND_SPOTS))
    code, d = compare_json(tmp_path / "a", tmp_path / "b")
    fd = d["first_divergence"]
    assert code == 1 and (fd["step"], fd["phase"], fd["module_type"]) == (0, "forward", "BatchNorm1d")
    differing = {t["path"] for t in fd["tensors"] if t["differs"]}
    assert {".running_mean", ".running_var"} <= differing and all(
        t["role"] == "state" for t in fd["tensors"] if t["differs"])


@pytest.mark.parametrize("mode", ["full", "trusted"])
def test_a_buffer_of_a_part_run_through_its_forward_is_seen_at_the_call_that_ran_it(tmp_path, mode):
    """Helper 48: lightly's loss runs its memory bank through `self.bank.forward(...)`, no call of the
    bank's own, so its buffer was seen only at the end, and a bank not updated at step 0 showed first at
    step 1 as the loss computing differently. The call that ran it now holds the part's buffers."""
    import torch

    import bitguard
    from bitguard.backend.report import render_text

    class Bank(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("queue", torch.zeros(8, 4))

        def forward(self, k, update):
            negatives = self.queue.clone()
            if update:
                self.queue[:4] = k.detach()
            return negatives

    class ContrastiveNorm(torch.nn.Module):  # (a "Norm": trusted mode records its calls too)
        def __init__(self, update):
            super().__init__()
            self.bank, self.update = Bank(), update

        def forward(self, q, k):
            negatives = self.bank.forward(k, self.update)
            logits = torch.cat([(q * k).sum(1, keepdim=True), q @ negatives.T], 1)
            return torch.nn.functional.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))

    def train(name, update):
        torch.manual_seed(0)
        net, loss = torch.nn.Linear(4, 4), ContrastiveNorm(update)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, mode=mode, determinism=False):
            for _ in range(3):
                x = torch.randn(4, 4)
                loss(net(x), net(x + 0.1).detach()).backward()
                opt.step()
                opt.zero_grad()

    for name, update in (("a", True), ("b", True), ("c", False)):
        train(name, update)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    c = bitguard.compare(tmp_path / "a", tmp_path / "c")
    fd = c.to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["boundary"]) == (0, "forward", "ContrastiveNorm"), fd
    assert [(t["role"], t["path"]) for t in fd["tensors"] if t["differs"]] == [("state", ".bank.queue")], fd
    assert "only buffers of bank differ" in render_text(c), render_text(c)


@pytest.mark.parametrize("how", ["extra_state", "quantized"])
def test_state_a_module_saves_apart_from_its_weights_is_in_the_final_state(tmp_path, how):
    """Helper 53 (torch.ao QAT converted in place): a quantized Linear keeps its scale, zero point and
    packed weights apart from its parameters and buffers, so a model converted from other observer
    statistics compared identical. What a part's state_dict holds beyond them (its own
    `_save_to_state_dict`, `get_extra_state`) is in the final state."""
    import torch

    import bitguard

    class Scaled(torch.nn.Module):  # (state only its state_dict says: TransformerEngine's FP8 metadata is such)
        def __init__(self):
            super().__init__()
            self.lin, self.scale = torch.nn.Linear(4, 1), 1.0

        def forward(self, x):
            return self.lin(x) * self.scale

        def get_extra_state(self):
            return {"scale": self.scale}

        def set_extra_state(self, state):
            self.scale = state["scale"]

    def train(out, changed):
        torch.manual_seed(0)
        if how == "extra_state":
            model = Scaled()
        else:
            model = torch.nn.Sequential(torch.ao.quantization.QuantStub(), torch.nn.Linear(4, 1),
                                        torch.ao.quantization.DeQuantStub())
            model.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
            torch.ao.quantization.prepare_qat(model, inplace=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(out, determinism=False):
            sgd_steps(model, opt, 2)
            if how == "extra_state":
                model.scale = 0.5 if changed else 1.0  # (set after the last step)
            else:
                model.eval()
                if changed:  # (other observer statistics than the training's)
                    model[1].activation_post_process.activation_post_process.min_val.mul_(2.0)
                torch.ao.quantization.convert(model, inplace=True)

    fd = planted_pair(tmp_path, train, False, True)
    assert (fd["kind"], fd["fault_class"]) == ("final", "final_state"), fd
    differing = [t["path"] for t in fd["tensors"] if t["differs"]]
    assert differing == (["._extra_state['scale'] (python float)"] if how == "extra_state" else
                         [".1.scale"]), \
        fd["tensors"]


def test_an_averaged_model_never_called_has_its_final_state(tmp_path):
    """torch.optim.swa_utils.AveragedModel (SWA, EMA) is updated after the steps and often never
    called: no root module call met it, and a skipped update compared identical."""
    record_together(*(dict(out=tmp_path / name, script_args=("swa", skip), script=BLIND_SPOTS) for name, skip in
                      (("a", "-1"), ("b", "-1"), ("c", "1"))))
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    # (named by its variable: the code that called step() holds it, and that is where it is first met)
    assert code == 1 and (fd["kind"], fd["boundary"], fd["module_type"]) == ("final", "averaged", "AveragedModel"), fd
    assert {t["path"] for t in fd["tensors"] if t["differs"]} >= {".module.0.weight", ".n_averaged"}


@pytest.mark.parametrize("mode, boundary, module_type", [
    # an EMA copy made by deepcopy and updated in place under no_grad, kept by a trainer object
    ("ema", "ema", "Sequential"),
    # diffusers' EMAModel: no module, a list of tensors updated in place, a root of its own
    ("shadow", "ema.shadow_params", "KeptTensors"),
    # the same kept by the model itself (helper 13: Lightning, Fabric), where a weak proxy of the model
    # (Lightning's profiler holds one) made every recording inconclusive, and a batch list was taken
    # for shadow weights
    ("ema_attr", "m.ema.shadow_params", "KeptTensors"),
    # a dict of shadow tensors by name, each replaced by a new tensor at every update
    ("ema_dict", "shadow", "KeptTensors"),
    # helpers 27 and 29: made after the fifth of seven steps, between two of the looks (steps 1-4, then powers
    # of two): found at the next step, since the frames hold a variable of another type than at the last look
    ("ema_late", "late", "KeptTensors"),
    # helper 27: skorch's callbacks, [(name, callback)] in the trainer object, were deeper than the look went
    ("ema_callback", "net.callbacks_.0.1.shadow", "KeptTensors"),
    # helper 29: held by an optimizer step post-hook's closure alone (the hook's dict keys are handle numbers,
    # which count the process's hooks: named by position)
    ("ema_hook", "opt._optimizer_step_post_hooks.0.shadow", "KeptTensors")])
def test_what_the_training_keeps_but_never_calls_has_its_final_state(tmp_path, mode, boundary, module_type):
    """Never called (saved, or evaluated after the recording): no root call met it, and another decay
    compared identical. It is found among the variables of the code that called step() and named by
    where it was found."""
    import duckdb

    record_together(*(dict(out=tmp_path / name, script_args=(mode, decay), script=BLIND_SPOTS) for name, decay in
                      (("a", "0.9"), ("b", "0.9"), ("c", "0.8"))))
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["boundary"], fd["module_type"]) == ("final", boundary, module_type), fd
    # (helper 60: an EMA's shadow weights were said to be "the buffers at the end of the recording")
    assert fd["blame_window"]["detail"].startswith("the kept tensors" if module_type == "KeptTensors" else "the "), fd
    with duckdb.connect(str(tmp_path / "a" / "rank-0.duckdb"), read_only=True) as con:
        kept = {b for (b,) in con.execute("SELECT boundary FROM events WHERE kind = 'final' AND module_type = "
                                          "'KeptTensors'").fetchall()}
    assert kept == ({boundary} if module_type == "KeptTensors" else set()), kept  # (not the batch)


def test_a_dict_of_clones_made_at_every_step_is_one_kept_root_holding_the_newest(tmp_path):
    """Helper 72: a snapshot of the weights made anew at every step (`snap = {k: v.clone() ...}`) was
    a kept root a step (`snap`, `snap#2`, ...), each held to the end: a copy of the weights a step,
    more memory than the training's own. A new container in the same variable is the same root now,
    holding the newest only; and its last state is still compared."""
    import gc
    import weakref

    import duckdb

    import bitguard

    def train(name, scale):
        model, opt = tiny_mlp()
        made = []
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(6):
                snap = {k: v.detach().clone() * (scale if step == 5 else 1.0) for k, v in model.named_parameters()}
                made.append(weakref.ref(snap["0.weight"]))  # (a dict has no weak reference: its tensor)
                sgd_steps(model, opt, 1)
            gc.collect()
            alive = sum(r() is not None for r in made)
        assert snap is not None and alive <= 2, alive  # (this step's, and the one the last look took)

    for name, scale in (("a", 1.0), ("b", 1.0), ("c", 2.0)):
        train(name, scale)
    with duckdb.connect(str(tmp_path / "a" / "rank-0.duckdb"), read_only=True) as con:
        finals = sorted(b for (b,) in con.execute("SELECT boundary FROM events WHERE kind = 'final'").fetchall())
    assert finals == ["Sequential", "snap"], finals
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["boundary"]) == ("final", "snap"), fd


def test_an_ema_made_after_the_last_step_is_found_when_the_recording_ends(tmp_path):
    """Kept models are looked for at some optimizer steps; one made after the last of them (an
    average taken once training is done) is looked for again as `with bitguard.record()` ends."""
    import copy

    import torch

    import bitguard

    def train(out, decay):
        model, opt = tiny_mlp()
        with bitguard.record(out, determinism=False):
            for _ in range(3):
                loss = model(torch.randn(2, 4)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            late = copy.deepcopy(model).requires_grad_(False)
            with torch.no_grad():
                for p in late.parameters():
                    p.mul_(decay)

    for name, decay in (("a", 0.5), ("b", 0.5), ("c", 0.25)):
        train(tmp_path / name, decay)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    assert code == 1 and (d["first_divergence"]["kind"], d["first_divergence"]["boundary"]) == ("final", "late"), d


def test_a_kept_ema_called_for_an_evaluation_is_named_and_blamed_as_one(tmp_path):
    """Helper 34 (timm's ModelEmaV2): an EMA kept as `ema` and called as `ema.module(x)` for an
    evaluation was named `module`, its parameters by the trained model's names, and a changed decay
    read as "code outside torch.optim changed them after the last step() (a clamp ...)"."""
    import copy

    import torch

    import bitguard

    class Ema(torch.nn.Module):
        def __init__(self, model, decay):
            super().__init__()
            self.module, self.decay = copy.deepcopy(model), decay

        @torch.no_grad()
        def update(self, model):
            for e, m in zip(self.module.parameters(), model.parameters()):
                e.mul_(self.decay).add_(m, alpha=1 - self.decay)

    def train(name, decay):
        model, opt = tiny_mlp()
        ema = Ema(model, decay)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(4):
                sgd_steps(model, opt, 1)
                ema.update(model)
                if step == 2:
                    with torch.no_grad():
                        ema.module(torch.randn(2, 4))

    train("a", 0.9), train("b", 0.98)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["kind"], fd["boundary"], fd["blame"], fd["fault_class"]) == ("params", "ema.module", "source", "params"), fd
    assert fd["blame_window"]["detail"].startswith(
        "the parameters of ema.module differ at the start of this step, and no optimizer step before updated them: "
        "they are not the trained parameters but a copy the training keeps"), fd


def test_a_lazy_module_s_parameters_are_recorded_once_made(tmp_path):
    """Helper 21: PyG's lazy layers (`-1` sizes), as torch's LazyLinear, hold uninitialized parameters
    until their first call: hooking and digesting them were collector errors, and identical reruns
    were inconclusive. They are hooked and recorded once made (materialized in place). One the training
    keeps and never calls (PyG's original module after to_hetero, helper 49) is no collector error."""
    import torch

    import bitguard

    def train(name, edit):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.Tanh(), torch.nn.LazyLinear(1))
        spare = torch.nn.LazyLinear(3)  # noqa: F841 - kept, never called
        with bitguard.record(tmp_path / name, determinism=False):
            with torch.no_grad():
                model(torch.randn(2, 4))  # (made by a dummy batch, as PyG's examples do)
            if edit:
                with torch.no_grad():
                    model[2].weight[0, 0] += 1e-3
            sgd_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)

    for name, edit in (("a", False), ("b", False), ("c", True)):
        train(name, edit)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (no collector error)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["boundary"], fd["step"], fd["fault_class"]) == ("params", "Sequential", 0, "params"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == [".2.weight"], fd["tensors"]


def test_a_step_window_ends_with_the_state_it_left(tmp_path):
    """Helper 20: an EMA update skipped inside `--steps 2:4` compared identical "within the recorded
    steps": the EMA is seen at the final state and at saves, both after the window. When a window
    ends and the training goes on, the final state of what it holds is taken then."""
    import copy

    import torch

    import bitguard

    def train(name, skip):
        model, opt = tiny_mlp()
        ema = copy.deepcopy(model).requires_grad_(False)
        with bitguard.record(tmp_path / name, determinism=False, steps=(1, 3)):
            for step in range(5):
                sgd_steps(model, opt, 1)
                if not (skip and step == 2):
                    with torch.no_grad():
                        for e, p in zip(ema.parameters(), model.parameters()):
                            e.lerp_(p, 0.1)

    for name, skip in (("a", False), ("b", False), ("c", True)):
        train(name, skip)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["boundary"], fd["step"], fd["fault_class"]) == ("final", "ema", 2, "final_state"), fd


@pytest.mark.parametrize("how", ["moved", "made-anew", "hooked"])
def test_an_ema_whose_list_or_object_is_replaced_after_the_last_look_is_compared(tmp_path, how):
    """Helper 30: diffusers' EMAModel moved between steps (`to()` makes a new list of shadow weights)
    or made anew in the same variable at step 9 of 12, then edited at step 10: identical, exit 0. The
    look held the list it found, and no look came after (steps 1-4, 8). A kept list is read again from
    the attribute that held it, and a variable the last look found an EMA through, bound anew, makes
    a look. And one EMA also held by a hook's closure is named by its shortest path: a run that
    registers no hook (`hooked`) names it as the others do."""
    import torch

    import bitguard

    def train(edit):
        model, opt = tiny_mlp()
        ema = ShadowEMA(model)
        if how == "hooked" and edit:
            def hook(*_):  # (a closure over the EMA, walked before the variable: as accelerate's save hook)
                return ema
        for step in range(12):
            sgd_steps(model, opt, 1)
            if how == "made-anew" and step == 9:
                ema = ShadowEMA(model)
            ema.step(model)
            if how == "moved":
                ema.to(torch.float64)
                ema.to(torch.float32)
            if edit and how != "hooked" and step == 10:
                with torch.no_grad():
                    ema.shadow_params[1].add_(1e-3)

    def run(out, edit):  # (the EMA is local to train(): gone when the recording ends, as under `bitguard record`)
        with bitguard.record(out, determinism=False):
            train(edit)

    for name, edit in (("a", False), ("b", False), ("c", True)):
        run(tmp_path / name, edit)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    if how == "hooked":
        assert code == 0, d["first_divergence"]
        return
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["boundary"].partition("#")[0]) == ("final", "ema.shadow_params"), fd


@pytest.mark.parametrize("began", ["in-a-function-of-the-script", "by-a-function-that-returned"])
def test_a_kept_ema_is_found_wherever_the_recording_was_begun(tmp_path, began):
    """A look for kept models walks the frames up to the one that began the recording (`with
    bitguard.record()`), where it still runs: its callers' variables are not the training's (a
    test's thirty frames of pytest were walked at every look, half an in-process recording's time).
    An EMA only a script's globals hold, updated under a function of the script that begins the
    recording, is still found (module-level frames are walked), and so is one a caller of a function
    that began the recording and returned holds (every frame is walked then); a model only the
    frames outside hold is not the training's."""
    import torch

    import bitguard

    outside, _ = tiny_mlp()  # (only this frame holds it: outside the recording, never a root)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        model, opt = tiny_mlp()
        ema = ShadowEMA(model)

        def train(out, edit):
            with bitguard.record(out, determinism=False):
                for step in range(3):
                    sgd_steps(model, opt, 1)
                    ema.step(model)
                if edit:
                    nudge(ema)

        train(OUT, EDIT)
        """))

    def nudge(ema):
        with torch.no_grad():
            ema.shadow_params[1].add_(1e-3)

    def begin(out):
        recording = bitguard.record(out, determinism=False)
        recording.__enter__()
        return recording

    def end(recording):
        recording.__exit__(None, None, None)

    def loop(out, edit):  # (the EMA is held here only: not by the function stepping, nor the one ending)
        model, opt = tiny_mlp()
        ema = ShadowEMA(model)
        recording = begin(out)
        for _ in range(3):
            sgd_steps(model, opt, 1)
            ema.step(model)
        if edit:
            nudge(ema)
        end(recording)

    for name, edit in (("a", False), ("b", False), ("c", True)):
        if began == "in-a-function-of-the-script":
            exec(compile(script.read_text(), str(script), "exec"),
                 {"tiny_mlp": tiny_mlp, "ShadowEMA": ShadowEMA, "sgd_steps": sgd_steps, "bitguard": bitguard,
                  "nudge": nudge, "OUT": tmp_path / name, "EDIT": edit})
        else:
            loop(tmp_path / name, edit)
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["boundary"].partition("#")[0]) == ("final", "ema.shadow_params"), fd
    if began == "in-a-function-of-the-script":
        finals = {e["boundary"] for e in run_events(tmp_path / "a") if e["kind"] == "final"}
        assert not any(b.startswith("outside") for b in finals), finals
    del outside


def test_a_window_the_training_never_reaches_is_said_at_the_end_of_the_recording(tmp_path, capsys):
    """Helper 29: a loop that updates its weights by hand is all step 0, so `--steps 2:4` recorded
    nothing and the user learned it only from compare; the recording's end says so, once."""
    import torch

    import bitguard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    with bitguard.record(tmp_path / "hand", determinism=False, steps=(2, 4)):
        for _ in range(5):
            model.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    lines = [line for line in capsys.readouterr().err.splitlines() if "--steps" in line]
    assert len(lines) == 1 and "--steps 2:4 recorded no step" in lines[0] and "without torch.optim" in lines[0], lines
    model, opt = tiny_mlp()
    with bitguard.record(tmp_path / "optim", determinism=False, steps=(2, 4)):
        sgd_steps(model, opt, 5)
    assert "--steps" not in capsys.readouterr().err


def test_a_model_local_to_main_keeps_its_final_state(tmp_path):
    """The usual layout, everything inside main(): the model is gone when the recording ends, and
    with it the final-state event, so an edit after the last step() compared identical. The
    collector holds the roots it met until then (or takes their final state when the script
    drops them); a model trained and dropped before the next one is let go of at the next step."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import gc, sys, weakref, torch

        def train(scale, seed):
            torch.manual_seed(seed)
            m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(2):
                opt.zero_grad()
                m(torch.ones(2, 4)).pow(2).mean().backward()
                opt.step()
            with torch.no_grad():
                m[1].weight.mul_(scale)  # after the last step: only the final state sees it
            return weakref.ref(m)

        def main():
            first = train(1.0, 0)  # a model trained and dropped
            second = train(float(sys.argv[1]), 1)
            gc.collect()
            assert first() is None, "the first model is still held after the second one's steps"
            assert second() is not None  # held by the recording until it ends

        main()
    """))
    record_together(dict(out=tmp_path / "a", script_args=("1.0",), script=script),
                    dict(out=tmp_path / "b", script_args=("1.0",), script=script),
                    dict(out=tmp_path / "c", script_args=("0.5",), script=script))
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = compare_json(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["fault_class"], fd["boundary"]) == ("final", "final_state", "Sequential#2"), fd


def _ddp_dropped(path, edit: float) -> None:
    """A DDP-wrapped model trained in a function that drops the wrapper and its optimizer when it
    returns, without destroy_process_group() (what Lightning's and Fabric's teardown amounts to),
    one weight edited after the last step by `edit`."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}.rendezvous", rank=0, world_size=1)
    try:
        def train():
            model, opt = tiny_mlp()
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            for _ in range(2):
                opt.zero_grad()
                ddp(torch.randn(3, 4)).pow(2).mean().backward()
                opt.step()
            with torch.no_grad():
                model[2].bias += edit

        import bitguard

        with bitguard.record(path, determinism=False):
            train()
    finally:
        dist.destroy_process_group()


def test_a_ddp_model_dropped_without_destroy_process_group_keeps_its_final_state(tmp_path):
    """helper 15 (Lightning and Fabric under torchrun): the DDP wrapper is not held (destroyed after
    the process group, its threads abort the process), Lightning unwraps it at the end and the script's
    return drops the optimizer: no final event, and an edit after the last step compared identical."""
    fd = planted_pair(tmp_path, _ddp_dropped, 0.0, 1e-3)
    assert (fd["kind"], fd["boundary"], fd["module_type"]) == ("final", "SGD", "optimizer"), fd


def test_an_ema_kept_after_a_large_object_is_still_found(tmp_path):
    """Helper 74: the look for models the training keeps reads 4,096 values at most, depth first: a
    script's ArgumentParser of a dozen options, a global before its EMA, used them all, the EMA was never
    found, and a reset of it compared identical. The look is breadth first: every variable first."""
    import argparse
    import copy

    import torch

    import bitguard

    def train(out, reset):
        model, opt = tiny_mlp()
        parser = argparse.ArgumentParser()
        for i in range(40):
            parser.add_argument(f"--option{i}", type=int, default=i, help=f"option {i}")
        ema = copy.deepcopy(model).requires_grad_(False)
        with bitguard.record(out, determinism=False):
            for step in range(3):
                sgd_steps(model, opt, 1)
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), model.parameters()):
                        e.lerp_(p, 1.0 if reset and step == 1 else 0.1)
        assert parser is not None

    fd = planted_pair(tmp_path, train, False, True)
    assert (fd["kind"], fd["boundary"]) == ("final", "ema"), fd
    # (the step is where it was seen, not made: helper 74)
    assert "ema is compared only here" in fd["blame_window"]["detail"], fd["blame_window"]


def test_a_buffer_made_differently_is_said_to_be_at_its_module_s_first_call(tmp_path):
    """Helper 74: a rotary embedding's `inv_freq` made with another base differs at its module's first call,
    output and buffer: the explanation said the buffer "changed since its last call ... set by hand", of a
    call that had none, and named no blame window."""
    import torch

    import bitguard

    class Scale(torch.nn.Module):
        def __init__(self, factor):
            super().__init__()
            self.register_buffer("s", torch.full((8,), factor), persistent=False)

        def forward(self, x):
            return x * self.s

    def train(out, factor):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), Scale(factor), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(out, determinism=False):
            sgd_steps(model, opt, 2)

    fd = planted_pair(tmp_path, train, 1.0, 2.0)
    assert (fd["step"], fd["kind"], fd["boundary"], fd["blame"]) == (0, "module", "1", "source"), fd
    assert fd["blame_window"]["module"] == "1", fd["blame_window"]
    assert "differ at its first call" in fd["blame_window"]["detail"], fd["blame_window"]


RESUMING = """\
import sys
import torch
save_to, resume = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
net, head = torch.nn.Linear(4, 3), torch.nn.Linear(3, 1, bias=False)  # (one parameter: its state, an EMA's shape)
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
opt2 = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
xs = torch.arange(96.0).reshape(4, 8, 3)[..., [0, 1, 2, 0]] / 96
start = 0
if resume != "-":
    ck = torch.load(resume)  # (kept to the end, as most resume code keeps it)
    net.load_state_dict(ck["net"]), opt.load_state_dict(ck["opt"])
    head.load_state_dict(ck["head"]), opt2.load_state_dict(ck["opt2"])
    start = ck["step"] + 1
for step in range(start, 4):
    opt.zero_grad(), opt2.zero_grad()
    head(net(xs[step])).pow(2).mean().backward()
    opt.step(), opt2.step()
    if step == 1 and save_to != "-":
        torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "head": head.state_dict(),
                    "opt2": opt2.state_dict(), "step": step}, save_to)
"""


def test_a_loaded_checkpoint_holding_an_optimizer_s_own_state_is_no_kept_root(tmp_path):
    """Helper 79: a run resumed from a checkpoint whose loaded dict it keeps (`ck`, as most resume code
    does), with two optimizers: `load_state_dict` makes the dict's state tensors the optimizer's own, without
    a copy, and the run was said to take "the final state of ck.opt2.state.0" where the uninterrupted run
    goes on: a structure divergence, every event equal. An optimizer's own state is the optimizer's."""
    import bitguard

    script = tmp_path / "resuming.py"
    script.write_text(RESUMING)
    ck = str(tmp_path / "ck.pt")
    record_together(dict(out=tmp_path / "full", script=script, script_args=(ck, "-")))
    record_together(dict(out=tmp_path / "resumed", script=script, script_args=("-", ck)))
    c = bitguard.compare(tmp_path / "full", tmp_path / "resumed", resumed_at=2)
    assert c.verdict == "identical", c.to_dict()["first_divergence"]


def test_a_container_s_buffer_edited_between_steps_is_said_to_be_its_buffer(tmp_path):
    """Helper 79 (pytorch-metric-learning's CrossBatchMemory): a memory bank a container gives its child,
    edited by hand between steps, was "the difference arose in its own code" of the container; a leaf
    module's buffer was said to have changed since its last call."""
    import torch

    import bitguard

    class Scorer(torch.nn.Module):
        def forward(self, e, bank):
            return e @ bank.T

    class Memory(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scorer = Scorer()
            self.register_buffer("bank", torch.zeros(8, 4))
            self.at = 0

        def forward(self, e):
            s = self.scorer(e, self.bank.clone())
            with torch.no_grad():  # (a queue: the oldest rows replaced)
                self.bank[self.at:self.at + 4] = e[:4].detach()
                self.at = (self.at + 4) % 8
            return s.logsumexp(1).mean()

    def train(out, edit_at):
        torch.manual_seed(0)
        net, memory = torch.nn.Linear(3, 4), Memory()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with bitguard.record(out, determinism=False):
            for step in range(3):
                opt.zero_grad()
                memory(net(torch.randn(8, 3))).backward()
                opt.step()
                if step == edit_at:
                    with torch.no_grad():
                        memory.bank.mul_(0.5)

    fd = planted_pair(tmp_path, train, None, 0)
    assert (fd["step"], fd["boundary"], fd["blame"]) == (1, "scorer", "consumer"), fd
    assert "its buffers .bank differ as this call left them and matched as its last call left them" in \
        fd["blame_window"]["detail"], fd["blame_window"]


UNSTEPPED = """\
import sys
import torch
class GP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
    def __call__(self, x):  # (as gpytorch's modules: past nn.Module's call, so no module event)
        return self.forward(x)
    def forward(self, x):
        return x @ self.w
torch.manual_seed(0)
model = GP()
x = torch.nn.LayerNorm(3)(torch.randn(8, 3)).detach()  # (one recorded call: BoTorch's outcome transform)
for i in range(3):  # (SciPy's optimizer, for BoTorch's fit_gpytorch_mll: no torch.optim step)
    g, = torch.autograd.grad(model(x).pow(2).mean(), model.w)
    with torch.no_grad():
        model.w -= 0.1 * g
if sys.argv[1] == "edit":
    with torch.no_grad():
        model.w.mul_(1.5)
if sys.argv[2] == "exit":  # (the script's globals are its frame's, in the SystemExit's traceback)
    raise SystemExit(0)
"""


def test_a_model_no_optimizer_step_trained_has_its_final_state(tmp_path):
    """Helper 83 (BoTorch: `fit_gpytorch_mll` drives SciPy's optimizer, and gpytorch's modules are called past
    nn.Module's call): no step, so no look for the models the script keeps, and the fitted model's weights
    edited after the fit compared identical (the one event, an outcome transform's call, equal). The end of
    the recording looks through the script's globals, its frame returned (or raised SystemExit(0))."""
    script = tmp_path / "unstepped.py"
    script.write_text(UNSTEPPED)
    record_together(*(dict(out=tmp_path / name, script=script, script_args=args) for name, args in (
        ("a", ("same", "return")), ("b", ("same", "exit")), ("c", ("edit", "return")), ("d", ("edit", "exit")))))
    assert compare_json(tmp_path / "a", tmp_path / "b")[0] == 0
    for edited in ("c", "d"):
        code, d = compare_json(tmp_path / "a", tmp_path / edited)
        fd = d["first_divergence"]
        assert code == 1 and (fd["kind"], fd["boundary"], fd["blame"]) == ("final", "model", "source"), (code, fd)


@pytest.mark.parametrize("where", ["part", "hook default"])
def test_an_ema_of_a_part_or_held_by_a_hooks_default_is_compared(tmp_path, where):
    """Helper 89 (diffusers' EMAModel): an EMA of `model.up_blocks` only (its shadow tensors the shapes of a run of
    the model's parameters, not of all of them), and one held only as a default argument of an optimizer step
    hook (`def hook(opt, args, kwargs, _ema=EMAModel(...))`), compared identical whatever their decay."""
    import torch

    import bitguard

    def train(out, rate):
        model, opt = tiny_mlp()
        if where == "part":
            ema = ShadowEMA(model[2])
        else:
            def hook(optimizer, args, kwargs, _ema=ShadowEMA(model)):
                with torch.no_grad():
                    for s, p in zip(_ema.shadow_params, model.parameters()):
                        s.lerp_(p, rate)
            opt.register_step_post_hook(hook)
        with bitguard.record(out, determinism=False):
            for _ in range(3):
                sgd_steps(model, opt, 1)
                if where == "part":
                    with torch.no_grad():
                        for s, p in zip(ema.shadow_params, model[2].parameters()):
                            s.lerp_(p, rate)

    fd = planted_pair(tmp_path, train, 0.1, 0.5)
    assert fd["kind"] == "final" and fd["boundary"].endswith("shadow_params"), fd
