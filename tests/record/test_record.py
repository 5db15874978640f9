"""The recorder: what a run directory holds, reproducibility, faults, crashes and bad input."""

import contextlib
import json
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import time

import duckdb
import pytest
import torch

import bitguard
from bitguard.backend.ingest import load_rank, open_run
from bitguard.schema import EVENTS, TENSORS
from faults import ScaledBackward
from .conftest import BITGUARD, SCRIPTS, TINYGPT, as_older_schema, as_schema_5, record, record_together, run


def events(run_dir, rank=0):
    con = duckdb.connect(str(run_dir / f"rank-{rank}.duckdb"), read_only=True)
    try:
        ev = con.sql("SELECT * FROM events ORDER BY seq").fetchall()
        tensors = con.sql("SELECT * FROM tensors ORDER BY seq, role, idx").fetchall()
    finally:
        con.close()
    return ev, tensors


def digests_by_event(run_dir):
    ev, tensors = events(run_dir)
    names = EVENTS.names
    t_names = TENSORS.names
    out = []
    by_seq = {}
    for t in tensors:
        row = dict(zip(t_names, t))
        by_seq.setdefault(row["seq"], []).append((row["role"], row["idx"], row["xor"], row["pos"]))
    for e in ev:
        row = dict(zip(names, e))
        key = (row["step"], row["phase"], row["kind"], row["boundary"], row["call"])
        out.append((key, tuple(by_seq.get(row["seq"], ()))))
    return out


@pytest.mark.slow
def test_run_directory_layout_and_event_fields(tmp_path):
    out = tmp_path / "run"
    record(out, "--steps", "2", cli=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["complete"] and manifest["exit_status"] == 0
    for key in ("tool_version", "schema_version", "command", "versions", "devices", "world_size", "determinism",
                "start_time", "end_time", "mode"):
        assert key in manifest, key
    det = manifest["determinism"]
    assert det["enabled"] and det["deterministic_algorithms"] and not det["cudnn_benchmark"]
    assert det["torch_threads"] >= 1 and det["CUBLAS_WORKSPACE_CONFIG"] and det["NCCL_ALGO"]
    ev, tensors = events(out)
    rows = [dict(zip(EVENTS.names, e)) for e in ev]
    phases = {r["phase"] for r in rows}
    assert phases == {"data", "forward", "backward", "optimizer"}
    assert [r["seq"] for r in rows] == list(range(len(rows)))
    # each step begins with the model's parameters as its first call meets them, then its batch
    assert [(r["phase"], r["kind"], r["step"]) for r in rows[:2]] == [("optimizer", "params", 0), ("data", "batch", 0)]
    # the optimizer step belongs to the step it ends; the next forward is the next step
    opt = [r for r in rows if r["phase"] == "optimizer" and r["kind"] == "step"]
    assert {r["step"] for r in opt} == {0, 1}
    # the model's final state after the last step (tinygpt's model lives in its main())
    assert [(r["step"], r["boundary"]) for r in rows if r["kind"] == "final"] == [(2, "GPT")]
    first_step1 = next(r for r in rows if r["step"] == 1)
    assert first_step1["kind"] == "params"
    names = {r["boundary"] for r in rows}
    assert {"GPT", "blocks.0.attn.qkv", "lm_head", "blocks.0.mlp.fc.weight"} <= names
    grads = [r for r in rows if r["kind"] == "grad"]
    assert grads and all(r["phase"] == "backward" for r in grads)
    trow = [dict(zip(TENSORS.names, t)) for t in tensors]
    roles = {t["role"] for t in trow}
    assert {"input", "output", "grad_input", "grad_output", "grad", "param", "state"} <= roles
    qkv = next(r for r in rows if r["boundary"] == "blocks.0.attn.qkv" and r["phase"] == "forward")
    assert qkv["module_type"] == "Linear" and qkv["depth"] == 3 and qkv["t_end_ns"] >= qkv["t_start_ns"]
    qkv_t = [t for t in trow if t["seq"] == qkv["seq"]]
    assert [t["role"] for t in qkv_t] == ["input", "output"]
    assert qkv_t[1]["shape"] == [4, 16, 96] and qkv_t[1]["dtype"] == "float32" and qkv_t[1]["nbytes"] == 4 * 16 * 96 * 4
    # dataflow: ln_1's output tensor is qkv's input tensor
    ln1 = next(r for r in rows if r["boundary"] == "blocks.0.ln_1" and r["phase"] == "forward")
    ln1_out = next(t for t in trow if t["seq"] == ln1["seq"] and t["role"] == "output")
    assert ln1_out["tid"] == qkv_t[0]["tid"] and ln1_out["xor"] == qkv_t[0]["xor"]
    con = duckdb.connect(str(out / "rank-0.duckdb"), read_only=True)
    stack = json.loads(con.sql(f"SELECT frames FROM stacks WHERE stack_id = {qkv['stack_id']}").fetchall()[0][0])
    con.close()
    assert any("tinygpt.py" in f and "in forward" in f for f in stack), stack


@pytest.mark.slow
@pytest.mark.extended  # covered by the scenarios and stacks tiers
def test_two_recordings_in_separate_processes_have_identical_digests(tmp_path):
    record(tmp_path / "a", "--steps", "2", "--dropout", "0.1")
    record(tmp_path / "b", "--steps", "2", "--dropout", "0.1")
    a, b = digests_by_event(tmp_path / "a"), digests_by_event(tmp_path / "b")
    assert len(a) == len(b) > 100
    for (ka, da), (kb, db) in zip(a, b):
        assert ka == kb
        assert da == db, f"event {ka} differs between identical runs"


@pytest.mark.slow
@pytest.mark.extended  # covered by the scenarios and stacks tiers
def test_fault_inside_a_linear_changes_that_event_and_only_later_ones(tmp_path):
    record(tmp_path / "ref", "--steps", "2")
    record(tmp_path / "bad", "--steps", "2", "--fault", "forward-bitflip", "--fault-step", "1")
    a, b = digests_by_event(tmp_path / "ref"), digests_by_event(tmp_path / "bad")
    assert [k for k, _ in a] == [k for k, _ in b]
    differing = [i for i, ((_, da), (_, db)) in enumerate(zip(a, b)) if da != db]
    first = differing[0]
    assert a[first][0] == (1, "forward", "module", "blocks.0.mlp.fc", 0), a[first][0]
    # its input matched, its output did not
    ins_a = [t for t in a[first][1] if t[0] == "input"]
    ins_b = [t for t in b[first][1] if t[0] == "input"]
    assert ins_a == ins_b


@pytest.mark.slow
def test_keyword_inputs_and_nested_outputs_are_digested(tmp_path):
    out = tmp_path / "run"
    record(out, script=SCRIPTS / "containers.py")
    ev, tensors = events(out)
    rows = {(r[EVENTS.names.index("boundary")], r[EVENTS.names.index("phase")]): r[0] for r in ev
            if r[EVENTS.names.index("step")] == 0}
    inner = [dict(zip(TENSORS.names, t)) for t in tensors if t[0] == rows[("inner", "forward")]]
    assert [(t["role"], t["path"]) for t in inner] == [
        ("input", "[0]"), ("input", "['scale']"), ("output", "['y']"), ("output", "['pair'][0]"),
        ("output", "['pair'][1]"), ("output", "['gain'] (python float)")], inner  # (not the string 'tag')
    gain = next(t for t in inner if t["path"].startswith("['gain']"))
    bits = int.from_bytes(struct.pack("<d", 1.5), "little")  # a 0-d float64's xor digest is its bits
    assert (gain["dtype"], gain["shape"], gain["xor"]) == ("float64", [], bits)
    root = [dict(zip(TENSORS.names, t)) for t in tensors if t[0] == rows[("Model", "forward")]]
    assert [t["path"] for t in root if t["role"] == "output"] == [".logits", ".extras['aux']"], root


@pytest.mark.slow
def test_a_python_number_a_module_returns_is_compared(tmp_path):
    """Inner returns a Python float that the code after it multiplies by: when it differs, Inner is
    the first divergence (its tensors were the same), not the first module that reads the product."""
    record_together(*(dict(out=tmp_path / name, script=SCRIPTS / "containers.py", script_args=(gain,))
                      for name, gain in (("a", "1.5"), ("b", "1.25"))))
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["boundary"], fd["blame"], fd["fault_class"]) == (0, "inner", "source", "forward"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == ["['gain'] (python float)"], fd["tensors"]
    # a run recorded before these rows (schema 6): they are left out of both sides
    record(tmp_path / "c", "1.5", script=SCRIPTS / "containers.py")
    as_older_schema(tmp_path / "c", 6)
    assert bitguard.compare(tmp_path / "c", tmp_path / "a").verdict == "identical"
    fd = bitguard.compare(tmp_path / "c", tmp_path / "b").first_divergence
    assert (fd["step"], fd["boundary"]) == (0, "Model"), fd  # (the product is the model's own code)


STEPS_KILLED = "12"


@pytest.mark.slow
def test_a_batch_passed_by_keyword_is_the_data_event(tmp_path):
    """`model(input_ids=..., labels=...)`, as Hugging Face models are called: the keyword arguments
    are the step's batch. They were left out of the batch event, so a batch that differed was blamed
    on the first module that read it, as if the data had matched."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys, torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

            def forward(self, input_ids=None, labels=None):
                return torch.nn.functional.cross_entropy(self.head(self.emb(input_ids)).flatten(0, 1), labels.flatten())

        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            ids = torch.randint(0, 16, (2, 5))
            if step == 1 and sys.argv[1] == "perturb":
                ids[0, 0] = (ids[0, 0] + 1) % 16
            opt.zero_grad()
            net(input_ids=ids, labels=ids).backward()
            opt.step()
    """))
    record_together(*(dict(out=tmp_path / name, script=script, script_args=(what,))
                      for name, what in (("a", "same"), ("b", "perturb"), ("c", "same"))))
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["blame"]) == (1, "data", "data"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == ["['input_ids']", "['labels']"], fd["tensors"]
    as_older_schema(tmp_path / "c", 6)  # recorded before: the keyword rows are left out of both sides
    assert bitguard.compare(tmp_path / "c", tmp_path / "a").verdict == "identical"


@pytest.mark.slow
def test_killed_run_leaves_a_readable_directory_with_completed_steps(tmp_path):
    out = tmp_path / "run"
    # killed after its third step, the run still has 9 steps (2.7 s of sleeps) to go; the complete run
    # it is compared with below records all of them (it recorded 50 before, for the same claims)
    cmd = [*BITGUARD, "record", "--out", out, "--", sys.executable, TINYGPT, "--steps", STEPS_KILLED, "--progress",
           "--sleep", "0.3"]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, text=True)
    seen = 0
    for line in proc.stdout:
        if line.startswith("step "):
            seen += 1
        if seen == 3:
            break
    # SIGKILL the training process (the recorder's child), not the launcher
    child = int(subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "tinygpt"], capture_output=True,
                               text=True).stdout.split()[0])
    os.kill(child, signal.SIGKILL)
    assert proc.wait(timeout=60) == 128 + signal.SIGKILL
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["signal"] == "SIGKILL" and not manifest["complete"]
    ev, _ = events(out)
    steps = {dict(zip(EVENTS.names, e))["step"] for e in ev}
    assert {0, 1} <= steps, steps
    per_step = {}
    for e in ev:
        r = dict(zip(EVENTS.names, e))
        per_step[r["step"]] = per_step.get(r["step"], 0) + 1
    # step 2 had ended, so every step before it is whole (step 2's own commit may have been cut)
    assert per_step[0] == per_step[1] >= per_step.get(2, 0)
    # and it compares against a complete run as an identical prefix that cannot be certified whole
    record(tmp_path / "full", "--steps", STEPS_KILLED)
    c = bitguard.compare(tmp_path / "full", out)
    assert c.verdict == "inconclusive" and c.exit_status == 3
    d = c.to_dict()
    assert d["incomplete"]["b"].startswith("status failed")
    assert [r["code"] for r in d["inconclusive"]["reasons"]] == ["incomplete"]
    assert d["alignment"]["identical_prefix"] >= per_step[0] + per_step[1]


@pytest.mark.slow
def test_failing_script_leaves_a_run_marked_failed_with_its_exit_code(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 2)\nm(torch.ones(1, 2))\nraise SystemExit(3)\n")
    proc = record(tmp_path / "run", script=script, check=False, cli=True)
    assert proc.returncode == 3
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["exit_status"] == 3
    ev, _ = events(tmp_path / "run")
    assert len(ev) == 3  # params, data and forward of the Linear


@pytest.mark.slow
def test_a_script_given_by_a_relative_path_sees_its_file_as_python_gives_it(tmp_path):
    """Helper 18: under `record` a script's `__file__` was the relative path it was given, where python
    makes it absolute: a script that changes directory and then reads beside `__file__` broke."""
    (tmp_path / "here.py").write_text("import os\nos.chdir('/')\nprint(__file__)\n")
    proc = subprocess.run([*BITGUARD, "record", "--out", "run", "--", sys.executable, "here.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(tmp_path / "here.py")


@pytest.mark.slow
def test_exception_in_script_exits_1_and_keeps_events(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 2)\nm(torch.ones(1, 2))\nraise ValueError('boom')\n")
    proc = record(tmp_path / "run", script=script, check=False)
    assert proc.returncode == 1 and "ValueError: boom" in proc.stderr
    # python's own traceback: from the script's frame (helper 17: bitguard's and runpy's frames were in it)
    assert f'Traceback (most recent call last):\n  File "{script}", line 4, in <module>' in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["status"] == "failed"
    assert len(events(tmp_path / "run")[0]) == 3


@pytest.mark.slow
def test_an_error_in_a_models_forward_is_shown_without_the_recorders_frames(tmp_path):
    """A user read `collectors/hooks.py` twice in the traceback of an error in their model's forward
    and took bitguard for its cause: its module-call wrapper's frames are left out, and counted."""
    script = tmp_path / "forward_raises.py"
    script.write_text("import torch\nclass Boom(torch.nn.Module):\n    def forward(self, x):\n"
                      "        raise ValueError('boom')\ntorch.nn.Sequential(torch.nn.Linear(2, 2), Boom())(torch.ones(1, 2))\n")
    proc = record(tmp_path / "run", script=script, check=False)
    assert proc.returncode == 1 and "collectors/" not in proc.stderr, proc.stderr
    tail = proc.stderr.strip().splitlines()[-3:]
    assert tail[0].strip() == "raise ValueError('boom')" and tail[1] == "ValueError: boom", proc.stderr
    assert re.match(r"\(\d+ frames of bitguard's recorder left out", tail[2]), proc.stderr

@pytest.mark.slow
@pytest.mark.parametrize("case", ["non-empty", "unwritable", "missing-script", "unknown-mode", "bad-steps",
                                  "no-command", "launcher"])
def test_bad_input_gets_one_line_and_exit_2(tmp_path, case):
    out = tmp_path / "run"
    script = TINYGPT
    opts = []
    cmd_tail = [sys.executable, script]
    if case == "non-empty":
        out.mkdir()
        (out / "keep.txt").write_text("precious")
    elif case == "unwritable":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "run"
    elif case == "missing-script":
        cmd_tail = [sys.executable, tmp_path / "nope.py"]
    elif case == "unknown-mode":
        opts = ["--mode", "paranoid"]
    elif case == "bad-steps":
        opts = ["--steps", "5"]
    elif case == "no-command":
        cmd_tail = []
    elif case == "launcher":
        cmd_tail = ["deepspeed", script]
    proc = run([*BITGUARD, "record", "--out", out, *opts, "--", *cmd_tail])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bitguard record: error: "), proc.stderr
    if case == "non-empty":
        assert (out / "keep.txt").read_text() == "precious"  # nothing already there is lost
        assert "--force" in lines[0]


@pytest.mark.slow
def test_force_replaces_an_earlier_recording(tmp_path):
    record(tmp_path / "run", "--steps", "1")
    record(tmp_path / "run", "--steps", "2", options=["--force"], cli=True)
    rows = [dict(zip(EVENTS.names, e)) for e in events(tmp_path / "run")[0]]
    assert {r["step"] for r in rows if r["kind"] != "final"} == {0, 1}  # the second recording's two steps
    assert [r["step"] for r in rows if r["kind"] == "final"] == [2]  # and its model's final state


def test_collector_failure_never_crashes_training(tmp_path, monkeypatch):
    import torch

    from bitguard.collectors import hooks

    calls = {"n": 0}
    real = hooks.digest_async

    def flaky(t):
        calls["n"] += 1
        if calls["n"] % 7 == 0:
            raise RuntimeError("simulated digest failure")
        return real(t)

    monkeypatch.setattr(hooks, "digest_async", flaky)
    monkeypatch.setattr(hooks, "in_place_on_host", lambda t: False)  # every row's digest through it
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run"):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert any("simulated digest failure" in e for e in manifest["collector_errors"])


def test_python_api_removes_every_hook_it_installed(tmp_path):
    import torch
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim

    before = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks),
              len(optim._global_optimizer_post_hooks), torch.nn.Module._call_impl)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run", mode="trusted"):
        assert torch.nn.Module._call_impl is not before[3]  # module calls are observed through it
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    after = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks),
             len(optim._global_optimizer_post_hooks), torch.nn.Module._call_impl)
    assert before == after
    assert not model.weight._backward_hooks and not model.weight._post_accumulate_grad_hooks


def test_disable_switch_turns_recording_into_a_no_op(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("BITGUARD_DISABLE", "1")
    with bitguard.record(tmp_path / "run"):
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert not (tmp_path / "run").exists()


def _torchrun(out, env_extra=()):
    """Two gloo ranks under torchrun, each recording in-process."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = [*torchrun, "-m", "bitguard", "record", "--out", out, "--", SCRIPTS / "ddp_train.py"]
    return run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **dict(env_extra)}, timeout=150)


@pytest.mark.slow
@pytest.mark.extended  # covered by the scenarios and stacks tiers
def test_torchrun_two_ranks_gloo(tmp_path):
    for name in ("a", "b"):
        proc = _torchrun(tmp_path / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("a", "b"):
        assert (tmp_path / name / "rank-0.duckdb").exists() and (tmp_path / name / "rank-1.duckdb").exists()
        assert json.loads((tmp_path / name / "manifest.json").read_text())["world_size"] == 2
    ev1, _ = events(tmp_path / "a", rank=1)
    assert {dict(zip(EVENTS.names, e))["rank"] for e in ev1} == {1}
    assert {dict(zip(EVENTS.names, e))["world_size"] for e in ev1} == {2}
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    proc = _torchrun(tmp_path / "c", {"FAULT_RANK": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").first_divergence
    assert (fd["rank"], fd["step"], fd["phase"], fd["blame"]) == (1, 1, "data", "data")


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """ddp_train.py on two gloo ranks, each rank recording in-process as under `torchrun -m bitguard record`
    (forked from the warm recorder, tests/warm.py: torchrun itself is test_torchrun_two_ranks_gloo's and the
    stacks tier's): kept (torn down with the model alive), the same with a weight edited after the last step on
    rank 1, and a replica whose weight drifts on rank 1 after step 1."""
    import warm

    tmp = tmp_path_factory.mktemp("ddp")
    for name, env in (("kept", {"KEEP_MODEL": "1"}), ("edited", {"KEEP_MODEL": "1", "EDIT_AFTER_RANK": "1"}),
                      ("drift", {"WEIGHT_FAULT_RANK": "1"})):
        warm.record_ranks(tmp / name, SCRIPTS / "ddp_train.py", env=env)
    return tmp


@pytest.mark.slow
def test_a_ddp_replica_whose_weights_drift_is_found_by_check(ddp_runs):
    """One rank's weight edited after step 1: the all-reduced gradients still agree on every rank,
    so no collective shows it; the replicas' parameters at the start of step 2 do (`check`)."""
    from bitguard.backend.check import run_checks

    clean = run_checks(open_run(ddp_runs / "kept"))
    replicas = next(c for c in clean.checks if c.name == "replicas")
    assert clean.verdict == "clean" and replicas.compared == 3 and replicas.findings == 0, clean
    drift = run_checks(open_run(ddp_runs / "drift"))
    found = [f for f in drift.findings if f.check == "replicas"]
    # two ranks, no majority: rank 1's weights are not what its own step left them, rank 0's are
    assert drift.verdict == "findings" and [(f.rank, f.step, f.kind) for f in found] == [(1, 2, "params")], found
    assert [t.path for t in found[0].tensors] == [".module.0.weight"] and "changed on this rank alone" in \
        found[0].detail


@pytest.mark.slow
def test_a_ddp_model_local_to_main_has_its_final_state_before_the_group_goes(ddp_runs):
    """A DDP model is not held past the script's own lifetime (its reducer would outlive the
    process group), and one local to main() is gone when the recording ends: a weight edited after
    the last step on one rank compared identical. Its final state is now taken in the script's
    destroy_process_group(), before the group goes."""
    result = bitguard.compare(ddp_runs / "kept", ddp_runs / "edited")
    fd = result.first_divergence
    assert result.verdict == "diverged" and (fd["rank"], fd["kind"], fd["step"]) == (1, "final", 3), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == [".module.2.bias"], fd["tensors"]


@pytest.mark.slow
def test_sigterm_flushes_and_marks_the_run_interrupted(tmp_path):
    out = tmp_path / "run"
    cmd = [*BITGUARD, "record", "--out", out, "--", sys.executable, TINYGPT, "--steps", "50", "--progress",
           "--sleep", "0.3"]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step 1 "):
            break
    proc.send_signal(signal.SIGTERM)  # the launcher forwards it to the training process
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["exit_status"] == 128 + signal.SIGTERM
    con = duckdb.connect(str(out / "rank-0.duckdb"), read_only=True)
    meta = dict(con.sql("SELECT key, value FROM meta").fetchall())
    steps = {r[0] for r in con.sql("SELECT DISTINCT step FROM events").fetchall()}
    con.close()
    assert json.loads(meta["status"]) == "interrupted" and {0, 1} <= steps


def test_a_sigterm_while_the_recording_is_finished_waits_for_its_end(tmp_path):
    """Helper 63: torchrun sends SIGTERM to the ranks still running when one fails; a rank that was finishing its
    recording was interrupted inside DuckDB's writes (raw "Query interrupted", "Current transaction is aborted"
    collector errors) and its manifest was left "running". The SIGTERM now waits for the end of the finish, and
    then ends the process as it would have (exit 143)."""
    out = tmp_path / "run"
    code = textwrap.dedent(f"""
        import os, signal, time, torch, bitguard
        rec = bitguard.record({str(out)!r}, determinism=False)
        with rec:
            torch.nn.Linear(2, 1)(torch.randn(3, 2)).sum().backward()
            close = rec.store.close
            def closing(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.3)  # (the handler runs here, inside the finish)
                return close(*args, **kwargs)
            rec.store.close = closing
        print("not reached")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM and "not reached" not in done.stdout, done.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["collector_errors"] == [], manifest
    assert bitguard.compare(out, out).verdict == "identical"


@pytest.mark.slow
def test_a_killed_launcher_leaves_the_command_as_typed(tmp_path):
    """The launcher writes the command as typed into the manifest when the run ends; killed
    before that (SIGKILL: nothing forwarded), the run it started goes on and its manifest must
    still name the interpreter (`python train.py`), as a drill's replay runs it, not `train.py`."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import time, torch
        m = torch.nn.Linear(2, 2)
        for _ in range(3):
            m(torch.ones(1, 2))
            print("step", flush=True)
            time.sleep(0.3)
    """))
    out = tmp_path / "run"
    command = [sys.executable, str(script)]
    proc = subprocess.Popen([*BITGUARD, "record", "--out", str(out), "--", *command], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "step"
    proc.kill()  # the launcher only: the training goes on
    proc.wait(timeout=60)
    rest = proc.stdout.read()  # until the training's end closes its end of the pipe
    assert rest.split() == ["step", "step"]
    for _ in range(100):  # (the pipe closes as the process exits, after the manifest is written)
        manifest = json.loads((out / "manifest.json").read_text())
        if manifest.get("status") != "running":
            break
        time.sleep(0.1)
    assert manifest["command"] == command and manifest["status"] == "complete"


@pytest.mark.slow
def test_a_script_without_the_py_suffix_is_recorded_under_python(tmp_path):
    """Helper 61: `bitguard record -- python $(which yolo) train ...` (a console script: no .py) was refused
    by the process the launcher started, as if the script were a launcher, and left a manifest behind; a
    launcher that is no python is still refused."""
    script = tmp_path / "trainscript"
    script.write_text("import torch\nm = torch.nn.Linear(2, 1)\nm(torch.ones(1, 2)).sum().backward()\nprint('done')\n")
    out = tmp_path / "run"
    proc = subprocess.run([*BITGUARD, "record", "--out", str(out), "--", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["done"], proc.stderr[-2000:]
    assert (out / "rank-0.duckdb").is_file()
    proc = subprocess.run([*BITGUARD, "record", "--out", str(tmp_path / "other"), "--", str(script)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "not supported yet: launching 'trainscript'" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_step_window_and_trusted_mode(tmp_path):
    record_together(dict(out=tmp_path / "window", script_args=("--steps", "3"), options=["--steps", "1:2"]),
                    dict(out=tmp_path / "trusted", script_args=("--steps", "1"), options=["--mode", "trusted"]))
    rows = [dict(zip(EVENTS.names, e)) for e in events(tmp_path / "window")[0]]
    assert {r["step"] for r in rows} == {1}
    assert {r["phase"] for r in rows} == {"data", "forward", "backward", "optimizer"}
    rows = [dict(zip(EVENTS.names, e)) for e in events(tmp_path / "trusted")[0]]
    module_types = {r["module_type"] for r in rows if r["kind"] == "module"}
    assert module_types == {"Embedding", "LayerNorm", "Linear", "CausalSelfAttention"}, module_types
    assert {r["kind"] for r in rows} == {"params", "batch", "module", "grad", "step", "final"}


@pytest.mark.slow
def test_digest_reuse_never_hides_an_in_place_write(tmp_path):
    record_together(*(dict(out=tmp_path / f"{kind}-{mode}", script=SCRIPTS / "inplace.py",
                           options=["--mode", mode, *extra])
                      for mode in ("full", "trusted") for kind, extra in (("cached", []), ("every", ["--no-digest-cache"]))))
    for mode in ("full", "trusted"):
        cached, every = digests_by_event(tmp_path / f"cached-{mode}"), digests_by_event(tmp_path / f"every-{mode}")
        assert cached == every, mode
    # and the write is seen: act's input is a's output object, but not a's output bytes
    _, tensors = events(tmp_path / "every-full")
    rows = [dict(zip(TENSORS.names, t)) for t in tensors]
    ev = [dict(zip(EVENTS.names, e)) for e in events(tmp_path / "every-full")[0]]
    seq = {(r["boundary"], r["phase"], r["step"]): r["seq"] for r in ev}
    a_out = next(t for t in rows if t["seq"] == seq[("a", "forward", 0)] and t["role"] == "output")
    b_in = next(t for t in rows if t["seq"] == seq[("act", "forward", 0)] and t["role"] == "input")
    assert a_out["tid"] == b_in["tid"] and a_out["xor"] != b_in["xor"]


def test_digest_reuse_never_serves_a_tensor_given_new_memory(tmp_path):
    """`t.data = other` gives a module's output new bytes without bumping its version counter: the
    next module's input row (the same tensor object) is digested afresh, not served the cached
    digest of the old memory."""
    from bitguard.cuda.fingerprint import digest

    class Swap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            h.data = torch.arange(8.0).view(2, 4) + 0.5  # new memory, same version
            return self.b(h)

    model = Swap()
    with bitguard.record(tmp_path / "run", determinism=False), torch.no_grad():
        model(torch.randn(2, 4))
    ev, tensors = events(tmp_path / "run")
    seq = {e[EVENTS.names.index("boundary")]: e[0] for e in ev if e[EVENTS.names.index("phase")] == "forward"}
    rows = {(t[0], t[1]): dict(zip(TENSORS.names, t)) for t in tensors}
    a_out, b_in = rows[(seq["a"], "output")], rows[(seq["b"], "input")]
    assert a_out["tid"] == b_in["tid"]
    want = digest(torch.arange(8.0).view(2, 4) + 0.5)
    assert (b_in["xor"], b_in["pos"]) == want, (hex(b_in["xor"]), hex(want[0]))


def _bn_training(out, mode, momentum_from_step_2=None):
    """Four SGD steps of Linear, BatchNorm1d, Linear (every run the same numbers), recorded
    in-process; from step 2 on, the batch norm's momentum changed when asked: only its running
    statistics differ (the loss of a training-mode batch norm never reads them)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(4, 8, 4)
    with bitguard.record(out, mode=mode, determinism=False):
        for step in range(4):
            if step == 2 and momentum_from_step_2 is not None:
                model[1].momentum = momentum_from_step_2
            opt.zero_grad()
            model(data[step]).pow(2).mean().backward()
            opt.step()


@pytest.mark.parametrize("mode", ["full", "trusted"])
def test_running_statistics_are_digested_at_every_call(tmp_path, mode):
    """Batch norm updates its running statistics in place without bumping their version counter:
    a digest cached by version would give every step the first step's (a false "identical", found
    on a public training script). A module's buffers are digested at every call, so a momentum
    changed at step 2 is a divergence at step 2, in the batch norm's forward."""
    _bn_training(tmp_path / "a", mode)
    _bn_training(tmp_path / "b", mode)
    _bn_training(tmp_path / "c", mode, momentum_from_step_2=0.5)
    ev, tensors = events(tmp_path / "a")
    bn_forwards = {e[0]: e[EVENTS.names.index("step")] for e in ev
                   if e[EVENTS.names.index("module_type")] == "BatchNorm1d" and e[EVENTS.names.index("phase")] == "forward"}
    running_mean = {bn_forwards[t[0]]: t[TENSORS.names.index("xor")] for t in tensors
                    if t[0] in bn_forwards and t[3] == ".running_mean"}
    assert sorted(running_mean) == [0, 1, 2, 3] and len(set(running_mean.values())) == 4  # it changes every step
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    c = bitguard.compare(tmp_path / "a", tmp_path / "c")
    fd = c.first_divergence
    assert c.verdict == "diverged" and (fd["step"], fd["phase"], fd["boundary"]) == (2, "forward", "1"), fd


def _sgd_training(out, batch, steps: int, width: int) -> None:
    """Linear, ReLU, Linear trained by SGD on `batch(step)`, recorded in-process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(out, determinism=False):
        for step in range(steps):
            opt.zero_grad()
            model(batch(step)).pow(2).mean().backward()
            opt.step()


def test_a_batch_refilled_through_numpy_is_digested_at_every_step(tmp_path):
    """A training that refills one NumPy buffer each step and feeds the same `torch.from_numpy`
    tensor writes it without bumping the version counter: a digest cached from step 0 would
    make a changed batch look equal, and the first difference be blamed on the first Linear
    as a computing fault. No cached digest serves across top-level module calls."""
    import numpy as np

    batches = np.random.default_rng(0).standard_normal((4, 8, 4)).astype(np.float32)

    def refilled(poke):
        buf = np.empty((8, 4), np.float32)
        x = torch.from_numpy(buf)  # one tensor for the whole run

        def batch(step):
            buf[:] = batches[step]
            if poke and step == 2:
                buf[0, 0] += 1.0
            return x
        return batch

    _sgd_training(tmp_path / "a", refilled(False), steps=4, width=4)
    _sgd_training(tmp_path / "b", refilled(True), steps=4, width=4)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["blame"]) == (2, "data", "data"), fd


@pytest.mark.slow
def test_each_backward_pass_keeps_its_own_call_stack(tmp_path):
    script = tmp_path / "two_passes.py"
    script.write_text(textwrap.dedent("""
        import torch, bitguard
        m = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with bitguard.record(OUT, determinism=False):
            for _ in range(2):
                m(torch.ones(2, 4)).sum().backward()          # line 7
                (m(torch.ones(2, 4)) * 2).sum().backward()    # line 8
                opt.step()                                    # line 9
    """))
    out = tmp_path / "run"
    exec(compile(script.read_text(), str(script), "exec"), {"__name__": "__main__", "OUT": out})  # (its lines)
    events, _, stacks = load_rank(open_run(out), 0)
    lines = {}
    for e in events.iter_rows(named=True):
        if e["phase"] in ("backward", "optimizer") and e["kind"] != "params":
            frame = [f for f in stacks[e["stack_id"]] if "two_passes.py" in f][-1]  # (pytest's frames beyond it)
            lines.setdefault((e["step"], e["phase"], e["call"]), set()).add(frame.split(":")[-1].split(" ")[0])
    for step in (0, 1):
        assert lines[(step, "backward", 0)] == {"7"} and lines[(step, "backward", 1)] == {"8"}
        assert lines[(step, "optimizer", 0)] == {"9"}


class _Leaf(torch.nn.Linear):
    pass


class _Tree(torch.nn.Module):
    """Nested calls of the same class, a helper function between a module and its child, and a
    decorated forward: the shapes that could fool a walk that stops at the parent's forward."""

    def __init__(self, depth: int):
        super().__init__()
        self.leaf = _Leaf(4, 4)
        self.sub = _Tree(depth - 1) if depth else None

    def forward(self, x):
        x = _through_helper(self.leaf, x)
        return self.sub(x) if self.sub is not None else _Decorated()(x)


class _Decorated(torch.nn.Module):
    @torch.no_grad()
    def forward(self, x):
        return x * 2


def _through_helper(module, x):
    return module(x)


def test_forward_stacks_built_from_the_parent_call_equal_a_full_walk(tmp_path, monkeypatch):
    from bitguard.collectors import hooks

    original, checked = hooks.Collector._call_key, []

    def compare(self, f, frames, level):
        key = original(self, f, frames, level)
        checked.append((key, self._stacks.key_until(f)[0]))
        return key

    monkeypatch.setattr(hooks.Collector, "_call_key", compare)
    with bitguard.record(tmp_path / "run", determinism=False):
        _Tree(3)(torch.ones(2, 4))
    assert len(checked) == 13 and all(a == b for a, b in checked)
    assert max(len(a) for a, _ in checked) > len(checked[-1][0])  # the inner calls did nest


def test_rng_rows_mark_exactly_the_calls_that_drew_random_numbers(tmp_path):
    torch.manual_seed(0)
    noisy = torch.nn.Linear(4, 4)  # a Linear never draws, but a user's hook inside its call does
    noisy.register_forward_pre_hook(lambda m, args: (args[0] + torch.randn_like(args[0]),))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), noisy, torch.nn.Dropout(0.5), torch.nn.LayerNorm(4))
    with bitguard.record(tmp_path / "run", determinism=False):
        model(torch.ones(2, 4))
    events, tensors, _ = load_rank(open_run(tmp_path / "run"), 0)
    with_rng = set(tensors.filter(tensors["role"] == "rng")["seq"].to_list())
    drew = {e["boundary"] for e in events.iter_rows(named=True) if e["phase"] == "forward" and e["seq"] in with_rng}
    assert drew == {"1", "2", "Sequential"}


def test_a_finished_recording_leaves_the_parameters_hooks_as_it_found_them(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    seen = []
    model[1].weight.register_hook(lambda g: seen.append("user"))  # the user's own hook stays
    with bitguard.record(tmp_path / "run", determinism=False):
        model(torch.ones(2, 4)).sum().backward()
    assert model[0].weight._backward_hooks is None and model[0].weight._post_accumulate_grad_hooks is None
    assert len(model[1].weight._backward_hooks) == 1
    seen.clear()
    model(torch.ones(2, 4)).sum().backward()
    assert seen == ["user"]


def test_gradient_events_tell_the_incoming_gradient_from_the_accumulated_one(tmp_path):
    """Two micro-batches a step: the first gradient fills an empty .grad (both rows are it), the
    second is added to it (grad_input is what autograd delivered, grad what .grad became)."""
    from bitguard.cuda.fingerprint import digest

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []  # (incoming, .grad after) for the weight, in order
    model.weight.register_hook(lambda g: seen.append([digest(g)]))
    model.weight.register_post_accumulate_grad_hook(lambda p: seen[-1].append(digest(p.grad)))
    with bitguard.record(tmp_path / "run", determinism=False):
        for _ in range(2):
            for _ in range(2):
                model(torch.randn(3, 4)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    ev, tensors = events(tmp_path / "run")
    names, t_names = EVENTS.names, TENSORS.names
    grad_seqs = [e[names.index("seq")] for e in ev
                 if e[names.index("kind")] == "grad" and e[names.index("boundary")] == "weight"]
    rows = {}
    for t in tensors:
        r = dict(zip(t_names, t))
        if r["seq"] in grad_seqs:
            rows.setdefault(r["seq"], {})[r["role"]] = (r["xor"], r["pos"])
    got = [(rows[s]["grad_input"], rows[s]["grad"]) for s in grad_seqs]
    assert got == [tuple(x) for x in seen] and len(got) == 4
    assert got[0][0] == got[0][1] and got[1][0] != got[1][1]  # filled, then accumulated


def _train_optimizer_in_backward(run_dir, lr_at_2: float = 0.1) -> list[float]:
    """PyTorch's optimizer-in-backward recipe: an optimizer a parameter, stepped from its gradient hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    x, y, losses = torch.randn(32, 8), torch.randn(32, 4), []
    with bitguard.record(run_dir, determinism=False) if run_dir else contextlib.nullcontext():
        for it in range(4):
            for o in opts.values():
                o.param_groups[0]["lr"] = lr_at_2 if it == 2 else 0.1
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
    return losses


def test_optimizers_stepped_inside_backward_end_one_step_per_pass(tmp_path):
    """Each parameter's optimizer stepped from its gradient hook ended a step of its own: four iterations
    of a four-tensor model were recorded as steps 0 to 15, and an lr changed at iteration 2 was placed
    at step 8 (helper 66). The step ends once, with the backward pass."""
    assert _train_optimizer_in_backward(tmp_path / "a") == _train_optimizer_in_backward(None)
    _train_optimizer_in_backward(tmp_path / "b", lr_at_2=0.2)
    ev, _ = events(tmp_path / "a")
    names = EVENTS.names
    steps = [e[names.index("step")] for e in ev]
    assert sorted(set(steps)) == [0, 1, 2, 3, 4]  # (4: the final state)
    for s in range(4):
        assert sum(1 for e in ev if e[names.index("step")] == s and e[names.index("kind")] == "step") == 4
        assert sum(1 for e in ev if e[names.index("step")] == s and e[names.index("kind")] == "module"
                   and e[names.index("phase")] == "forward" and e[names.index("depth")] == 0) == 1
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["boundary"], fd["blame"]) == (2, "2.bias", "source"), fd  # (the last layer steps first)


class _Flaky(torch.nn.Module):
    """Raises from its forward when told to: the script catches it and goes on."""

    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise ValueError("bad batch")
        return x * 2


def test_a_module_call_that_raises_is_unwound_without_a_collector_error(tmp_path):
    inner = _Flaky()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(inner), torch.nn.Linear(2, 1))
    with bitguard.record(tmp_path / "run", determinism=False) as rec:
        inner.fail = True
        with pytest.raises(ValueError, match="bad batch"):
            model(torch.ones(1, 2))
        inner.fail = False
        model(torch.ones(1, 2))
        errors = list(rec.collector.errors)
    assert errors == []
    rows = [dict(zip(EVENTS.names, e)) for e in events(tmp_path / "run")[0] if e]
    forward = [(r["boundary"], r["depth"]) for r in rows if r["phase"] == "forward"]
    # the failed call's only finished module is "0"; it left no open frame: the second call nests rightly
    assert forward == [("0", 1), ("0", 1), ("1.0", 2), ("1", 1), ("2", 1), ("Sequential", 0)], forward


def test_a_module_output_is_recorded_as_its_caller_receives_it(tmp_path):
    # A forward hook of the module's own may replace its output: the event holds what crossed the
    # boundary to the caller, the same tensor (tid and bytes) the next module takes as input.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].register_forward_hook(lambda module, args, out: out * 3)
    with bitguard.record(tmp_path / "run", determinism=False):
        model(torch.ones(1, 2))
    ev, tensors = events(tmp_path / "run")
    seq = {r["boundary"]: r["seq"] for r in (dict(zip(EVENTS.names, e)) for e in ev) if r["phase"] == "forward"}
    rows = [dict(zip(TENSORS.names, t)) for t in tensors]
    out = next(t for t in rows if t["seq"] == seq["0"] and t["role"] == "output")
    nxt = next(t for t in rows if t["seq"] == seq["1"] and t["role"] == "input")
    assert (out["tid"], out["xor"], out["pos"]) == (nxt["tid"], nxt["xor"], nxt["pos"])


def test_trusted_mode_blames_the_root_code_between_observed_modules(tmp_path):
    """In trusted mode a root of another type than the heavy modules has no module event; its
    inputs are the step's data event. A dropout changed between two Linears (the dropout and the
    root unobserved, as in pytorch/examples' mnist) is blamed on the root's own code after the
    first Linear, not "upstream of every observed boundary"."""

    class Net(torch.nn.Module):
        def __init__(self, p):
            super().__init__()
            self.fc1, self.drop, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Dropout(p), torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.fc2(self.drop(torch.relu(self.fc1(x))))

    def train(out, p):
        torch.manual_seed(0)
        model = Net(p)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(out, mode="trusted", determinism=False):
            for _ in range(2):
                opt.zero_grad()
                model(torch.ones(8, 4)).pow(2).mean().backward()
                opt.step()

    train(tmp_path / "a", 0.5)
    train(tmp_path / "b", 0.4)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["boundary"], fd["blame"]) == (0, "fc2", "consumer"), fd
    window = fd["blame_window"]
    assert (window["module"], window["after"], window["before"]) == ("Net", "fc1", "fc2"), window
    assert window["excluding_children"] == ["fc1", "fc2"]


def test_a_hand_written_update_is_named_beside_a_source_blame(tmp_path):
    """A training without torch.optim (pytorch/examples' word_language_model updates `p.data` by
    hand) has no optimizer events: a changed update shows first in the next forward of a module
    whose inputs match, blamed as a source. The pivot says that its parameters had gradients no
    optimizer step recorded, so that the update is named beside the kernel."""

    def train(out, lr_at_2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        with bitguard.record(out, determinism=False):
            for i in range(4):
                model.zero_grad()
                model(torch.ones(2, 4)).pow(2).mean().backward()
                lr = lr_at_2 if i == 2 else 0.1
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-lr)

    train(tmp_path / "a", 0.1)
    train(tmp_path / "b", 0.2)
    # since schema version 6, the model's parameters are recorded at each call after a backward
    # when no optimizer step was: the update shows there, before the module that reads them
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["kind"], fd["boundary"], fd["fault_class"], fd["call"]) == ("params", "Sequential", "params", 3), fd
    assert "no optimizer step was recorded" in fd["blame_window"]["detail"]
    for run_dir in (tmp_path / "a", tmp_path / "b"):  # as recorded before: the note names the update
        as_schema_5(run_dir)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["phase"], fd["boundary"], fd["blame"], fd["call"]) == ("forward", "0", "source", 3), fd
    assert any("no optimizer step recorded them" in n and "0.weight" in n for n in fd["notes"]), fd["notes"]


def test_a_loss_module_between_forward_and_backward_keeps_the_model_backward_events(tmp_path):
    """`loss = criterion(model(x), y)` calls a module at top level between the model's forward
    and its backward: that call once ended every call still waiting for its backward, and a
    training with a loss module (most of them: pytorch/examples' dcgan, time_sequence_prediction)
    recorded no module backward event but the loss's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    criterion = torch.nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run", determinism=False):
        for _ in range(2):
            opt.zero_grad()
            criterion(model(torch.ones(5, 3)), torch.zeros(5, 1)).backward()
            opt.step()
    ev, _ = events(tmp_path / "run")
    backward = [(e[EVENTS.names.index("boundary")], e[EVENTS.names.index("step")]) for e in ev
                if e[EVENTS.names.index("phase")] == "backward" and e[EVENTS.names.index("kind")] == "module"]
    assert sorted(backward) == sorted((b, s) for b in ("Sequential", "0", "1", "2", "MSELoss") for s in (0, 1))


def test_a_child_called_in_a_loop_is_named_once_in_the_blame_window(tmp_path):
    """time_sequence_prediction calls its LSTM cells once per time step: the window listed every
    call ("minus children linear, linear, ..." 39 times)."""

    class Loop(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.cell, self.scale = torch.nn.Linear(4, 4), scale

        def forward(self, x):
            for i in range(5):
                x = self.cell(x) * (self.scale if i == 3 else 1.0)  # a functional op between the calls
            return x

    def train(out, scale):
        torch.manual_seed(0)
        model = Loop(scale)
        with bitguard.record(out, determinism=False):
            model(torch.ones(2, 4)).sum().backward()

    train(tmp_path / "a", 1.0)
    train(tmp_path / "b", 1.5)
    window = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence["blame_window"]
    assert window["module"] == "Loop" and window["excluding_children"] == ["cell"], window


@pytest.mark.parametrize("standalone", [False, True])
def test_parameters_that_join_later_are_named_stably(tmp_path, standalone):
    """A layer frozen at the first call and unfrozen at step 2 (progressive unfreezing), or a
    parameter outside every module: its optimizer events were named by its id, so two identical
    runs compared diverged. Named as the model names it (else by its place in the optimizer), its
    gradients watched from then on, identical runs are identical and a changed learning rate of
    the new group diverges at its first step."""

    def train(out, lr):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        model[0].requires_grad_(False)
        scale = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
        with bitguard.record(out, determinism=False):
            for step in range(4):
                if step == 2:
                    model[0].requires_grad_(True)
                    opt.add_param_group({"params": [scale] if standalone else list(model[0].parameters()), "lr": lr})
                opt.zero_grad()
                (model(torch.ones(2, 4)) * scale).pow(2).mean().backward()
                opt.step()

    for name, lr in (("a", 0.1), ("b", 0.1), ("c", 0.3)):
        train(tmp_path / name, lr)
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    ev, _ = events(tmp_path / "a")
    named = {e[EVENTS.names.index("boundary")] for e in ev if e[EVENTS.names.index("kind")] == "step"}
    assert named == ({"2.weight", "2.bias", "SGD.param_groups[1][0]"} if standalone
                     else {"0.weight", "0.bias", "2.weight", "2.bias"}), named
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").first_divergence
    assert (fd["step"], fd["phase"]) == (2, "optimizer"), fd


def test_parameters_only_optimizers_know_are_named_apart_by_optimizer(tmp_path):
    """Two optimizers of one class, each stepping a parameter no model holds (pytorch/examples'
    forward-forward trains each layer with its own Adam): both were `Adam.param_groups[0][0]`,
    two parameters under one name."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opts = [torch.optim.Adam([a], lr=0.1), torch.optim.Adam([b], lr=0.1)]
    with bitguard.record(tmp_path / "run", determinism=False):
        for _ in range(2):
            for p, opt in zip((a, b), opts):
                opt.zero_grad()
                p.pow(2).sum().backward()
                opt.step()
    ev, _ = events(tmp_path / "run")
    named = {(e[EVENTS.names.index("boundary")]) for e in ev if e[EVENTS.names.index("kind")] == "step"}
    assert named == {"Adam.param_groups[0][0]", "Adam#1.param_groups[0][0]"}, named


def test_a_changed_batch_propagates_to_what_reads_it(tmp_path):
    """A data pivot's propagation reached nothing ("reaches 1 node", no edges) although every
    later event differs: the batch is the data event's input, not an output, so no dataflow edge
    left it. It now reaches the modules that read the batch, and through them the step."""

    bump = torch.zeros(5, 3)
    bump[0, 0] = 1.0
    _sgd_training(tmp_path / "a", lambda step: torch.ones(5, 3), steps=3, width=3)
    _sgd_training(tmp_path / "b", lambda step: torch.ones(5, 3) + bump * (step == 1), steps=3, width=3)
    c = bitguard.compare(tmp_path / "a", tmp_path / "b")
    assert (c.first_divergence["phase"], c.first_divergence["step"]) == ("data", 1)
    ids = {n["id"] for n in c.propagation_graph()["nodes"]}
    assert {"r0:forward:module:0", "r0:forward:module:2", "r0:optimizer:step:0.weight"} <= ids, ids


def test_a_backward_fault_is_blamed_on_the_module_whose_backward_made_it(tmp_path):
    """A module whose backward alone computes differently (its forward is a copy): its gradient
    flows into the Linear before it, whose backward event came first (it watched the shared
    tensor first), so the pivot was that Linear, "consumer" with no window. The call that made a
    gradient now has its backward event before the call it flows into."""

    class Act(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, x):
            return ScaledBackward.apply(x, self.scale)

    def train(out, scale):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), Act(scale), torch.nn.Linear(3, 1))
        with bitguard.record(out, determinism=False):
            model(torch.ones(5, 3)).pow(2).mean().backward()

    train(tmp_path / "a", 1.0)
    train(tmp_path / "b", 1.001)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["phase"], fd["boundary"], fd["blame"], fd["fault_class"]) == ("backward", "1", "source", "backward"), fd


def test_a_part_called_alone_while_its_model_is_built_is_named_as_a_part(tmp_path):
    """A part called alone while its model was built (to size a layer, a common idiom) became a
    root of its own, and kept that root's names (`2`, not `features.2`) for the whole run. Once
    its model is called, it is named as the model's part."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.features = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
            width = self.features(torch.zeros(1, 4)).shape[1]  # sizes the head
            self.head = torch.nn.Linear(width, 1)

        def forward(self, x):
            return self.head(self.features(x))

    _two_steps(tmp_path / "run", Net, lambda model: model(torch.ones(3, 4)).mean())
    ev, _ = events(tmp_path / "run")
    steps = {e[EVENTS.names.index("boundary")] for e in ev if e[EVENTS.names.index("kind")] == "step"}
    assert steps == {"features.0.weight", "features.0.bias", "features.2.weight", "features.2.bias", "head.weight",
                     "head.bias"}, steps
    forwards = {e[EVENTS.names.index("boundary")] for e in ev if e[EVENTS.names.index("phase")] == "forward"
                and e[EVENTS.names.index("step")] >= 1}
    assert forwards == {"Net", "features", "features.0", "features.1", "features.2", "head"}, forwards
    finals = [e[EVENTS.names.index("boundary")] for e in ev if e[EVENTS.names.index("kind")] == "final"]
    assert finals == ["Net"], finals  # one model, one final state


def test_models_called_from_their_owner_s_method_are_named_by_their_place_in_it(tmp_path):
    """helper 13 (Lightning): a LightningModule's training_step calls `self.G` and `self.D`, never
    the LightningModule itself. Each was a root named by its class, so a GAN's two Sequentials'
    parts were both `0`, `1`, ... until an optimizer step's look found the owner and renamed them."""

    class GAN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.G = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh())
            self.D = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Sigmoid())

        def training_step(self, z):
            return self.D(self.G(z)).mean()

    _two_steps(tmp_path / "run", GAN, lambda gan: gan.training_step(torch.randn(3, 2)))
    ev, _ = events(tmp_path / "run")
    at = {name: EVENTS.names.index(name) for name in ("boundary", "phase", "step", "kind")}
    forwards = {e[at["boundary"]] for e in ev if e[at["phase"]] == "forward" and e[at["step"]] == 0}
    assert forwards == {"G", "G.0", "G.1", "D", "D.0", "D.1"}, forwards
    assert [e[at["boundary"]] for e in ev if e[at["kind"]] == "final"] == ["GAN"]


def _two_steps(path, build, loss) -> None:
    """Two SGD steps, recorded, of the model `build()` makes inside the recording, on `loss(model)`."""
    torch.manual_seed(0)
    with bitguard.record(path, determinism=False):
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            loss(model).backward()
            opt.step()
