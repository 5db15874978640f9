"""What used to compare "identical" although the trained models differ: module buffers (running
statistics) and parameters updated outside torch.optim. Buffers are recorded with each call of
their module, and every root module's parameters and buffers once more when the recording ends."""

import contextlib
import enum
import json
import shutil
import textwrap

import pytest

from incli import cli_json, run_cli

from .conftest import SCRIPTS, as_older_schema, as_schema_5, record_together

pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "blind_spots.py"


def _tiny():
    """A tiny MLP and its SGD, seeded: the in-process recordings' model."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _sgd_steps(model, opt, steps: int, batch: int = 2, clip: float | None = None) -> None:
    """`steps` steps of `_tiny()`'s model on random batches (`clip`: its gradients' norm clipped first)."""
    import torch

    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(batch, 4)).pow(2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def _compare(a, b) -> tuple[int, dict]:
    return cli_json("compare", "--json", a, b)


def _planted(tmp_path, make, same, changed) -> dict:
    """Runs a and b made by `make(path, same)`, c by `make(path, changed)`: a and b compare
    identical, a and c diverge; the first divergence of a against c."""
    for name, value in (("a", same), ("b", same), ("c", changed)):
        make(tmp_path / name, value)
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
    assert code == 1, d
    return d["first_divergence"]


def test_a_buffer_updated_differently_is_a_divergence_at_its_module(tmp_path):
    record_together(dict(out=tmp_path / "a", script_args=("bn", "0.1"), script=SCRIPT),
                    dict(out=tmp_path / "b", script_args=("bn", "0.2"), script=SCRIPT))
    code, d = _compare(tmp_path / "a", tmp_path / "b")
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
            _sgd_steps(model, opt, 2)
            if how == "extra_state":
                model.scale = 0.5 if changed else 1.0  # (set after the last step)
            else:
                model.eval()
                if changed:  # (other observer statistics than the training's)
                    model[1].activation_post_process.activation_post_process.min_val.mul_(2.0)
                torch.ao.quantization.convert(model, inplace=True)

    fd = _planted(tmp_path, train, False, True)
    assert (fd["kind"], fd["fault_class"]) == ("final", "final_state"), fd
    differing = [t["path"] for t in fd["tensors"] if t["differs"]]
    assert differing == (["._extra_state['scale'] (python float)"] if how == "extra_state" else
                         [".1.scale"]), \
        fd["tensors"]


def test_parameters_updated_outside_torch_optim_differ_in_the_final_state(tmp_path):
    record_together(*(dict(out=tmp_path / name, script_args=("manual", lr), script=SCRIPT) for name, lr in
                      (("a", "0.01"), ("b", "0.5"), ("c", "0.01"))))
    code, d = _compare(tmp_path / "a", tmp_path / "b")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["fault_class"], fd["boundary"]) == ("final", "final_state", "Sequential")
    assert "outside torch.optim" in fd["blame_window"]["detail"]
    assert _compare(tmp_path / "a", tmp_path / "c")[0] == 0  # and a rerun is identical, final state included


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
    record_together(*(dict(out=tmp_path / name, script_args=(what, value), script=SCRIPT) for name, value in
                      (("a", same), ("b", same), ("c", changed))))
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["step"], fd["phase"], fd["kind"], fd["boundary"], fd["blame"], fd["fault_class"]) == \
        (step, "optimizer", "params", "Sequential", "source", "params"), fd
    assert detail in fd["blame_window"]["detail"] and fd["call"] == call
    differing = sorted(t["path"] for t in fd["tensors"] if t["differs"])
    assert differing == ([".2.weight"] if what in ("init", "validate") else [".0.bias", ".0.weight", ".2.bias", ".2.weight"])


@pytest.mark.parametrize("mode", ["saliency", "params"])
def test_a_second_backward_through_a_retained_graph_is_observed(tmp_path, mode):
    """A module call's backward event was taken once: the gradients of a second pass through a
    retained graph (a saliency map, a gradient penalty) went unobserved, and a fault there
    compared identical (saliency) or was blamed on a parameter's weight gradient (params)."""
    script = SCRIPTS / "retained_graph.py"
    record_together(*(dict(out=tmp_path / name, script_args=(mode, scale), script=script) for name, scale in
                      (("a", "1.0"), ("b", "1.0"), ("c", "1.5"))))
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["step"], fd["phase"], fd["boundary"], fd["call"], fd["blame"], fd["fault_class"]) == \
        (2, "backward", "1", 1, "source", "backward"), fd


def test_an_averaged_model_never_called_has_its_final_state(tmp_path):
    """torch.optim.swa_utils.AveragedModel (SWA, EMA) is updated after the steps and often never
    called: no root module call met it, and a skipped update compared identical."""
    record_together(*(dict(out=tmp_path / name, script_args=("swa", skip), script=SCRIPT) for name, skip in
                      (("a", "-1"), ("b", "-1"), ("c", "1"))))
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
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

    record_together(*(dict(out=tmp_path / name, script_args=(mode, decay), script=SCRIPT) for name, decay in
                      (("a", "0.9"), ("b", "0.9"), ("c", "0.8"))))
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
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
    import torch

    import bitguard

    def train(name, scale):
        model, opt = _tiny()
        made = []
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(6):
                snap = {k: v.detach().clone() * (scale if step == 5 else 1.0) for k, v in model.named_parameters()}
                made.append(weakref.ref(snap["0.weight"]))  # (a dict has no weak reference: its tensor)
                _sgd_steps(model, opt, 1)
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
        model, opt = _tiny()
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
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
    assert code == 1 and (d["first_divergence"]["kind"], d["first_divergence"]["boundary"]) == ("final", "late"), d


@pytest.mark.parametrize("what, boundary, differing", [
    ("saved", "torch.save", {"['ema']['0.weight']", "['ema']['0.bias']", "['ema']['2.weight']", "['ema']['2.bias']"}),
    ("safetensors", "safetensors.save_file", {"['0.weight']", "['0.bias']", "['2.weight']", "['2.bias']"})])
def test_what_the_training_saves_is_compared(tmp_path, what, boundary, differing):
    """An average of the weights made once training is done, in a function, and saved: no variable
    holds it when the recording ends, and another weight compared identical. What a save call writes
    is a `saved` event; the file's name and the Python numbers beside the tensors (a time) are not
    compared, so two runs saving to their own folders at their own times stay identical."""
    record_together(*(dict(out=tmp_path / name, script_args=(what, decay), script=SCRIPT) for name, decay in
                      (("a", "0.9"), ("b", "0.9"), ("c", "0.8"))))
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["boundary"], fd["fault_class"], fd["blame"]) == \
        ("saved", boundary, "saved", "source"), fd
    assert {t["path"] for t in fd["tensors"] if t["differs"]} == differing
    shutil.copytree(tmp_path / "b", tmp_path / "old")
    as_older_schema(tmp_path / "old", 7)  # recorded before saves were: they are left out of both sides
    assert _compare(tmp_path / "old", tmp_path / "a")[0] == 0


def test_a_saver_a_library_bound_before_the_recording_began_is_observed(tmp_path, monkeypatch):
    """Helper 30: accelerate binds `from safetensors.torch import save_file as safe_save_file` when it
    is imported; with `with bitguard.record()` begun after that import, its saves (`save_model`,
    `save_state`) went through the unwrapped function: no `saved` event, and an export in bf16
    instead of fp16 compared identical. The names a loaded module gave a saver are wrapped too."""
    import importlib

    import torch

    import bitguard

    (tmp_path / "exporter.py").write_text(
        "from safetensors.torch import save_file as safe_save_file\n"
        "from torch import save as torch_save\n\n\n"
        "def export(tensors, path, dtype):\n"
        "    safe_save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, path)\n"
        "    torch_save({k: v.to(dtype) for k, v in tensors.items()}, str(path) + '.pt')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    exporter = importlib.import_module("exporter")

    def train(out, dtype):
        model, opt = _tiny()
        out.mkdir()
        with bitguard.record(out / "run", determinism=False):
            _sgd_steps(model, opt, 2)
            exporter.export(model.state_dict(), out / "model.safetensors", dtype)

    for name, dtype in (("a", torch.float16), ("b", torch.float16), ("c", torch.bfloat16)):
        train(tmp_path / name, dtype)
    assert exporter.safe_save_file.__module__ == "safetensors.torch" and not hasattr(exporter.safe_save_file, "__wrapped__")
    assert _compare(tmp_path / "a" / "run", tmp_path / "b" / "run")[0] == 0
    code, d = _compare(tmp_path / "a" / "run", tmp_path / "c" / "run")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["boundary"]) == ("saved", "safetensors.save_file"), fd


def test_a_checkpoint_that_would_resume_differently_differs_by_its_numbers(tmp_path):
    """Helper 17: an Opacus privacy accountant's history, a loss scale and Python's RNG state saved
    beside the weights compared identical when they differed (only an optimizer's and a scheduler's
    numbers were compared). Every number of a save is, but those under a key naming a time; a run
    recorded before (schema 8) still compares identical with one recorded now."""
    import random
    import time

    import torch

    import bitguard

    def train(out, noise, draws):
        model, opt = _tiny()
        random.seed(0)
        with bitguard.record(out, determinism=False):
            _sgd_steps(model, opt, 2)
            for _ in range(draws):
                random.random()
            torch.save({"model": model.state_dict(), "accountant": {"history": [(noise, 0.01, 2)]},
                        "scaler": {"scale": 65536.0}, "python_rng": random.getstate(), "time_elapsed": time.time()},
                       out.parent / f"{out.name}.pt")

    for name, noise, draws in (("a", 1.1, 0), ("b", 1.1, 0), ("c", 0.9, 0), ("d", 1.1, 1)):
        train(tmp_path / name, noise, draws)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (the times differ)
    for name, differing in (("c", ["['accountant']['history'][0][0] (python float)"]),
                            ("d", ["['python_rng'][1] (python int)"])):
        fd = bitguard.compare(tmp_path / "a", tmp_path / name).to_dict()["first_divergence"]
        assert (fd["kind"], fd["boundary"]) == ("saved", "torch.save"), fd
        assert [t["path"] for t in fd["tensors"] if t["differs"]][:2] == differing, fd["tensors"]
    shutil.copytree(tmp_path / "c", tmp_path / "old")
    as_older_schema(tmp_path / "old", 8)
    assert bitguard.compare(tmp_path / "old", tmp_path / "a").verdict == "identical"


def test_the_json_files_the_training_writes_are_compared(tmp_path):
    """Carried from helper 14, and helper 20's diffusers pipeline: peft writes adapter_config.json with
    `json` beside the adapter's weights, and `save_pretrained` a scheduler's scheduler_config.json
    with no tensor at all, so runs whose saved `lora_alpha` or `prediction_type` differed compared
    identical. The JSON files the training writes are compared by their numbers and strings (a
    time's, a path's left out); one that cannot be read makes the run inconclusive; a run recorded
    before (schema 9) compares with one recorded now without them."""
    import torch

    import bitguard

    def train(name, alpha=16, runtime=1.5, prediction="epsilon", broken=False):
        model, opt = _tiny()
        out = tmp_path / f"{name}-ckpt"
        (out / "scheduler").mkdir(parents=True)
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 2)
            torch.save(model.state_dict(), out / "adapter_model.bin")
            config = {"r": 8, "lora_alpha": alpha, "target_modules": ["q"], "base_model_name_or_path": str(out),
                      "train_runtime": runtime, "time_embedding_dim": 64}
            with open(out / "adapter_config.json", "w") as f:
                f.write(json.dumps(config))
            (out / "README.md").write_text(f"trained in {runtime} s")  # not JSON: not read
            (out / "scheduler" / "scheduler_config.json").write_text(json.dumps({"prediction_type": prediction}))
            if broken:
                (out / "metrics.json").write_text("{not json")
            (tmp_path / f"{name}.result.json").write_text(json.dumps({"loss": 0.5}))  # named after its run
            _sgd_steps(model, opt, 1)

    for name, kwargs in (("a", {}), ("b", {"runtime": 9.0}), ("c", {"alpha": 32}), ("d", {"broken": True}),
                         ("e", {"prediction": "v_prediction"})):
        train(name, **kwargs)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (times and paths differ)
    for name, differing in (("c", "adapter_config.json['lora_alpha'] (python int)"),
                            ("e", "scheduler_config.json['prediction_type'] (python str)")):
        fd = bitguard.compare(tmp_path / "a", tmp_path / name).to_dict()["first_divergence"]
        assert (fd["kind"], fd["boundary"], fd["module_type"], fd["step"], fd["fault_class"], fd["blame"]) == \
            ("saved", "json file", "json file", 2, "saved", "source"), fd
        assert [t["path"] for t in fd["tensors"] if t["differs"]] == [differing], fd["tensors"]
        assert "a JSON file the training wrote" in fd["blame_window"]["detail"]
    assert bitguard.compare(tmp_path / "d", tmp_path / "d").verdict == "inconclusive"
    shutil.copytree(tmp_path / "c", tmp_path / "old")
    as_older_schema(tmp_path / "old", 9)
    assert bitguard.compare(tmp_path / "old", tmp_path / "a").verdict == "identical"


class Node:  # (an OmegaConf node: its value under `_val`, a config's under `_content`; module level: pickled)
    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def test_the_strings_a_save_holds_are_compared(tmp_path):
    """Helper 23: fastai's `learn.export` pickles the Learner with its class names; two exports whose
    class 3 was `pig` in one and `owl` in the other compared identical (a save's strings were left
    out). They are compared now, as a JSON file's are; a vocabulary as one row. Paths, run names,
    dates and memory addresses are not: reruns that differ only there stay identical."""
    import argparse
    import time

    import torch

    import bitguard

    def train(name, classes=("cat", "dog", "fox", "pig"), act="gelu", token="<pad>", eos="</s>"):
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 2)
            # what differs from run to run by design (helper 25): folders, names, ids, times
            args = argparse.Namespace(act=act, eos_token=eos, output_dir=str(tmp_path / name), experiment=name,
                                      out=f"out_{name}", outputDir=f"o_{name}", logfile=f"{name}.log",
                                      wandb_id=f"{time.time_ns() % 10**8:x}", created=time.ctime(),
                                      run_name=f"{name}-{time.time_ns()}", started=time.strftime("%Y-%m-%d %H:%M:%S"),
                                      handle=repr(object()), worker=f"worker-{time.time_ns() % 99991}",
                                      cfg=Node(_content={"output_dir": Node(_val=f"logs_{name}")}),
                                      export=tmp_path / name / "export.pkl")  # (fastai's Learner.path: a Path)
            vocab = [f"tok{i}" for i in range(30)] + [token]
            torch.save({"model": model.state_dict(), "classes": list(classes), "vocab": vocab, "args": args},
                       tmp_path / f"{name}.pt")
            _sgd_steps(model, opt, 1)

    for name, kwargs in (("a", {}), ("b", {}), ("c", {"classes": ("cat", "dog", "fox", "owl")}),
                         ("d", {"act": "silu"}), ("e", {"token": "<unk>"}), ("f", {"eos": "</eos>"})):
        train(name, **kwargs)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (paths, names, times differ)
    for name, differing in (("c", "['classes'][3] (python str)"), ("d", "['args'].act (python str)"),
                            ("e", "['vocab'] (python str)"), ("f", "['args'].eos_token (python str)")):
        fd = bitguard.compare(tmp_path / "a", tmp_path / name).to_dict()["first_divergence"]
        assert (fd["kind"], fd["boundary"], fd["step"], fd["blame"]) == ("saved", "torch.save", 2, "source"), fd
        assert [t["path"] for t in fd["tensors"] if t["differs"]] == [differing], fd["tensors"]
    shutil.copytree(tmp_path / "c", tmp_path / "old")
    as_older_schema(tmp_path / "old", 10)  # recorded before a save's strings were: left out of both sides
    assert bitguard.compare(tmp_path / "old", tmp_path / "a").verdict == "identical"


def test_a_loss_that_differs_where_every_tensor_is_equal_is_not_identical(tmp_path):
    """Helper 28: a constant added to the loss (SB3's `F.mse_loss` wrapped) changes no gradient, yet
    the loss backward() started from, and the curve the user watches, differ; it compared identical.
    Nothing recorded differs but that value: inconclusive, naming it (reason `computed`)."""
    import torch

    import bitguard

    def train(name, constant):
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                opt.zero_grad()
                (model(torch.randn(2, 4)).pow(2).mean() + constant).backward()
                opt.step()

    why = _computed_only(tmp_path, train, 0.0, 1.0)
    assert why["message"].startswith("backward (loss): value differs at step 0 (") and why["rank"] == 0, why


def _computed_only(tmp_path, train, same, changed) -> dict:
    """`train(name, value)` twice with `same` (runs a, b) and once with `changed` (c): a and b are
    identical, a and c inconclusive with nothing but a computed value differing; that reason."""
    import bitguard

    for name, value in (("a", same), ("b", same), ("c", changed)):
        train(name, value)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    doc = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()
    assert doc["verdict"] == "inconclusive" and doc["first_divergence"] is None, doc["verdict"]
    (why,) = [r for r in doc["inconclusive"]["reasons"] if r["code"] == "computed"]
    return why


@pytest.mark.parametrize("read", ["item", "float", "format", "numpy", "tolist", "array", "repr"])
def test_an_evaluation_metric_that_differs_where_every_tensor_is_equal_is_not_identical(tmp_path, read):
    """Helper 33 (Lightning): a change only in what an evaluation makes of the model's outputs (a
    metric's scale, predictions post-processed) touches no recorded tensor and no gradient; it
    compared identical with no word. What the training reads out of a tensor is compared."""
    import io

    import numpy as np
    import torch

    import bitguard

    reads = {"item": lambda t: t.mean().item(), "float": lambda t: float(t.mean()), "format": lambda t: f"{t.mean():.6f}",
             "numpy": lambda t: t.numpy().sum(), "tolist": lambda t: sum(t.tolist()),
             "array": lambda t: np.asarray(t).sum(),
             # a metric printed or logged as a tensor (`print(acc)`, logging's %s: helper 44)
             "repr": lambda t: print(t.mean(), file=io.StringIO())}

    def train(name, scale):
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 2)
            model.eval()
            with torch.no_grad():
                reads[read]((model(torch.randn(3, 4)) * scale).flatten())

    why = _computed_only(tmp_path, train, 1.0, 1.5)
    assert why["message"].startswith(f"a value the training read out of a tensor ({read}(), read 0 of the step, "
                                     f"at {__file__}:"), why


def test_where_a_value_is_read_is_shown_and_never_compared(tmp_path):
    """Helper 48: a read's difference named no place ("read (numpy) call 7"). Its file and line are
    recorded and shown; code moved between two runs (the read on another line) is no difference."""
    import torch

    import bitguard
    from bitguard.backend.report import render_text

    def train(name, moved, shape):
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 1)
            out = model(torch.randn(*shape, 4))
            if moved:
                out.detach().numpy()
            else:
                out.detach().numpy()
            _sgd_steps(model, opt, 1)

    for name, moved, shape in (("a", False, (2,)), ("b", True, (2,)), ("c", False, (2, 2))):
        train(name, moved, shape)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    c = bitguard.compare(tmp_path / "a", tmp_path / "c")
    (d,) = [d for d in c.to_dict()["first_divergence"]["api_differences"]["differences"] if d["kind"] == "read"]
    assert d["field"] == "shape" and d["at"].startswith(f"{__file__}:"), d
    assert f"read (numpy) at {d['at']}: shape [2, 1] (A) vs [2, 2, 1] (B)" in render_text(c), render_text(c)


def test_a_value_read_after_the_step_window_is_said_to_be_outside_it(tmp_path):
    """Helper 53 (--steps 2:4, a change at step 5): the read that differed was said to be computed
    "outside the recorded boundaries"; it was outside the recorded steps."""
    import torch

    import bitguard

    def train(name, scale):
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False, steps="1:2"):
            for step in range(4):
                _sgd_steps(model, opt, 1)
                float(model(torch.ones(1, 4)).sum() * (scale if step == 3 else 1.0))

    why = _computed_only(tmp_path, train, 1.0, 2.0)
    assert "what computed it ran outside the recorded steps (1:2), which were all that was compared" \
        in why["message"], why


@pytest.mark.parametrize("read", ["bool", "index", "equal", "allclose", "torch.equal", "torch.allclose"])
def test_a_metric_read_as_a_condition_an_index_or_a_comparison_is_compared(tmp_path, read):
    """Helper 46: an evaluation's accuracy against shifted labels, read only by `if acc > best:`,
    `range(n)`, `torch.equal` or `torch.allclose` (Python bools and ints out of a tensor), compared
    identical although the script printed something else."""
    import torch

    import bitguard

    reads = {"bool": lambda n: bool(n > 5), "index": lambda n: len(range(n)), "equal": lambda n: n.equal(torch.tensor(6)),
             "allclose": lambda n: n.float().allclose(torch.tensor(6.0)),
             "torch.equal": lambda n: torch.equal(n, torch.tensor(6)),
             "torch.allclose": lambda n: torch.allclose(n.float(), torch.tensor(6.0))}

    def train(name, shift):
        model, opt = _tiny()
        labels = torch.tensor([0, 0, 1, 1, 1, 0])
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 2)
            correct = (labels == labels.roll(shift)).sum()  # (6 right, or 4: the metric's labels shifted)
            reads[read](correct)

    why = _computed_only(tmp_path, train, 0, 1)
    assert why["message"].startswith(f"a value the training read out of a tensor ({read.split('.')[-1]}()"), why


def test_a_torchmetrics_metric_computed_differently_is_not_identical(tmp_path, monkeypatch):
    """Helper 33 (Lightning + torchmetrics): `self.vacc.update(out, y); self.log("val_acc", self.vacc)`
    with another averaging compared identical: update() and compute() are no module calls, and no
    code of the user's reads the value (Lightning computes and logs it). Each metric's compute() is
    a read. torchmetrics is not a dependency: a stand-in with its Metric's own wrapping of
    `compute` at construction (torchmetrics/metric.py `_wrap_compute`), imported before the
    recording (the real one imported after it was tried by hand: helper 33's script)."""
    import functools
    import sys
    import types

    import torch

    import bitguard

    class Metric(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.compute = self._wrap_compute(self.compute)

        def _wrap_compute(self, compute):
            @functools.wraps(compute)
            def wrapped(*args, **kwargs):
                return compute(*args, **kwargs).clone()
            return wrapped

    class Accuracy(Metric):
        def __init__(self, macro):
            super().__init__()
            self.macro, self.hits = macro, []

        def update(self, out, y):
            self.hits.append((out.argmax(1) == y).float())

        def compute(self):
            hits = torch.cat(self.hits)
            return hits.mean() if not self.macro else (hits[:1].mean() + hits[1:].mean()) / 2

    package, module = types.ModuleType("torchmetrics"), types.ModuleType("torchmetrics.metric")
    module.Metric, package.metric = Metric, module
    monkeypatch.setitem(sys.modules, "torchmetrics", package)
    monkeypatch.setitem(sys.modules, "torchmetrics.metric", module)

    def train(name, macro):
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 2)
            metric = Accuracy(macro)
            with torch.no_grad():
                metric.update(torch.cat([model(torch.randn(4, 4)), torch.zeros(4, 1)], 1), torch.tensor([0, 1, 1, 0]))
            metric.compute()

    why = _computed_only(tmp_path, train, False, True)
    assert why["message"].startswith("a value the training read out of a tensor (Accuracy.compute(), read 0"), why


def test_nothing_paired_is_not_said_to_have_every_recorded_tensor_equal(tmp_path):
    """Helper 33 (Lightning, a resumed run against the tail of an uninterrupted one): no event paired
    (the steps are counted from each process's start), and a bullet still said a loss "differs ...
    while every recorded tensor is equal"."""
    import torch

    import bitguard

    def train(name, steps, window, seed):
        model, opt = _tiny()
        torch.manual_seed(seed)
        with bitguard.record(tmp_path / name, determinism=False, steps=window):
            _sgd_steps(model, opt, steps)

    train("a", 4, "2:", 0), train("b", 2, None, 1)
    doc = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()
    assert doc["verdict"] == "inconclusive", doc["verdict"]
    codes = [r["code"] for r in doc["inconclusive"]["reasons"]]
    assert "step_window" in codes and "computed" not in codes, doc["inconclusive"]["reasons"]


def test_inputs_no_recorded_module_produced_are_blamed_on_the_data(tmp_path):
    """Helper 28: SB3 calls its value head, then a parameterless extractor on the observations (no
    batch event: it holds no parameters); a changed observation was blamed on the value head, an
    earlier call that does not enclose it ("its own code"). Inputs that no enclosing call had
    identical and no recorded module produced come from the data."""
    import torch

    import bitguard

    def train(name, shift):
        torch.manual_seed(0)
        flatten, head = torch.nn.Flatten(), torch.nn.Linear(8, 1)
        value = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD([*head.parameters(), *value.parameters()], lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                obs = torch.randn(4, 2, 4)
                if step == 1:
                    obs[0, 0, 0] += shift  # (an observation the replay buffer changed)
                opt.zero_grad()
                loss = value(torch.ones(4, 8)).sum() + head(flatten(obs)).pow(2).mean()
                loss.backward()
                opt.step()

    for name, shift in (("a", 0.0), ("b", 1.0)):
        train(name, shift)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"], fd["fault_class"]) == \
        (1, "forward", "Flatten", "data", "data"), fd
    assert fd["blame_window"]["module"] is None and "training's own code or data" in fd["blame_window"]["detail"], fd


def test_a_number_given_to_a_module_as_an_argument_is_an_input_that_differs(tmp_path):
    """Helper 62: a Python float given to a module (a temperature, `model(x, t)` or `self.s(h, t=t)`)
    was not recorded: its change was blamed on the module's own code ("source"). Numbers given as
    arguments are input rows, as returned ones are output rows; a run of schema 12 has none, and
    they are left out of both sides."""
    import torch

    import bitguard

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, t):
            return self.lin(x) / t

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.s, self.b = torch.nn.Linear(4, 4), Scale(), torch.nn.Linear(4, 1)

        def forward(self, x, t):
            return self.b(self.s(self.a(x), t=self.inner))  # (a number the model's own code picks)

    def train(name, t, inner):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                opt.zero_grad()
                model.inner = inner if step == 1 else 1.0
                model(torch.randn(8, 4), t if step == 1 else 1.0).pow(2).mean().backward()
                opt.step()

    for name, t, inner in (("a", 1.0, 1.0), ("b", 1.0, 1.0), ("root", 0.5, 1.0), ("inner", 1.0, 0.5)):
        train(name, t, inner)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    for name, boundary, path in (("root", "Net", "[1] (python float)"), ("inner", "s", "['t'] (python float)")):
        fd = bitguard.compare(tmp_path / "a", tmp_path / name).to_dict()["first_divergence"]
        assert (fd["step"], fd["boundary"]) == (1, boundary) and fd["blame"] != "source", fd
        assert [t["path"] for t in fd["tensors"] if t["role"] == "input" and t["a"] != t["b"]] == [path], fd["tensors"]
    shutil.copytree(tmp_path / "inner", tmp_path / "old")
    as_older_schema(tmp_path / "old", 12)  # recorded before number arguments were: left out of both sides
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "old").to_dict()["first_divergence"]
    assert (fd["step"], fd["boundary"], fd["blame"]) == (1, "s", "source"), fd


def test_targets_equal_by_value_to_a_module_output_are_still_the_batch(tmp_path):
    """Helper 45 (torchvision's transform returns the targets): a step's targets, changed in run B,
    held in run A the values a submodule returned a step before, and the batch pivot was said to be
    "another model's output, not the data pipeline": labels repeat by value, and so does a dataset's
    every epoch. Not the same tensor, nor its memory in the same step: the batch."""
    import torch

    import bitguard

    class Prep(torch.nn.Module):
        def forward(self, x, y):
            return x * 2, y.clone()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.prep, self.fc = Prep(), torch.nn.Linear(4, 2)

        def forward(self, x, y):
            x, y = self.prep(x, y)
            if y.is_floating_point():
                return (self.fc(x) - y).pow(2).mean()
            return torch.nn.functional.cross_entropy(self.fc(x), y)

    def train(name, targets):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for y in targets:
                opt.zero_grad()
                model(torch.randn(2, 4), torch.tensor(y)).backward()
                opt.step()

    labels, boxes = [[0, 1], [1, 0], [1, 0]], [[[0., 1.], [2., 3.]], [[1., 1.], [1., 1.]], [[0., 1.], [2., 3.]]]
    for targets, changed in ((labels, [1, 1]), (boxes, [[0., 1.], [2., 4.]])):
        train("a", targets), train("b", targets[:2] + [changed])
        fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
        assert (fd["phase"], fd["step"], fd["blame"]) == ("data", 2, "data"), fd
        assert "another model's output" not in (fd["blame_window"] or {}).get("detail", ""), fd["blame_window"]
        shutil.rmtree(tmp_path / "a"), shutil.rmtree(tmp_path / "b")


def test_a_batch_a_model_returns_as_it_was_given_is_still_the_batch(tmp_path):
    """Helper 47 (tensordict: a TensorDictModule returns its input batch with its outputs added): the
    fixed data tensor edited at step 2 was, in run A, the very tensor the model had returned at step
    1, and the batch pivot was said to be "another model's output". Passed through is not made."""
    import torch

    import bitguard

    class Passing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, batch):
            return {**batch, "p": self.lin(batch["x"])}

    def train(name, edit):
        torch.manual_seed(0)
        model, x = Passing(), torch.randn(16, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                if edit and step == 2:
                    x[3, 1] += 0.001
                out = model({"x": x})
                opt.zero_grad()
                (out["p"] - out["x"].sum(1, keepdim=True)).pow(2).mean().backward()
                opt.step()

    train("a", False), train("b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["phase"], fd["step"], fd["blame"]) == ("data", 2, "data"), fd
    assert "another model's output" not in (fd["blame_window"] or {}).get("detail", ""), fd["blame_window"]


@pytest.mark.parametrize("child", [False, True])
def test_a_module_given_two_modules_outputs_swapped_is_said_to_be(tmp_path, child):
    """Helper 48 (lightly's MoCo loss, `crit(k, q)` for `crit(q, k)`): the loss module's inputs were
    said to come "from the training's own code or data, nor did any recorded module produce them";
    with a CrossEntropyLoss child (NTXentLoss has one), the child's inputs, made inside the loss."""
    import torch

    import bitguard

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ce = torch.nn.CrossEntropyLoss() if child else torch.nn.functional.cross_entropy

        def forward(self, q, k):
            return self.ce(q @ k.T / 0.5, torch.arange(4))

    def train(name, swap):
        torch.manual_seed(0)
        enc_q, enc_k, crit = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), Loss()
        with bitguard.record(tmp_path / name, determinism=False):
            x = torch.randn(4, 4)
            q, k = enc_q(x), enc_k(x).detach()
            (crit(k, q) if swap else crit(q, k)).backward()

    train("a", False), train("b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["phase"], fd["boundary"]) == ("forward", "ce" if child else "Loss"), fd
    detail = fd["blame_window"]["detail"]
    assert "is what Linear (forward at step 0, call 0) returned in run A and what Linear#2" in detail, detail
    assert "not other data" in detail, detail


def test_a_model_fed_another_model_s_output_is_not_said_to_have_a_new_batch(tmp_path):
    """Helper 33 (Lightning's manual optimization): with a GAN's two steps swapped from step 2 on,
    the discriminator's first call takes the generator's output instead of the real batch, and the
    pivot, its batch event, read as "the model's input batch differs" with nothing more: the user
    was sent to the data pipeline. The input is known, by its digests, as what G returned."""
    import torch

    import bitguard

    def train(name, swap_from):
        torch.manual_seed(0)
        g, d = torch.nn.Linear(2, 4), torch.nn.Linear(4, 1)
        opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)

        def d_step(x, z):
            fake = g(z).detach()
            opt_d.zero_grad()
            (d(x).mean() - d(fake).mean()).backward()
            opt_d.step()

        def g_step(z):
            opt_g.zero_grad()
            d(g(z)).mean().backward()
            opt_g.step()

        with bitguard.record(tmp_path / name, determinism=False):
            for i in range(3):
                x, z = torch.randn(3, 4), torch.randn(3, 2)
                if i >= swap_from:
                    g_step(z), d_step(x, z)
                else:
                    d_step(x, z), g_step(z)

    train("a", 9), train("b", 1)
    doc = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()
    fd = doc["first_divergence"]
    assert (fd["phase"], fd["boundary"], fd["blame"]) == ("data", "Linear#2", "data"), fd
    detail = fd["blame_window"]["detail"]
    assert "in run A it holds no recorded module's output; in run B it holds what Linear (forward" in detail, detail
    assert "not the data pipeline" in detail, detail
    # the backwards paired at their places (the discriminator's input now needs a gradient) are not
    # said to have changed module type or dtype: neither did
    notes = [r["message"] for r in doc["certification"]["reasons"] if r["code"] == "retyped"]
    assert notes and "(Linear in both, with tensors that differ in number, shape or path)" in notes[0], notes


def test_a_run_that_stops_early_is_said_to_end_where_the_other_goes_on(tmp_path):
    """Helper 33 (Lightning's EarlyStopping): the run that stopped after fewer steps read as "run A
    lacks the final state of M that the other run records", A being the run that trained on."""
    import bitguard

    def train(name, steps):
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, steps)

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
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(4):
                if rebuild and step == 2:
                    state, opt_state = model.state_dict(), opt.state_dict()
                    model, opt = _tiny()
                    model.load_state_dict(state)
                    opt.load_state_dict(opt_state)
                _sgd_steps(model, opt, 1)

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
        model, opt = _tiny()
        ema = Ema(model, decay)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(4):
                _sgd_steps(model, opt, 1)
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


def test_a_model_trained_after_another_and_initialised_differently_is_said_to_be(tmp_path):
    """Helper 46 (skorch's GridSearchCV trains clones one after another): the second model, seeded
    differently in run B, was said to be "a copy the training keeps beside (an EMA) or frozen"."""
    import torch

    import bitguard

    def train(name, seed):
        with bitguard.record(tmp_path / name, determinism=False):
            model, opt = _tiny()
            _sgd_steps(model, opt, 2)
            torch.manual_seed(seed)  # (the next model of the sweep, built as _tiny builds it)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            _sgd_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)

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
        model, opt = _tiny()
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


class Schedule(enum.Enum):  # (an HF Trainer's `SchedulerType`; module level: pickled)
    COSINE = "cosine"
    LINEAR = "linear"


def test_the_names_and_keys_a_save_holds_are_compared(tmp_path):
    """Helper 25: `label2id` with two labels swapped (a save's dict, a config.json's object: the same
    values), an enum member (the HF Trainer's `lr_scheduler_type`) and a dtype held as settings
    compared identical when they differed; helper 29: skorch's history.json holds each epoch's wall
    time under `dur`, and reruns diverged there. Schema 12 compares names and keys; a run recorded
    before (11) compares with one recorded now without them."""
    import time

    import torch

    import bitguard

    def train(name, labels=("cat", "dog"), json_labels=("cat", "dog"), schedule=Schedule.COSINE,
              dtype=torch.bfloat16):
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 2)
            torch.save({"model": model.state_dict(), "label2id": {k: i for i, k in enumerate(labels)},
                        "args": {"schedule": schedule, "dtype": dtype}}, tmp_path / f"{name}.pt")
            history = [{"epoch": 1, "dur": time.perf_counter() % 1, "label2id": {k: i for i, k in enumerate(json_labels)}}]
            (tmp_path / f"{name}-out").mkdir()
            (tmp_path / f"{name}-out" / "history.json").write_text(json.dumps(history))
            _sgd_steps(model, opt, 1)

    runs = {"a": {}, "b": {}, "keys": {"labels": ("dog", "cat")}, "json": {"json_labels": ("dog", "cat")},
            "enum": {"schedule": Schedule.LINEAR}, "dtype": {"dtype": torch.float16}}
    for name, kwargs in runs.items():
        train(name, **kwargs)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (the `dur` times differ)
    # (a save's dicts are walked in the order of their keys: the swapped labels differ by their values)
    swapped = ["['label2id']['cat'] (python int)", "['label2id']['dog'] (python int)"]
    for name, (boundary, differing) in {"keys": ("torch.save", swapped),
                                        "json": ("json file", [f"history.json[0]{p}" for p in swapped]),
                                        "enum": ("torch.save", ["['args']['schedule'] (python name)"]),
                                        "dtype": ("torch.save", ["['args']['dtype'] (python name)"])}.items():
        fd = bitguard.compare(tmp_path / "a", tmp_path / name).to_dict()["first_divergence"]
        assert (fd["kind"], fd["boundary"], fd["blame"]) == ("saved", boundary, "source"), fd
        assert [t["path"] for t in fd["tensors"] if t["differs"]] == differing, fd["tensors"]
    shutil.copytree(tmp_path / "enum", tmp_path / "old")
    as_older_schema(tmp_path / "old", 11)  # recorded before names and keys were: left out of both sides
    assert bitguard.compare(tmp_path / "old", tmp_path / "a").verdict == "identical"


def test_a_tensor_only_an_optimizer_holds_edited_between_steps_is_blamed_there(tmp_path):
    """Helper 18: SAC's `log_alpha`, a learned temperature only its optimizer holds, edited between
    two steps was blamed on the gradient reaching the model's output (the loss). Such tensors get a
    params event at each step's first root call, as a root's parameters do."""
    import torch

    import bitguard

    def train(name, edit):
        model, opt = _tiny()
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
        model, opt = _tiny()
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
            _sgd_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)

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
        model, opt = _tiny()
        ema = copy.deepcopy(model).requires_grad_(False)
        with bitguard.record(tmp_path / name, determinism=False, steps=(1, 3)):
            for step in range(5):
                _sgd_steps(model, opt, 1)
                if not (skip and step == 2):
                    with torch.no_grad():
                        for e, p in zip(ema.parameters(), model.parameters()):
                            e.lerp_(p, 0.1)

    for name, skip in (("a", False), ("b", False), ("c", True)):
        train(name, skip)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["boundary"], fd["step"], fd["fault_class"]) == ("final", "ema", 2, "final_state"), fd


class _ShadowEMA:
    """diffusers' EMAModel in small: a list of shadow tensors updated in place, which `to()`
    replaces by a new list (as an EMA offloaded between steps is moved at every step)."""

    def __init__(self, model):
        self.shadow_params = [p.detach().clone() for p in model.parameters()]

    def step(self, model):
        import torch

        with torch.no_grad():
            for s, p in zip(self.shadow_params, model.parameters()):
                s.lerp_(p, 0.1)

    def to(self, dtype):
        self.shadow_params = [s.to(dtype) for s in self.shadow_params]


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
        model, opt = _tiny()
        ema = _ShadowEMA(model)
        if how == "hooked" and edit:
            def hook(*_):  # (a closure over the EMA, walked before the variable: as accelerate's save hook)
                return ema
        for step in range(12):
            _sgd_steps(model, opt, 1)
            if how == "made-anew" and step == 9:
                ema = _ShadowEMA(model)
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
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
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

    outside, _ = _tiny()  # (only this frame holds it: outside the recording, never a root)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        model, opt = _tiny()
        ema = _ShadowEMA(model)

        def train(out, edit):
            with bitguard.record(out, determinism=False):
                for step in range(3):
                    _sgd_steps(model, opt, 1)
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
        model, opt = _tiny()
        ema = _ShadowEMA(model)
        recording = begin(out)
        for _ in range(3):
            _sgd_steps(model, opt, 1)
            ema.step(model)
        if edit:
            nudge(ema)
        end(recording)

    for name, edit in (("a", False), ("b", False), ("c", True)):
        if began == "in-a-function-of-the-script":
            exec(compile(script.read_text(), str(script), "exec"),
                 {"_tiny": _tiny, "_ShadowEMA": _ShadowEMA, "_sgd_steps": _sgd_steps, "bitguard": bitguard,
                  "nudge": nudge, "OUT": tmp_path / name, "EDIT": edit})
        else:
            loop(tmp_path / name, edit)
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["boundary"].partition("#")[0]) == ("final", "ema.shadow_params"), fd
    if began == "in-a-function-of-the-script":
        finals = {e["boundary"] for e in _events(tmp_path / "a") if e["kind"] == "final"}
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
    model, opt = _tiny()
    with bitguard.record(tmp_path / "optim", determinism=False, steps=(2, 4)):
        _sgd_steps(model, opt, 5)
    assert "--steps" not in capsys.readouterr().err


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
                _sgd_steps(model, opt, 1)

    for name, lr3 in (("a", 0.1), ("b", 0.1), ("c", 0.2)):
        train(name, lr3)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"  # (no collector error)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").to_dict()["first_divergence"]
    assert (fd["kind"], fd["step"], fd["blame"], fd["fault_class"]) == ("step", 3, "source", "optimizer"), fd


def test_a_weight_edited_between_micro_batches_is_blamed_on_the_edit(tmp_path):
    """Helper 21 (ignite's gradient accumulation, an edit in a handler): the params event a later call
    of a step gets when the weights moved since its first is on one side only, and was reported as
    `structure (extra)`, "a module was skipped or added"; it is the edit's own place."""
    import torch

    import bitguard

    def train(name, edit):
        model, opt = _tiny()
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


def test_a_save_in_a_dataloader_worker_is_said_not_to_be_observed(tmp_path):
    """A forked DataLoader worker's collector is off: what it saved was seen by nothing and a
    difference there compared identical (helpers 11, 12). The worker now leaves a line for its
    parent, which reports it: the runs are inconclusive."""
    record_together(*(dict(out=tmp_path / name, script_args=("worker_save", v), script=SCRIPT) for name, v in
                      (("a", "1.0"), ("b", "2.0"))))
    code, d = _compare(tmp_path / "a", tmp_path / "b")
    assert code == 3 and any("called torch.save" in r["message"] for r in d["certification"]["reasons"]), d
    assert not list(tmp_path.glob("*/rank-*.child-saves"))  # (taken into the manifest, then removed)


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
    fd = _compare(tmp_path / "a", tmp_path / "b")[1]["first_divergence"]
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

    fd = _planted(tmp_path, train, 0.05, 0.5)
    assert (fd["step"], fd["kind"], fd["boundary"], fd["blame"]) == (1, "params", "net.0", "source"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == [".weight", ".bias"], fd["tensors"]
    assert "a teacher or target network" in fd["blame_window"]["detail"], fd["blame_window"]


def test_weights_trained_through_functional_call_without_torch_optim_are_not_certified(tmp_path):
    """torch.func.functional_call on a dict of weights updated by hand: the weights after the last
    update are used by nothing observed, so a different last learning rate compared identical. Such
    a run is now inconclusive (a collector error that says why)."""
    record_together(*(dict(out=tmp_path / name, script_args=("functional", lr), script=SCRIPT) for name, lr in
                      (("a", "0.1"), ("b", "0.5"))))
    code, d = _compare(tmp_path / "a", tmp_path / "b")
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

    fd = _planted(tmp_path, train, 0.1, 0.5)
    assert (fd["kind"], fd["boundary"]) == ("final", "Sequential"), fd


def test_a_hidden_state_one_run_alone_gives_the_model_is_a_difference_in_the_batch(tmp_path):
    """Helper 71: a GRU language model's hidden state carried from batch to batch, reset to None at one
    step in run B: the batch lost a tensor, and the pivot was the GRU's forward blamed as computing
    differently ("source"), its missing input said to be a signature change. A tensor of the input
    batch one run alone gives is a difference of the data now, at that step."""
    import torch

    import bitguard

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn, self.head = torch.nn.Embedding(10, 8), torch.nn.GRU(8, 8, batch_first=True), \
                torch.nn.Linear(8, 10)

        def forward(self, x, h=None):
            out, h = self.rnn(self.emb(x), h)
            return self.head(out), h

    def train(out, reset):
        torch.manual_seed(0)
        model = LM()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        h = None
        with bitguard.record(out, determinism=False):
            for step in range(4):
                x = torch.randint(0, 10, (2, 5))
                if step == reset:
                    h = None
                logits, h = model(x, h)
                h = h.detach()
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()

    fd = _planted(tmp_path, train, -1, 2)
    assert (fd["step"], fd["kind"], fd["boundary"], fd["blame"]) == (2, "batch", "LM", "data"), fd
    assert any("run A alone gives the model 1 input(s) of this batch" in n for n in fd["notes"]), fd["notes"]


def test_a_step_the_loss_scaler_skipped_is_a_step_run_b_lacks(tmp_path):
    """GradScaler.step skips optimizer.step() on an inf gradient: the step counter stood still, the
    next step's events were numbered as the skipped one's, and the pivot was an "extra" batch."""
    record_together(*(dict(out=tmp_path / name, script_args=("scaler", at), script=SCRIPT) for name, at in
                      (("a", "-1"), ("b", "1"))))
    code, d = _compare(tmp_path / "a", tmp_path / "b")
    fd = d["first_divergence"]
    assert code == 1 and (fd["step"], fd["phase"], fd["kind"], fd["cause"], fd["missing_side"]) == \
        (1, "optimizer", "step", "structure", "b"), fd
    steps = [e["step"] for e in _events(tmp_path / "b") if e["kind"] == "batch"]
    assert steps == [0, 1, 2, 3], steps  # four steps, one of them skipped


def _events(run_dir) -> list[dict]:
    from bitguard.backend.ingest import load_rank, open_run

    return load_rank(open_run(run_dir), 0)[0].to_dicts()


def test_identical_across_a_module_type_change_says_so(tmp_path):
    """A module swapped for another class that computes the same (pytorch/examples' PixelShuffle
    for a subclass): identical, and the report says the events were paired across the change."""
    record_together(*(dict(out=tmp_path / name, script_args=("shuffle", view), script=SCRIPT) for name, view in
                      (("a", "0"), ("b", "1"))))
    code, d = _compare(tmp_path / "a", tmp_path / "b")
    assert code == 0, d["verdict"]
    notes = [r for r in d["certification"]["reasons"] if r["code"] == "retyped"]
    assert len(notes) == 1 and "(PixelShuffle in A, PixelShuffleView in B)" in notes[0]["message"], notes
    text = run_cli("compare", tmp_path / "a", tmp_path / "b").stdout
    assert "note: " in text and "paired across a change of module type" in text, text


def test_identical_numbers_from_different_settings_say_so(tmp_path):
    """Identical, and rightly (every gradient is zero, so the learning rate changes nothing), but the
    runs asked for different learning rates: the document and the report say which."""
    record_together(*(dict(out=tmp_path / name, script_args=("zero", lr), script=SCRIPT) for name, lr in
                      (("a", "0.1"), ("b", "0.2"))))
    code, d = _compare(tmp_path / "a", tmp_path / "b")
    assert code == 0 and d["first_divergence"] is None
    api = d["api_differences"]
    assert api["rank"] == 0 and {(x["kind"], x["field"], x["a"], x["b"]) for x in api["differences"]} == \
        {("optimizer_step", "groups[0].lr", 0.1, 0.2)}, api
    text = run_cli("compare", tmp_path / "a", tmp_path / "b").stdout
    assert "called the training API differently" in text and "groups[0].lr 0.1 (A) vs 0.2 (B)" in text, text


def test_a_run_recorded_before_params_events_compares_with_a_new_one(tmp_path):
    """A run of schema version 5 has no `params` events: compared with a newer run of the same
    program, they are left out of both sides (absent by construction, not a divergence)."""
    record_together(*(dict(out=tmp_path / name, script_args=("init", "1.0"), script=SCRIPT) for name in "ab"))
    old = tmp_path / "a"
    as_schema_5(old)
    assert _compare(old, tmp_path / "b")[0] == 0
    assert _compare(tmp_path / "b", old)[0] == 0


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
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
    fd = d["first_divergence"]
    assert code == 1 and (fd["kind"], fd["fault_class"], fd["boundary"]) == ("final", "final_state", "Sequential#2"), fd


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
    code, d = _compare(tmp_path / "a", tmp_path / "b")
    if where is None:
        assert code == 0, d["certification"]
        return
    fd = d["first_divergence"]
    differing = sorted(t["path"] for t in fd["tensors"] if t["differs"])
    assert code == 1 and (fd["step"], fd["kind"], fd["boundary"], differing) == where, fd


def test_what_a_distributed_checkpoint_writes_is_compared(tmp_path):
    """torch.distributed.checkpoint's save (helpers 11 and 12): its items are written by torch's own
    torch.save calls, which are no events, and dcp.save itself was watched by nothing, so a
    difference only in what it wrote compared identical. Imported inside the recording, as a script
    does, it is wrapped once imported."""
    import bitguard

    def train(out, plant):
        model, opt = _tiny()
        with bitguard.record(out, determinism=False):
            import torch.distributed.checkpoint as dcp

            _sgd_steps(model, opt, 2, batch=3)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            state["2.bias"] += plant
            dcp.save({"model": state}, checkpoint_id=str(out) + "-ckpt")

    fd = _planted(tmp_path, train, 0.0, 1e-3)
    assert (fd["kind"], fd["boundary"], fd["fault_class"]) == ("saved", "dcp.save", "saved"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == ["['model']['2.bias']"]


def _ddp_dropped(path, edit: float) -> None:
    """A DDP-wrapped model trained in a function that drops the wrapper and its optimizer when it
    returns, without destroy_process_group() (what Lightning's and Fabric's teardown amounts to),
    one weight edited after the last step by `edit`."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}.rendezvous", rank=0, world_size=1)
    try:
        def train():
            model, opt = _tiny()
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
    fd = _planted(tmp_path, _ddp_dropped, 0.0, 1e-3)
    assert (fd["kind"], fd["boundary"], fd["module_type"]) == ("final", "SGD", "optimizer"), fd


def test_a_gradient_edited_between_backward_and_step_on_one_rank_is_said_to_be_an_edit(tmp_path):
    """Helper 17: on a single-rank run, noise or clipping added to .grad by a wrapping optimizer (Opacus'
    DPOptimizer) was explained as "a reduction across ranks"; one rank has none."""
    import bitguard

    def train(out, clip):
        model, opt = _tiny()
        with bitguard.record(out, determinism=False):
            _sgd_steps(model, opt, 2, clip=clip)

    for name, clip in (("a", 1e-3), ("b", 2e-3)):
        train(tmp_path / name, clip)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["blame"]) == (0, "optimizer", "consumer"), fd
    detail = fd["blame_window"]["detail"]
    assert "an edit of .grad: clipping" in detail and "across ranks" not in detail, detail


def test_a_target_changed_under_a_functional_loss_is_blamed_on_the_loss_and_reaches_the_whole_backward(tmp_path):
    """Helper 16: a label changed under `F.cross_entropy` (no loss module) made the root's backward the
    pivot, said to be "upstream of every observed boundary (the data pipeline)", and its propagation
    reached 1 node: the root and its last part share their gradient, and nothing linked the two."""
    import torch

    import bitguard

    def train(out, target):
        model, opt = _tiny()
        with bitguard.record(out, determinism=False):
            for step in range(2):
                opt.zero_grad()
                y = torch.zeros(2, 1) + (target if step == 1 else 0.0)
                torch.nn.functional.mse_loss(model(torch.randn(2, 4)), y).backward()
                opt.step()

    for name, target in (("a", 0.0), ("b", 0.5)):
        train(tmp_path / name, target)
    d = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()
    fd = d["first_divergence"]
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"]) == (1, "backward", "Sequential", "consumer"), fd
    assert fd["blame_window"]["detail"].startswith("the gradient reaching Sequential's output already differs: it was "
                                                   "computed outside every observed module, by the loss"), fd
    reached = {n["boundary"] for n in d["propagation"]["nodes"] if n["phase"] == "backward"}
    assert {"Sequential", "2", "0", "0.weight", "2.weight"} <= reached, reached


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


def test_a_target_changed_behind_a_root_that_returns_its_child_s_output_is_blamed_on_the_loss(tmp_path):
    """Helper 28: DQN's QNetwork returns its Sequential's output, so that child's backward is the
    pivot and no name prefix leads to the root: a changed discount (the target's) was said to be
    "upstream of every observed boundary (e.g. in the data pipeline)" though every input matched."""
    import torch

    import bitguard

    class QNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

        def forward(self, x):
            return self.q_net(x)

    def train(out, gamma):
        torch.manual_seed(0)
        q = QNet()
        opt = torch.optim.SGD(q.parameters(), lr=0.1)
        with bitguard.record(out, determinism=False):
            for _ in range(2):
                x = torch.randn(5, 4)
                target = 1.0 + gamma * x.sum(1)
                loss = torch.nn.functional.smooth_l1_loss(q(x).max(1).values, target)
                opt.zero_grad()
                loss.backward()
                opt.step()

    for name, gamma in (("a", 0.99), ("b", 0.98)):
        train(tmp_path / name, gamma)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"]) == (0, "backward", "q_net", "consumer"), fd
    assert fd["blame_window"]["detail"].startswith("the gradient reaching QNet's output already differs"), fd


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
        model, _ = _tiny()
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


def test_a_weight_read_outside_its_module_with_a_changed_loss_is_blamed_on_the_loss(tmp_path):
    """Helper 24: TRL's fused log-prob reads `lm_head.weight` directly (lm_head is never called),
    and the root's backward event ends only with the pass (an output, `entropy`, gets no gradient).
    A changed DPO beta was then blamed on lm_head's weight gradient, "while the gradient reaching its
    module matched": no backward of lm_head exists to say so. The root's incoming gradient differed."""
    import torch

    import bitguard

    class Fused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 3)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return {"logits": h @ self.head.weight.t(), "aux": h.sum(-1)}  # (aux: no gradient ever reaches it)

    def train(name, beta):
        torch.manual_seed(0)
        model = Fused()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                opt.zero_grad()
                (model(torch.randn(2, 4))["logits"].pow(2).mean() * beta).backward()
                opt.step()

    for name, beta in (("a", 0.1), ("b", 0.11)):
        train(name, beta)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["blame"], fd["fault_class"]) == (0, "consumer", "backward"), fd
    detail = fd["blame_window"]["detail"]
    assert "no backward of head was recorded" in detail and "by the loss" in detail, detail
    assert "matched" not in detail, detail
    from bitguard.backend.drill import plan
    from bitguard.backend.ingest import open_run
    from bitguard.errors import NotSupported

    with pytest.raises(NotSupported, match="head, whose parameter is the pivot .* is never called as a module"):
        plan(open_run(tmp_path / "a"), open_run(tmp_path / "b"), fd)  # (it told the user to record in full mode)


def test_a_changed_loss_in_trusted_mode_is_not_blamed_on_the_last_observed_module(tmp_path):
    """Helper 23: in trusted mode (the root is not observed) a label-smoothing change was blamed on
    the window `fc`, the last Linear, which computed correctly: the gradient reaching its output
    already differed, and nothing observed after it says where it arose. The window is now none."""
    import torch

    import bitguard

    def train(name, smoothing):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, mode="trusted", determinism=False):
            for _ in range(2):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 4)), torch.tensor([0, 1, 2, 0]),
                                                         label_smoothing=smoothing)
                loss.backward()
                opt.step()

    for name, smoothing in (("a", 0.1), ("b", 0.11)):
        train(name, smoothing)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["blame"]) == (0, "backward", "consumer"), fd
    window = fd["blame_window"]
    assert window["module"] is None and "already differed" in window["detail"] and "trusted mode" in window["detail"], \
        window


def test_a_save_of_the_same_dict_in_another_insertion_order_is_identical_and_another_key_is_named(tmp_path):
    """Helper 42 (Pyro): `{name: optimizer.state_dict()}` saved in the order the optimizers were made,
    an order that changes from run to run, diverged "with different tensors (roles, shapes or
    dtypes)"; a checkpoint is read back by key. Helper 43 (diffusers): a config with one more key
    said the same, without saying which dict."""
    import torch

    import bitguard

    def train(name, order, extra=False):
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 2)
            state = {n: p.detach().clone() for n, p in model.named_parameters()}
            torch.save({"params": {n: state[n] for n in order} | ({"extra": 1} if extra else {}),
                        "step": 2}, tmp_path / f"{name}.pt")

    names = [n for n, _ in _tiny()[0].named_parameters()]
    train("a", names)
    train("b", names[::-1])
    train("c", names, extra=True)
    c = bitguard.compare(tmp_path / "a", tmp_path / "b")
    assert c.verdict == "identical", c.first_divergence
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").first_divergence
    assert (fd["kind"], fd["blame"], fd["fault_class"]) == ("saved", "structure", "signature"), fd
    assert "the dict ['params'] holds 4 keys in A and 5 in B" in fd["blame_window"]["detail"], fd["blame_window"]
    assert "only in B: ['params']['extra'] (python int)" in fd["blame_window"]["detail"], fd["blame_window"]


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
    after the first step, the model was found as a kept one before the window, and had no params
    event in it: its weights are taken at each step() that finds them unmet in the step."""
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
    if then == "window":
        assert (fd["kind"], fd["boundary"][:4], fd["step"], fd["blame"], fd["fault_class"]) == \
            ("module", "Tanh", 1, "consumer", "params"), fd  # (Tanh#2: a new Tanh each step, the first before the window)
        assert "the weights of linear (weight, bias), which an optimizer steps and no module call met in this step" \
            in fd["blame_window"]["detail"], fd["blame_window"]
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
        model, _ = _tiny()
        opt = Nesterov(model.parameters(), beta, in_place)
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 3)

    for name, beta, in_place in (("a", 0.95, True), ("b", 0.95, False), ("c", 0.9, True)):
        train(name, beta, in_place)
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0  # (the same parameters and state at every step)
    code, d = _compare(tmp_path / "a", tmp_path / "c")
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
        model, sgd = _tiny()
        opt = Lookahead(sgd)
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 3)
            if edit:
                for state in opt.state.values():
                    state["slow_param"].mul_(0.5)

    for name, edit in (("a", False), ("b", False), ("c", True)):
        train(name, edit)
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
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
        model, _ = _tiny()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 3)
            again = torch.optim.Adam(model.parameters(), lr=2e-2 if changed and how == "lr" else 1e-2)
            if how == "state" and not changed:  # (a loaded state brings its learning rates along)
                again.load_state_dict(opt.state_dict())
            opt = again

    for name, changed in (("a", False), ("b", False), ("c", True)):
        train(name, changed)
    assert _compare(tmp_path / "a", tmp_path / "b")[0] == 0
    code, d = _compare(tmp_path / "a", tmp_path / "c")
    assert code == 3 and d["verdict"] == "inconclusive", d["verdict"]
    assert [r["code"] for r in d["certification"]["reasons"] if r["code"] == "final_settings"], d["certification"]


@pytest.mark.parametrize("how", ["in place", "out of place"])
def test_a_model_output_edited_in_place_before_the_loss_is_said_to_be_edited_not_swapped(tmp_path, how):
    """Helper 56 (MONAI): `out[:, 1].mul_(1.01)` between a model and its loss module in one run was said
    to give the loss "other modules' outputs (arguments swapped or passed from elsewhere)", blamed on the
    data: the loss's input is the very tensor the model returned, edited after it returned. Helper 75
    (fastai's `after_pred` callback): `out = out * 1.1` was said the same; that run's code made it."""
    import torch

    import bitguard

    def train(name, edit):
        model, opt = _tiny()
        loss_fn = torch.nn.MSELoss()
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                opt.zero_grad()
                out = model(x)
                if edit and step == 1 and how == "in place":
                    out[:, 0].mul_(1.01)
                elif edit and step == 1:
                    out = out * 1.01
                loss_fn(out, y).backward()
                opt.step()

    for name, edit in (("a", False), ("b", True)):
        train(name, edit)
    for a, b, run in (("a", "b", "B"), ("b", "a", "A")):
        code, d = _compare(tmp_path / a, tmp_path / b)
        fd = d["first_divergence"]
        assert (code, fd["step"], fd["boundary"], fd["blame"]) == (1, 1, "MSELoss", "consumer"), fd
        detail = fd["blame_window"]["detail"]
        said = (f"in run {run} it was changed in place after it returned" if how == "in place" else
                f"what no recorded module returned in run {run}: that run's code between the calls made it")
        assert said in detail and "swapped" not in detail, detail


def test_a_structure_divergence_where_every_paired_event_is_equal_says_so(tmp_path):
    """Helper 55 (timm's checkpoint_seq calls a Sequential's blocks one by one, the container never): "run B
    lacks the forward of blocks" alone, where every event both runs record is equal, left the user to find
    that out. The pivot's notes say it."""
    import torch

    import bitguard

    def train(name, by_parts):
        model, opt = _tiny()
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
    code, d = _compare(tmp_path / "a", tmp_path / "b")
    fd = d["first_divergence"]
    assert code == 1 and fd["cause"] == "structure", fd
    assert any(n.startswith("every event both runs record has equal digests") for n in fd["notes"]), fd["notes"]


def test_an_optimizer_s_state_paired_across_another_optimizer_names_both_sides(tmp_path):
    """Helper 54 (a parameter moved from torch.optim.Muon to AdamW): the pivot's state row paired with the
    other optimizer's showed run A's name alone (`['momentum_buffer']` for AdamW's `exp_avg`)."""
    import torch

    import bitguard

    def train(name, adam):
        model, _ = _tiny()
        opt = torch.optim.Adam(model.parameters(), lr=0.1) if adam else \
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with bitguard.record(tmp_path / name, determinism=False):
            _sgd_steps(model, opt, 2)

    train("a", False)
    train("b", True)
    fd = _compare(tmp_path / "a", tmp_path / "b")[1]["first_divergence"]
    paired = {(t["role"], t["path"]): t.get("path_b") for t in fd["tensors"] if t["role"] == "state"}
    assert paired.get(("state", "['momentum_buffer']")) == "['exp_avg']", fd["tensors"]
    shown = run_cli("compare", tmp_path / "a", tmp_path / "b").stdout
    assert "state[0]['momentum_buffer'] (B: ['exp_avg'])" in shown, shown


def test_a_value_read_in_one_run_only_is_shown_with_what_it_read(tmp_path):
    """Helper 49: a read made in one run alone was listed as "called in B, not called in A" without the value
    it read, which is what tells a user whether it matters."""
    import torch

    import bitguard

    def train(name, extra):
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(2):
                opt.zero_grad()
                loss = model(torch.randn(2, 4) * (2.0 if extra and step == 1 else 1.0)).pow(2).mean()
                if extra and step == 0:
                    loss.item()  # (a value only run B reads)
                loss.backward()
                opt.step()

    train("a", False)
    train("b", True)
    fd = _compare(tmp_path / "a", tmp_path / "b")[1]["first_divergence"]
    reads = [d for d in fd["api_differences"]["differences"] if d["kind"] == "read"]
    assert reads and reads[0]["b"] == "called" and isinstance(reads[0]["value"], float), reads
    shown = run_cli("compare", tmp_path / "a", tmp_path / "b").stdout
    assert "not called in A, called in B (it read " in shown, shown


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
    fd = _compare(tmp_path / "a", tmp_path / "b")[1]["first_divergence"]
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
        model, opt = _tiny()
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                model.train()
                _sgd_steps(model, opt, 1)
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


def test_saving_a_tensor_the_recorder_hooks_prints_no_warning_the_plain_run_does_not(tmp_path):
    """Helper 72: torch.save of a plain tensor an optimizer steps warned, under record only, that its
    backward hook (the recorder's) "will not be serialized": a line the training's own run never prints."""
    import io
    import warnings

    import torch

    import bitguard

    w = torch.zeros(3, requires_grad=True)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD([w, *model.parameters()], lr=0.1)
    with bitguard.record(tmp_path / "a", determinism=False):
        for _ in range(2):
            loss = (model(torch.randn(2, 3)) * w.sum()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        h = model(torch.randn(2, 3))  # (a module's output, whose gradient the recorder watches)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            torch.save({"w": w, "h": h, "model": model.state_dict()}, io.BytesIO())
    assert not [str(x.message) for x in said if "serialized" in str(x.message)], [str(x.message) for x in said]


def test_an_ema_kept_after_a_large_object_is_still_found(tmp_path):
    """Helper 74: the look for models the training keeps reads 4,096 values at most, depth first: a
    script's ArgumentParser of a dozen options, a global before its EMA, used them all, the EMA was never
    found, and a reset of it compared identical. The look is breadth first: every variable first."""
    import argparse
    import copy

    import torch

    import bitguard

    def train(out, reset):
        model, opt = _tiny()
        parser = argparse.ArgumentParser()
        for i in range(40):
            parser.add_argument(f"--option{i}", type=int, default=i, help=f"option {i}")
        ema = copy.deepcopy(model).requires_grad_(False)
        with bitguard.record(out, determinism=False):
            for step in range(3):
                _sgd_steps(model, opt, 1)
                with torch.no_grad():
                    for e, p in zip(ema.parameters(), model.parameters()):
                        e.lerp_(p, 1.0 if reset and step == 1 else 0.1)
        assert parser is not None

    fd = _planted(tmp_path, train, False, True)
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
            _sgd_steps(model, opt, 2)

    fd = _planted(tmp_path, train, 1.0, 2.0)
    assert (fd["step"], fd["kind"], fd["boundary"], fd["blame"]) == (0, "module", "1", "source"), fd
    assert fd["blame_window"]["module"] == "1", fd["blame_window"]
    assert "differ at its first call" in fd["blame_window"]["detail"], fd["blame_window"]
