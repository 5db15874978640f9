"""API-level events (collectors/api_events.py): recorded in-process with `bitguard.record` on tiny
models. The training is a plain run's bit for bit, every wrapped function is back afterwards, a
failing wrapper never reaches the training, and the rows hold what the calls were given and
returned (scalars read at the step's end)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.nn.utils import clip_grad_norm_  # imported by name before any recording: still seen

import bitguard
from bitguard.backend.invariants.check import check_run, load_invariants
from bitguard.backend.invariants.infer import infer_runs
from bitguard.collectors.api_events import ApiRecorder
from bitguard.cuda.fingerprint import digest
from bitguard.db import connect


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.2)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(6, 7, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        return self.head(self.frozen(self.drop(self.mid(self.emb(x))))).float().logsumexp(-1).mean()


def train(steps: int = 3, seen: list | None = None):
    """A loop using zero_grad (both flavours of set_to_none), GradScaler, clip_grad_norm_ (by name),
    clip_grad_value_ and a scheduler; the model's final parameters (and what each call returned)."""
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(steps):
        opt.zero_grad(set_to_none=step % 2 == 0)
        x = torch.randint(0, 7, (4, 5))
        loss = model(x)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = clip_grad_norm_(model.parameters(), 0.05)
        torch.nn.utils.clip_grad_value_((p for p in model.parameters() if p.grad is not None), 1e-3)
        scaler.step(opt)
        scaler.update()
        sched.step()
        if seen is not None:
            seen.append({"loss": loss.item(), "norm": norm.item(), "scale": scaler.get_scale(), "lr": sched.get_last_lr()[0]})
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def api_rows(run: Path) -> list[dict]:
    con = connect(run / "rank-0.duckdb", read_only=True)
    try:
        rows = con.execute("SELECT step, rank, ord, kind, target, value FROM api_events ORDER BY ord").fetchall()
    finally:
        con.close()
    return [{"step": s, "rank": r, "ord": o, "kind": k, "target": t, "value": json.loads(v)} for s, r, o, k, t, v in rows]


def originals() -> dict:
    from torch.nn.utils import clip_grad
    from torch.optim import lr_scheduler
    from torch.optim import optimizer as optim

    return {
        "Optimizer.zero_grad": torch.optim.Optimizer.__dict__["zero_grad"],
        "Module.zero_grad": torch.nn.Module.__dict__["zero_grad"],
        "Tensor.backward": torch.Tensor.__dict__["backward"],
        "autograd.backward": torch.autograd.backward,
        "clip_grad_norm_": torch.nn.utils.clip_grad_norm_,
        "clip_grad._get_total_norm": clip_grad._get_total_norm,
        "clip_grad._clip_grads_with_norm_": clip_grad._clip_grads_with_norm_,
        "utils.clip_grads_with_norm_": torch.nn.utils.clip_grads_with_norm_,
        "clip_grad_value_": torch.nn.utils.clip_grad_value_,
        "clip_grad.clip_grad_value_": clip_grad.clip_grad_value_,
        "LRScheduler.step": lr_scheduler.LRScheduler.__dict__["step"],
        "ReduceLROnPlateau.step": lr_scheduler.ReduceLROnPlateau.__dict__["step"],
        "SequentialLR.step": lr_scheduler.SequentialLR.__dict__["step"],
        "GradScaler.scale": torch.amp.GradScaler.__dict__["scale"],
        "GradScaler.update": torch.amp.GradScaler.__dict__["update"],
        "step post hooks": dict(optim._global_optimizer_post_hooks),
    }


def test_recorded_training_is_bitwise_plain_and_every_wrapper_is_removed(tmp_path):
    before = originals()
    plain_seen, recorded_seen = [], []
    plain = train(seen=plain_seen)
    with bitguard.record(tmp_path / "run"):
        inside = originals()
        recorded = train(seen=recorded_seen)
    assert inside["Optimizer.zero_grad"] is not before["Optimizer.zero_grad"]  # they were wrapped
    assert inside["clip_grad._clip_grads_with_norm_"] is not before["clip_grad._clip_grads_with_norm_"]
    after = originals()
    for name, original in before.items():
        assert after[name] == original if name == "step post hooks" else after[name] is original, name
    assert plain_seen == recorded_seen
    for name, p in plain.items():
        assert torch.equal(p.view(torch.uint8) if p.dtype != torch.bool else p, recorded[name].view(torch.uint8)), name


def test_rows_hold_what_the_calls_were_given_and_returned(tmp_path):
    seen = []
    with bitguard.record(tmp_path / "run"):
        train(seen=seen)
    rows = api_rows(tmp_path / "run")
    assert [r["ord"] for r in rows] == list(range(len(rows)))
    by_step, reads = {}, {}
    for r in rows:  # (the numbers the loop reads, `loss.item()` and `norm.item()`, apart: below)
        (reads if r["kind"] == "read" else by_step).setdefault(r["step"], []).append(r)
    # the loop's own reads, in order, after the step that made them ended (torch's own, GradScaler's
    # `get_scale()` and AdamW's step counts, are not rows)
    for step in (0, 1, 2):
        assert [(r["target"], r["value"]["value"]) for r in reads[step + 1]] == \
            [("item", seen[step]["loss"]), ("item", seen[step]["norm"])], reads
    # step 0 has no update or scheduler step before it; later steps begin with the previous step's
    # calls after optimizer.step() ended (as events count steps)
    assert [r["kind"] for r in by_step[0]] == ["scheduler_init", "zero_grad", "params", "modes", "backward", "clip_grad_norm",
                                             "clip_grad_value", "optimizer_step"]
    assert [r["kind"] for r in by_step[1]] == ["loss_scale", "scheduler_step", "zero_grad", "params", "modes",
                                             "backward", "clip_grad_norm", "clip_grad_value", "optimizer_step"]
    init = by_step[0][0]  # the step the scheduler's constructor takes: a scheduler exists
    assert init["target"] == "CosineAnnealingLR#0" and init["value"]["last_lr"] == [1e-2]
    assert init["value"]["optimizer"] == "AdamW#0"
    for step in (0, 1, 2):
        rec = {r["kind"]: r for r in by_step[step]}
        zero = rec["zero_grad"]["value"]
        assert zero["set_to_none"] is (step % 2 == 0)
        assert zero["params"] == ["emb.weight", "mid.weight", "mid.bias"]  # named though before the first forward
        back = rec["backward"]["value"]
        assert back["scaled_by"] == 256.0 and back["value"] == pytest.approx(seen[step]["loss"] * 256.0)
        assert back["calls_in_step"] == 1 and back["shape"] == [] and back["dtype"] == "float32"
        clip = rec["clip_grad_norm"]["value"]
        assert clip["max_norm"] == 0.05 and clip["norm_type"] == 2.0
        assert clip["total_norm"] == seen[step]["norm"]  # what clip_grad_norm_ returned, read at the step's end
        assert set(clip["params"]) == {"emb.weight", "mid.weight", "mid.bias", "frozen.weight", "frozen.bias"}
        assert rec["clip_grad_value"]["value"] == {"clip_value": 1e-3, "params": []}  # a generator: not read
        group = rec["optimizer_step"]["value"]["groups"][0]
        assert group["lr"] == pytest.approx(seen[step - 1]["lr"] if step else 1e-2)
        assert group["weight_decay"] == 0.1 and group["betas"] == [0.9, 0.999]
        assert rec["optimizer_step"]["target"] == "AdamW#0"
        params = rec["params"]["value"]
        assert params["emb.weight"]["storage"] == params["head.weight"]["storage"]  # tied
        assert params["mid.weight"]["storage"] != params["emb.weight"]["storage"]
        assert params["frozen.weight"]["requires_grad"] is False and params["mid.bias"]["requires_grad"] is True
        assert params["mid.weight"]["dtype"] == "float32" and params["mid.weight"]["device"] == "cpu"
        assert rec["modes"]["value"] == {"training": ["Tied", "drop"], "eval": []}
    for step in (1, 2, 3):
        rec = {r["kind"]: r for r in by_step[step]}
        assert rec["scheduler_step"]["value"]["last_lr"] == [pytest.approx(seen[step - 1]["lr"])]
        assert rec["scheduler_step"]["value"]["class"] == "CosineAnnealingLR"
        assert rec["loss_scale"]["value"]["scale"] == seen[step - 1]["scale"]


def test_params_row_digests_the_weights_at_the_forward_and_modes_follow_eval(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run"):
        expected = []
        for step in range(2):
            if step == 1:
                model.drop.eval()  # dropout left in eval mode
            expected.append(digest(model.mid.weight.detach())[0])
            model(torch.randint(0, 7, (2, 3))).backward()
            opt.step()
            opt.zero_grad()
        model(torch.randint(0, 7, (2, 3)))  # a forward after the last step: its own params row
    rows = api_rows(tmp_path / "run")
    params = [r for r in rows if r["kind"] == "params"]
    assert [r["step"] for r in params] == [0, 1, 2]
    assert [int(r["value"]["mid.weight"]["xor"], 16) for r in params[:2]] == expected
    modes = [r["value"] for r in rows if r["kind"] == "modes"]
    assert modes[0] == {"training": ["Tied", "drop"], "eval": []}
    assert modes[1] == {"training": ["Tied"], "eval": ["drop"]}
    zero = [r for r in rows if r["kind"] == "zero_grad"]
    assert [r["step"] for r in zero] == [1, 2]  # after step() ended: the next step's


def test_a_failing_wrapper_is_a_collector_error_never_the_trainings(tmp_path, monkeypatch):
    def broken(self, *args):
        raise RuntimeError("planted")

    monkeypatch.setattr(ApiRecorder, "_on_scheduler_step", broken)
    monkeypatch.setattr(ApiRecorder, "_on_clip_norm", broken)
    plain = train()
    with bitguard.record(tmp_path / "run"):
        recorded = train()
    for name, p in plain.items():
        assert torch.equal(p, recorded[name]), name
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    errors = manifest["collector_errors"]
    assert any("api events broken: RuntimeError: planted" in e for e in errors), errors
    kinds = {r["kind"] for r in api_rows(tmp_path / "run")}
    assert "scheduler_step" not in kinds and "optimizer_step" in kinds and "backward" in kinds


def test_module_zero_grad_and_autograd_backward_with_two_roots(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run"):
        for _ in range(2):
            model.zero_grad(set_to_none=False)
            a = model(torch.randn(2, 3)).sum()
            b = model(torch.randn(2, 3)).sum()
            torch.autograd.backward([a, b])
            opt.step()
    rows = api_rows(tmp_path / "run")
    step0 = [r for r in rows if r["step"] == 0]
    assert step0[0]["kind"] == "zero_grad" and step0[0]["target"] == "Linear"
    assert step0[0]["value"] == {"set_to_none": False, "params": ["weight", "bias"]}
    back = [r["value"] for r in step0 if r["kind"] == "backward"]
    assert len(back) == 1 and back[0]["roots"] == 2 and back[0]["calls_in_step"] == 1
    assert [r["kind"] for r in step0].count("params") == 1 and [r["kind"] for r in step0].count("modes") == 2



def test_a_compiled_models_zero_grad_is_its_models(tmp_path):
    """Helper 90 (the HF Trainer with torch_compile): zero_grad of the OptimizedModule was listed among the likely
    causes as "called in B" beside the model's own "not called in B", against an eager run: the same call."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    compiled = torch.compile(model, backend="eager")
    with bitguard.record(tmp_path / "run"):
        compiled.zero_grad()
    assert [r["target"] for r in api_rows(tmp_path / "run") if r["kind"] == "zero_grad"] == ["Linear"]

BUGGY = textwrap.dedent("""
    import sys, torch
    torch.manual_seed(int(sys.argv[1]))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        if sys.argv[2] != "no_zero_grad" or step == 0:
            opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
""")


@pytest.mark.slow
@pytest.mark.extended  # record --check end to end is also tests/invariants/test_engine_end_to_end.py's
def test_record_check_reports_a_missing_zero_grad_in_its_step(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(BUGGY)
    for seed in (0, 1):  # the clean runs invariants are inferred from, in this process
        with bitguard.record(tmp_path / f"clean{seed}", seed=seed):
            subprocess_free_run(script, [str(seed), "clean"])
    inv = tmp_path / "inv.json"
    inv.write_text(json.dumps(infer_runs([tmp_path / "clean0", tmp_path / "clean1"])))
    bitguard_cli = Path(sys.executable).with_name("bitguard")
    run = lambda out, bug: subprocess.run(  # noqa: E731
        [str(bitguard_cli), "record", "--out", str(tmp_path / out), "--check", str(inv), "--",
         sys.executable, str(script), "0", bug], capture_output=True, text=True, timeout=300)
    clean = run("checked_clean", "clean")
    assert clean.returncode == 0, clean.stderr
    assert "invariant violated" not in clean.stderr
    buggy = run("checked_buggy", "no_zero_grad")
    assert buggy.returncode == 0, buggy.stderr
    lines = [line for line in buggy.stderr.splitlines() if line.startswith("bitguard: invariant violated")]
    assert any(line.startswith("bitguard: invariant violated at step 1 rank 0: ") and "zero_grad" in line
               for line in lines), buggy.stderr
    assert not any(" at step 0 " in line for line in lines), lines  # step 0 zeroes its gradients
    con = connect(tmp_path / "checked_buggy" / "rank-0.duckdb", read_only=True)
    try:
        found = con.execute("SELECT step, rank, invariant_id, template, evidence FROM violations").fetchall()
    finally:
        con.close()
    assert {(s, r) for s, r, *_ in found} == {(1, 0), (2, 0)}
    assert any("zero_grad" in i and t == "EventContain" for _, _, i, t, _ in found), found
    assert all(isinstance(json.loads(e), dict) for *_, e in found)
    assert len(found) == len(lines)
    # the online check found what the offline one finds in the same run
    offline = check_run(tmp_path / "checked_buggy", load_invariants(inv))
    assert sorted((v["step"], v["invariant_id"]) for v in offline["violations"]) == sorted((s, i) for s, _, i, *_ in found)


def subprocess_free_run(script: Path, args: list[str]) -> None:
    """Run a script in this process as `python script args` would (inside the caller's recording)."""
    import runpy

    argv = sys.argv
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv


def test_online_mode_records_the_calls_with_the_collectors_names(tmp_path):
    plain = train()
    with bitguard.record(tmp_path / "run", mode="online"):
        recorded = train()
    for name, p in plain.items():
        assert torch.equal(p, recorded[name]), name
    rows = api_rows(tmp_path / "run")
    kinds = [r["kind"] for r in rows if r["step"] == 1]
    assert kinds == ["loss_scale", "scheduler_step", "zero_grad", "backward", "clip_grad_norm", "clip_grad_value",
                     "optimizer_step"]  # no params or modes rows: online mode wraps no module call
    zero = next(r for r in rows if r["kind"] == "zero_grad" and r["step"] == 1)
    assert zero["value"]["params"] == ["emb.weight", "mid.weight", "mid.bias"]


def test_a_loop_that_never_steps_writes_its_rows_as_they_pile_up(tmp_path):
    from bitguard.collectors.api_events import MAX_PENDING_ROWS

    model = torch.nn.Linear(2, 2)
    with bitguard.record(tmp_path / "run", mode="trusted") as recording:
        held = []
        with torch.no_grad():
            for _ in range(MAX_PENDING_ROWS + 10):
                model(torch.ones(1, 2))
                held.append(len(recording.collector.api._pending))
    assert max(held) == MAX_PENDING_ROWS - 1 and held[-1] == 11  # held rows stay bounded
    rows = api_rows(tmp_path / "run")
    assert [r["kind"] for r in rows].count("modes") == MAX_PENDING_ROWS + 10
    assert [r["kind"] for r in rows].count("params") == 1 and {r["step"] for r in rows} == {0}


def test_torch_s_own_reads_are_not_rows_but_its_tensorboard_writer_s_are(tmp_path):
    """A read is the training's when its code makes it: Adam's `.item()` of its step counts (torch's
    folder) is not a row; torch's TensorBoard writer's `.numpy()` of what the user logs is."""
    import os

    folder = os.path.dirname(torch.__file__)
    space: dict = {}
    for name, where in (("optim", ("optim", "bench.py")), ("board", ("utils", "tensorboard", "bench.py"))):
        exec(compile(f"def {name}(t):\n    return t.item(), t.numpy()\n", os.path.join(folder, *where), "exec"), space)
    with bitguard.record(tmp_path / "run", determinism=False):
        space["optim"](torch.tensor(1.5))
        space["board"](torch.tensor(2.5))
    reads = [(r["target"], r["value"].get("value")) for r in api_rows(tmp_path / "run") if r["kind"] == "read"]
    assert [t for t, _ in reads] == ["item", "numpy"] and reads[0][1] == 2.5, reads


def test_a_warning_torch_gives_on_a_read_is_the_readers_line_s(tmp_path, monkeypatch):
    """`float(loss)` of a tensor that requires grad makes torch warn; under a recording the warning was
    attributed to collectors/reads.py (the wrapper of `__float__`), where python names the line that
    read it: its filters (`-W error`, a module's `ignore`) and its once-per-line registry saw another
    place. (torch gives that warning once a process: a read that warns every time stands in for it.)"""
    import warnings

    real = torch.Tensor.item

    def item(self):
        warnings.warn("a read torch warns about", UserWarning, stacklevel=2)
        return real(self)

    monkeypatch.setattr(torch.Tensor, "item", item)
    t = torch.tensor(1.5)
    with bitguard.record(tmp_path / "run", determinism=False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = sys._getframe().f_lineno + 1
            value = t.item()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="a read torch warns about", module=__name__)
            with pytest.raises(UserWarning, match="a read torch warns about"):
                t.item()
    assert value == 1.5
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]
    assert [r["kind"] for r in api_rows(tmp_path / "run")].count("read") == 1


def test_a_read_leaves_pythons_warning_filters_alone(tmp_path):
    """A warning python shows once a place (its default) was shown again after every read: the read's
    wrapper swapped the warning filters, which starts each place's once-registry anew."""
    import warnings

    t = torch.tensor(1.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        with bitguard.record(tmp_path / "run", determinism=False):
            for _ in range(3):
                warnings.warn("a warning of the training's each step", UserWarning)
                t.item()
    assert [str(w.message) for w in caught].count("a warning of the training's each step") == 1
