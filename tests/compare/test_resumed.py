"""A training resumed from a checkpoint in a new process counts its steps from 0 again: compared
step for step with the uninterrupted run it diverged at step 0 ("the parameters ... were made
differently"), and nothing compared its steps with the run's tail. `compare --resumed-at STEP`
compares B's step s with A's step STEP + s and leaves out what each side recorded before its first
batch there (the checkpoint A saved, its scheduler's step; B's setup); without it, the pivot says
which step of A B's parameters are."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import bitguard
from bitguard.backend.drill import drill_comparison
from bitguard.errors import BadInput, NotSupported
from incli import run_cli

STEPS, SAVE_AT = 6, 3


def _train(path, checkpoint, resume: bool = False, load_scheduler: bool = True, load_model: bool = True,
           rng_late: bool = False) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS)]
    with bitguard.record(path, determinism=False):
        start = 0
        if resume:
            state = torch.load(checkpoint)
            if load_model:
                model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            if load_scheduler:
                sched.load_state_dict(state["sched"])
            start = state["step"]
            if not rng_late:
                torch.set_rng_state(state["rng"])
            with torch.no_grad():  # (as nanoGPT: an evaluation at the resume step, in both processes)
                model(torch.randn(4, 8))
            if rng_late:  # (the RNG put back only after it, as it was after A's: the evaluation differs, the training not)
                torch.set_rng_state(state["rng_after"])
        for step in range(start, STEPS):
            x, y = data[step]
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            loss.item()
            torch.rand(1)  # (a draw a step: the RNG state moves with the training)
            if step + 1 == SAVE_AT and not resume:  # (evaluate, then save with a JSON, as the HF Trainer does)
                rng = torch.get_rng_state()
                with torch.no_grad():
                    model(torch.randn(4, 8))
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "step": SAVE_AT, "rng": rng, "rng_after": torch.get_rng_state()}, checkpoint)
                checkpoint.with_suffix(".json").write_text(json.dumps({"step": SAVE_AT}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return record_runs(tmp_path_factory.mktemp("resumed"))


def record_runs(root):
    """The uninterrupted run `a` and its resumes from SAVE_AT: correct, and with parts not restored."""
    checkpoint = root / "ckpt.pt"
    _train(root / "a", checkpoint)
    _train(root / "resumed", checkpoint, resume=True)
    _train(root / "no_scheduler", checkpoint, resume=True, load_scheduler=False)
    _train(root / "no_model", checkpoint, resume=True, load_model=False)
    _train(root / "rng_late", checkpoint, resume=True, rng_late=True)
    return root


def test_step_for_step_the_pivot_says_which_step_of_a_the_resumed_run_starts_from(runs):
    c = bitguard.compare(runs / "a", runs / "resumed")
    fd = c.first_divergence
    assert (c.verdict, fd["step"], fd["kind"]) == ("diverged", 0, "params"), fd
    assert "are run A's at step 3" in fd["blame_window"]["detail"] and "--resumed-at 3" in fd["blame_window"]["detail"]


def test_a_resumed_run_compares_identical_with_the_tail_it_resumed(runs):
    c = bitguard.compare(runs / "a", runs / "resumed", resumed_at=SAVE_AT)
    assert c.verdict == "identical", c.first_divergence or c.blocking_reasons()
    doc = c.to_dict()
    assert doc["analysis"]["resumed_at"] == SAVE_AT
    assert [r["code"] for r in doc["certification"]["reasons"]] == ["resumed"], doc["certification"]
    # every step of B paired; A's before the resume left out, and its evaluation, save and JSON file before it
    al = doc["alignment"]
    assert al["gaps_a"] == al["gaps_b"] == 0 and al["matched"] == al["events_a"] == al["events_b"] > 0, al
    assert doc["certification"]["compared_steps"] == {"0": [SAVE_AT, None]}
    # the headline names the steps compared, not run A's whole recording
    done = run_cli("compare", runs / "a", runs / "resumed", "--resumed-at", SAVE_AT)
    assert done.returncode == 0 and f"identical — {al['matched']} matched events from run A's step {SAVE_AT} on " \
        f"(run B resumed A at step {SAVE_AT}" in done.stdout, done.stdout


def test_the_resumed_run_given_as_a_is_named_with_the_order_that_works(runs):
    """The resumed run given as A, the run it resumed as B: the pivot said the parameters "were made
    differently" (A's step 0 weights are B's at step SAVE_AT, which only B's side shows)."""
    fd = bitguard.compare(runs / "resumed", runs / "a").first_divergence
    assert (fd["step"], fd["kind"]) == (0, "params"), fd
    assert f"run A's parameters at step 0 are run B's at step {SAVE_AT}" in fd["blame_window"]["detail"], fd
    assert f"`bitguard compare B A --resumed-at {SAVE_AT}`" in fd["blame_window"]["detail"], fd


def test_a_wrong_resume_step_is_no_identical_and_the_right_one_is_named(runs):
    c = bitguard.compare(runs / "a", runs / "resumed", resumed_at=SAVE_AT - 1)
    fd = c.first_divergence
    assert (c.verdict, fd["step"], fd["kind"]) == ("diverged", SAVE_AT - 1, "params"), fd
    assert f"`bitguard compare --resumed-at {SAVE_AT}`" in fd["blame_window"]["detail"], fd["blame_window"]


def test_weights_not_restored_are_the_pivot_at_the_resume_step(runs):
    """Helper 37: the params event of the resume step was cut with what came before the batch, and
    the first forward was blamed as if the Linear computed differently."""
    fd = bitguard.compare(runs / "a", runs / "no_model", resumed_at=SAVE_AT).first_divergence
    assert (fd["step"], fd["kind"], fd["blame"]) == (SAVE_AT, "params", "source"), fd
    assert "the checkpoint did not restore them" in fd["blame_window"]["detail"], fd["blame_window"]


def test_a_scheduler_not_restored_diverges_at_its_first_effect_and_names_it(runs):
    c = bitguard.compare(runs / "a", runs / "no_scheduler", resumed_at=SAVE_AT)
    fd = c.first_divergence
    assert (c.verdict, fd["step"], fd["phase"]) == ("diverged", 4, "optimizer"), fd
    diffs = fd["api_differences"]["differences"]
    assert any(d["kind"] == "scheduler_step" and d["field"] == "last_lr" for d in diffs), diffs
    done = run_cli("compare", runs / "a", runs / "no_scheduler", "--resumed-at", SAVE_AT)
    assert done.returncode == 1 and "last_lr [0.0025] (A) vs [0.005] (B)" in done.stdout, done.stdout


def test_bad_resume_steps_and_the_drill_are_refused(runs):
    with pytest.raises(BadInput, match="--resumed-at must be a step number"):
        bitguard.compare(runs / "a", runs / "resumed", resumed_at=-1)
    with pytest.raises(BadInput, match=f"past run A's last step \\({STEPS - 1}"):
        bitguard.compare(runs / "a", runs / "resumed", resumed_at=STEPS)
    with pytest.raises(BadInput, match="or give the runs in the other order: run B completed 6 step"):  # (helper 43)
        bitguard.compare(runs / "resumed", runs / "a", resumed_at=SAVE_AT)
    c = bitguard.compare(runs / "a", runs / "no_scheduler", resumed_at=SAVE_AT)
    with pytest.raises(NotSupported, match="resumed run"):
        drill_comparison(c)


def test_a_rule_ignores_one_path_inside_a_save(tmp_path):
    """Helper 37: a resumed nanoGPT saves its config with `init_from: 'resume'` where the run it resumed
    saved 'scratch'; a rule could accept the whole save only. `match.path` accepts that one row."""
    for name, how in (("a", "scratch"), ("b", "resume")):
        torch.manual_seed(0)
        model = nn.Linear(2, 2)
        with bitguard.record(tmp_path / name, determinism=False):
            torch.save({"model": model.state_dict(), "config": {"init_from": how, "lr": 0.1}},
                       tmp_path / f"{name}.pt")
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "diverged"
    rules = tmp_path / "rules.json"
    rule = {"id": "init-from", "action": "ignore", "match": {"boundary": "torch.save", "path": "*init_from*"}}
    rules.write_text(json.dumps({"schema": "bitguard.rules/1", "rules": [rule]}))
    c = bitguard.compare(tmp_path / "a", tmp_path / "b", rules=str(rules))
    assert c.verdict == "identical" and c.rules_fired == [{"id": "init-from", "count": 1}], c.first_divergence
    rule["match"]["path"] = "*[[]'lr'[]]*"  # (another row: a literal bracket is [[] in a glob)
    rules.write_text(json.dumps({"schema": "bitguard.rules/1", "rules": [rule]}))
    assert bitguard.compare(tmp_path / "a", tmp_path / "b", rules=str(rules)).verdict == "diverged"
    rule["action"] = "allow-gap"
    rules.write_text(json.dumps({"schema": "bitguard.rules/1", "rules": [rule]}))
    with pytest.raises(bitguard.errors.RulesError, match="match.path applies to 'ignore' rules only"):
        bitguard.compare(tmp_path / "a", tmp_path / "b", rules=str(rules))


def test_a_setting_that_differs_only_after_the_last_step_is_no_identical(tmp_path):
    """Helper 37: a scheduler not restored, whose first effect would be the step after the recording's
    last, compared identical (with a note): every tensor is equal, but the training's state is not."""
    for name, gamma in (("a", 0.5), ("b", 0.5), ("c", 0.25)):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma)  # (its first decay: after the second, last, step)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                sched.step()
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    c = bitguard.compare(tmp_path / "a", tmp_path / "c")
    assert c.verdict == "inconclusive" and [r["code"] for r in c.blocking_reasons()] == ["final_settings"], \
        c.blocking_reasons()
    assert "last_lr differs after the last optimizer step" in c.blocking_reasons()[0]["message"]


def test_what_the_resumed_run_did_before_its_first_batch_is_checked_against_a(runs):
    """Helper 38: both runs evaluated at the resume step (nanoGPT), the resumed one before putting its
    RNG state back; the region before the first training batch was left out, and it compared identical."""
    c = bitguard.compare(runs / "a", runs / "rng_late", resumed_at=SAVE_AT)
    assert c.verdict == "inconclusive" and [r["code"] for r in c.blocking_reasons()] == ["resume_setup"], \
        (c.verdict, c.first_divergence, c.blocking_reasons())
    assert bitguard.compare(runs / "a", runs / "resumed", resumed_at=SAVE_AT).verdict == "identical"


def test_a_scheduler_not_restored_whose_rate_matches_at_the_end_is_no_identical(tmp_path):
    """Helper 38: StepLR(3) not restored by a resume at step 7 of 8 had the same last_lr at the end, and
    compared identical; its count (last_epoch) differs."""
    checkpoint = tmp_path / "ck.pt"
    for name, resume, load in (("a", False, True), ("b", True, False)):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
        start = 0
        with bitguard.record(tmp_path / name, determinism=False):
            if resume:
                state = torch.load(checkpoint)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                if load:
                    sched.load_state_dict(state["sched"])
                start = 7
            for step in range(start, 8):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                sched.step()
                if step == 6 and not resume:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                               checkpoint)
    c = bitguard.compare(tmp_path / "a", tmp_path / "b", resumed_at=7)
    assert c.verdict != "identical", c.to_dict()["api_differences"]


def _accumulating(path, checkpoint, resume: bool, held: bool = False) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    temperature = nn.Parameter(torch.ones(()))  # (a tensor only the optimizer holds: SAC's log_alpha)
    params = list(model.parameters()) + ([temperature] if held else [])
    opt = torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(2, 4, generator=g) for _ in range(8)]
    start = 0
    with bitguard.record(path, determinism=False):
        if resume:
            state = torch.load(checkpoint)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            temperature.data.copy_(state["t"])
            start = 2
        for step in range(start, 4):
            opt.zero_grad()
            for micro in range(2):  # gradient accumulation: two calls of the model a step
                (model(data[2 * step + micro]) * temperature).pow(2).mean().backward()
            opt.step()
            if step == 1 and not resume:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "t": temperature.detach()},
                           checkpoint)


def test_a_correct_resume_with_accumulation_and_a_tensor_only_the_optimizer_holds_is_identical(tmp_path):
    """Helper 38: a resumed process takes a params event at every call of its first step, and finds the
    tensors only an optimizer holds at its first step(); the run it resumed did neither at that step,
    so every correct resume with gradient accumulation (HF Trainer, nanoGPT) compared diverged."""
    for held in (False, True):
        ck = tmp_path / f"ck{held}.pt"
        _accumulating(tmp_path / f"a{held}", ck, False, held)
        _accumulating(tmp_path / f"b{held}", ck, True, held)
        c = bitguard.compare(tmp_path / f"a{held}", tmp_path / f"b{held}", resumed_at=2)
        assert c.verdict == "identical", (held, c.first_divergence)


def test_a_window_against_the_whole_run_is_inconclusive_not_ended(tmp_path):
    """Helper 38: a run recorded with --steps 0:2 against the whole run diverged as "run B ends here"
    at its window's final state; the windows differ, which the step_window reason says."""
    for name, steps in (("a", None), ("b", "0:2")):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False, steps=steps):
            for _ in range(4):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
    c = bitguard.compare(tmp_path / "a", tmp_path / "b")
    assert c.verdict == "inconclusive" and [r["code"] for r in c.blocking_reasons()] == ["step_window"], \
        (c.first_divergence, c.blocking_reasons())
    # A's events past B's window are listed as not compared, each said as what it is (helper 43 read
    # "step 2 optimizer Sequential" of a params event)
    done = run_cli("compare", tmp_path / "a", tmp_path / "b")
    assert "only in A: step 2, the parameters at the start of Linear (Linear)" in done.stdout, done.stdout
    assert "only in A: step 2, the forward of Linear (Linear)" in done.stdout, done.stdout


def _keeping(path, checkpoint, resume: bool, kept: str) -> dict | None:
    """A loop whose checkpoint holds its weights as a list too (as an EMA's are saved); resumed, the
    loaded checkpoint is kept to the end (`kept` "checkpoint"), or a list of the final weights is
    (`kept` "weights": B keeps a state A does not)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = torch.load(checkpoint) if resume else None
    with bitguard.record(path, determinism=False):
        if resume:
            model.load_state_dict(state["model"])
        for step in range(state["step"] if resume else 0, 4):
            opt.zero_grad()
            model(torch.full((2, 4), float(step))).sum().backward()
            opt.step()
            if step + 1 == 2 and not resume:
                torch.save({"model": model.state_dict(), "step": 2,
                            "weights": [p.detach().clone() for p in model.parameters()]}, checkpoint)
        final = [p.detach().clone() for p in model.parameters()] if kept == "weights" else None
    return state if kept == "checkpoint" else final


def test_a_checkpoint_kept_to_the_end_is_no_end_of_the_resumed_run_but_other_kept_weights_are(tmp_path):
    """Helper 38: a resumed script holding the checkpoint it loaded (`ck = torch.load(...)` at its top
    level) to the end has its list of weights found as a kept model, in B only: "run B ends here" on
    a correct resume. Weights that are A's parameters at the resume step, tensor for tensor, are that
    checkpoint; weights B keeps that are not (its own final ones) still end run B."""
    _keeping(tmp_path / "a", tmp_path / "ck.pt", False, "")
    for kept in ("checkpoint", "weights"):
        held = _keeping(tmp_path / kept, tmp_path / "ck.pt", True, kept)
        c = bitguard.compare(tmp_path / "a", tmp_path / kept, resumed_at=2)
        assert held is not None
        notes = [r["message"] for r in c.certification_reasons() if "keeps the checkpoint" in r["message"]]
        if kept == "checkpoint":
            assert c.verdict == "identical", c.first_divergence
            assert len(notes) == 1 and "run A's parameters at step 2" in notes[0], c.certification_reasons()
        else:
            fd = c.first_divergence  # (the checkpoint is held there too: it is not what ends run B)
            assert (c.verdict, fd["kind"], fd["blame"], fd["boundary"]) == ("diverged", "final", "structure", "final"), fd


def test_the_headline_of_a_resumed_comparison_names_the_steps_compared():
    """Under --resumed-at the headline said "within the recorded steps 0:8", run A's window, of a
    comparison that left A's steps before the resume out (helper 38)."""
    from types import SimpleNamespace

    from bitguard.backend.report import _within

    a, b = SimpleNamespace(manifest={"steps": [0, 8]}, step_shift=0), SimpleNamespace(manifest={}, step_shift=3)
    assert _within(SimpleNamespace(run_a=a, run_b=b)) == \
        " within run A's steps 3:8 (run B resumed A at step 3: its steps 0:5)"
    assert _within(SimpleNamespace(run_a=a, run_b=SimpleNamespace(manifest={}, step_shift=0))) == \
        " within the recorded steps 0:8"


@pytest.mark.parametrize("edit", ["lr", "momentum_buffer"])
def test_an_optimizer_edited_after_the_last_step_is_no_identical(tmp_path, edit):
    """Helper 50: a learning rate set by hand after the last step() (a plateau callback's, Keras'
    `lr.assign` in on_epoch_end), or a momentum buffer edited then, reaches no recorded tensor and
    compared identical, where the same change made by a scheduler's step() was inconclusive."""
    for name, changed in (("a", False), ("b", False), ("c", True)):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
            if changed and edit == "lr":
                opt.param_groups[0]["lr"] = 0.05
            elif changed:
                for state in opt.state.values():
                    state["momentum_buffer"].mul_(0.5)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    c = bitguard.compare(tmp_path / "a", tmp_path / "c")
    assert c.verdict == "inconclusive" and [r["code"] for r in c.blocking_reasons()] == ["final_settings"], \
        c.blocking_reasons()
    said = "groups[0].lr differs after the last optimizer step" if edit == "lr" else "the optimizer's state"
    assert said in c.blocking_reasons()[0]["message"], c.blocking_reasons()


def _restore(checkpoint, **objects) -> None:
    """Each object given (None: left as it is) loads its state from the checkpoint, under its keyword's key."""
    state = torch.load(checkpoint)
    for key, obj in objects.items():
        if obj is not None:
            obj.load_state_dict(state[key])


def _with_ema(path, checkpoint, resume: bool, load_optimizer: bool = True) -> None:
    """An Adam loop with a deepcopy EMA evaluated at each epoch's end (two steps an epoch), saved after
    the first epoch, after that epoch's EMA evaluation; resumed, the optimizer's state is loaded or not."""
    import copy

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ema = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    with bitguard.record(path, determinism=False):
        if resume:
            _restore(checkpoint, model=model, ema=ema, opt=opt if load_optimizer else None)
        for step in range(2 if resume else 0, 4):
            opt.zero_grad()
            model(data[step]).square().mean().backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.1)
            if step % 2 == 1:
                ema(data[0]).sum().item()  # (the epoch's evaluation)
            if step == 1 and not resume:
                torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict()}, checkpoint)


def test_a_resume_that_forgets_the_optimizer_state_says_so_and_not_the_evaluation_before_the_cut(tmp_path):
    """Helper 55 (timm's train.py resumed): "the training API calls that differ (the likely cause)" named only
    run A's EMA evaluation before the checkpoint ("params (ema): called in A, not called in B"), which
    --resumed-at leaves out of the comparison, and a resume without the optimizer's state was said to be
    "the optimizer update, or an input of it that was not observed, computed differently"."""
    ck = tmp_path / "ck.pt"
    _with_ema(tmp_path / "a", ck, False)
    _with_ema(tmp_path / "b", ck, True)
    _with_ema(tmp_path / "c", ck, True, load_optimizer=False)
    good = bitguard.compare(tmp_path / "a", tmp_path / "b", resumed_at=2)
    assert good.verdict == "identical", good.first_divergence
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c", resumed_at=2).to_dict()["first_divergence"]
    assert (fd["step"], fd["phase"], fd["blame"]) == (2, "optimizer", "source"), fd
    assert "did not resume with the state" in fd["blame_window"]["detail"], fd["blame_window"]
    said = [d for d in fd["api_differences"]["differences"] if d["kind"] == "params"]
    assert not said, said


def _dcp(path, checkpoint, resume: str | None) -> None:
    """SGD with momentum, saved after step 3; resumed through torch.distributed.checkpoint's
    set_optimizer_state_dict (`resume="dcp"`), or the same with the momentum left out (`"lost"`)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    with bitguard.record(path, determinism=False):
        start = 0
        if resume:
            state = torch.load(checkpoint)
            model.load_state_dict(state["model"])
            if resume == "lost":
                state["opt"]["state"] = {}
            set_optimizer_state_dict(model, opt, state["opt"])
            start = 4
        for step in range(start, 6):
            opt.zero_grad()
            model(data[step]).pow(2).mean().backward()
            opt.step()
            if step == 3 and not resume:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, checkpoint)


def test_torch_s_own_initialising_step_of_a_distributed_checkpoint_load_is_no_training_step(tmp_path):
    """Helper 60 (composer's autoresume): `set_optimizer_state_dict` calls step() once with zero gradients
    and the learning rates at 0 before it loads the state; it was the resumed run's step 0 (its parameters
    named after the optimizer, its root renamed), and nothing of the two runs could be paired."""
    ck = tmp_path / "ck.pt"
    for name, resume in (("a", None), ("b", "dcp"), ("c", "lost")):
        _dcp(tmp_path / name, ck, resume)
    good = bitguard.compare(tmp_path / "a", tmp_path / "b", resumed_at=4)
    assert good.verdict == "identical", (good.first_divergence, good.certification_reasons())
    bad = bitguard.compare(tmp_path / "a", tmp_path / "c", resumed_at=4)
    fd = bad.first_divergence
    assert bad.verdict == "diverged" and fd["step"] == 4 and fd["phase"] == "optimizer", fd


def _probed(path, checkpoint, resume: bool) -> None:
    """As `YOLO("yolov8n.yaml").train()`: a first model of the class is built and probed, never trained, then
    the trained one (`Net#2`); resumed (`YOLO("last.pt").train(resume=True)`), the trained one is the first."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(x)

    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 4, generator=g) for _ in range(4)]
    with bitguard.record(path, determinism=False):
        torch.manual_seed(0)
        if not resume:
            Net()(torch.zeros(1, 4))
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        if resume:
            _restore(checkpoint, model=net, opt=opt, rng=None)
            torch.set_rng_state(torch.load(checkpoint)["rng"])
        for step in range(2 if resume else 0, 4):
            (net(data[step]) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 1 and not resume:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()},
                           checkpoint)


def test_a_resumed_run_that_built_fewer_models_first_pairs_its_trained_root(tmp_path):
    """Helper 61: the full run's trained root was `Net#2` (a probe model of the class came first), the
    resumed run's `Net`: nothing after the resume paired, "run A lacks the data of Net"."""
    ck = tmp_path / "ck.pt"
    _probed(tmp_path / "a", ck, False)
    _probed(tmp_path / "b", ck, True)
    c = bitguard.compare(tmp_path / "a", tmp_path / "b", resumed_at=2)
    assert c.verdict == "identical", (c.first_divergence, c.certification_reasons())
