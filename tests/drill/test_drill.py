"""`bitguard drill` on recorded runs: from the boundary pivot to the operation and its source line.

Each case is a reference/suspect pair of real recordings; the drill replays both for the pivot's
step, traces the window at op level and must name the operation the fault is in:
- `functional` (a scenario): the fault is in the functional residual add between blocks.0.attn
  and blocks.0.ln_2 (a consumer pivot, window blocks.0);
- `hf-llama-rope` (a scenario): transformers' Llama, apply_rotary_pos_emb rotating with
  bf16-rounded cos/sin inside LlamaAttention.forward (a consumer pivot, window the attention);
- `sdpa`: F.scaled_dot_product_attention against explicit matmul/softmax attention (an event one
  run alone has; the drill names the attention call);
- `rms-eps`: a changed constant inside RMSNorm, a source pivot in a module of several ops (the
  drill names the add of eps, its tensor inputs equal, its other argument not).
And, on a tiny script (scripts/untraced_write.py): writes no op trace sees, the recorded
environment, relative paths, a timeout, an edited script (a replay that does not reproduce).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bitguard
import recorded
import warm
from bitguard.backend.drill import drill
from bitguard.sample_traces import evaluation
from bitguard.sample_traces.recordings import HERE, Job
from bitguard.sample_traces.scenarios import SCENARIOS, TINY

pytestmark = pytest.mark.slow

TINYGPT = HERE / "tinygpt.py"


def _line(path: Path, text: str) -> int:
    """The line number of the first line of `path` that holds `text`."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _pairs(root: Path, shared: Path) -> dict[str, tuple[Job, Job]]:
    """{case: (reference, suspect)}. The two scenarios' pairs are the scenarios tier's own plain
    recordings (in `shared`, recorded.scenario_runs: once a session, whichever worker comes first),
    and so is the plain tinygpt reference of the sdpa case (the functional scenario's)."""
    scenarios = [SCENARIOS[name] for name in ("functional", "hf-llama-rope")]
    pairs = {p.scenario.name: (p.reference, p.suspect) for p in evaluation.pairs(scenarios, "plain", shared, reruns=False)}
    reference = pairs["functional"][0]
    assert reference.args == TINY and reference.script == "tinygpt.py", reference
    pairs["sdpa"] = (reference, Job("tinygpt.py", (*TINY, "--attention", "sdpa"), str(root / "sdpa" / "suspect")))
    rms = (*TINY, "--norm", "rms")
    pairs["rms-eps"] = (Job("tinygpt.py", rms, str(root / "rms" / "reference")),
                        Job("tinygpt.py", (*rms, "--fault", "rms-eps", "--fault-step", "1"),
                            str(root / "rms" / "suspect")))
    return pairs


@pytest.fixture(scope="module")
def drilled(tmp_path_factory):
    root = tmp_path_factory.mktemp("drill")
    pairs = _pairs(root / "recorded", recorded.scenario_runs(tmp_path_factory))
    recorded.record_jobs([j for pair in pairs.values() for j in pair], workers=2)
    # each drill on copies of its pair: a drill replays into folders beside the runs, and the shared
    # reference is three cases' (and tests/scenarios' and test_drill_backward's)
    copies = {name: tuple(recorded.copy_run(job.out, root / name / side) for job, side in zip(pair, ("a", "b")))
              for name, pair in pairs.items()}
    # one through the notebook's path, Comparison.drill()
    return {name: (bitguard.compare(a, b).drill() if name == "rms-eps" else drill(a, b)).to_dict()
            for name, (a, b) in copies.items()}


def bitguard_drill(a, b) -> dict:
    return drill(a, b).to_dict()


def record_all(jobs: dict, script: Path, cwd=None) -> dict[str, Path]:
    """Record {out: (args, env)} of `script`, two at a time, forked from a warm recorder (tests/warm.py)."""
    warm.record_all(*(dict(out=out, script=script, args=args, env=env, cwd=cwd) for out, (args, env) in jobs.items()))
    return {Path(out).name: Path(out) for out in jobs}


def _assert_reproduced(doc: dict) -> None:
    assert doc["replay"]["reproduced"], doc["replay"]["detail"]
    assert doc["replay"]["a"]["compared"] > 0 and doc["replay"]["b"]["compared"] > 0


def test_functional_op_between_modules(drilled):
    doc = drilled["functional"]
    _assert_reproduced(doc)
    assert doc["verdict"] == "op_pivot" and doc["schema"] == "bitguard.drill/1"
    assert (doc["boundary_pivot"]["boundary"], doc["window"]["boundary"]) == ("blocks.0.ln_2", "blocks.0")
    op = doc["op_pivot"]
    assert Path(op["file"]).name == "tinygpt.py"
    # the suspect's residual_add (the fault patches it) flips a bit of the sum it returns
    assert any("in residual_add" in c for c in op["chain"]), op["chain"]
    assert f"tinygpt.py:{_line(TINYGPT, 'x = residual_add(x, self.attn(self.ln_1(x)))')} in forward" in op["chain"]
    assert (op["step"], op["rank"], op["boundary"]) == (1, 0, "blocks.0")
    sig = doc["boundary_signature"]
    assert sig is not None and sig["elements_differing"] >= 1


def test_rotary_embedding_inside_llama_attention(drilled):
    doc = drilled["hf-llama-rope"]
    _assert_reproduced(doc)
    assert doc["verdict"] == "op_pivot"
    assert doc["window"]["boundary"] == "model.layers.0.self_attn"
    op = doc["op_pivot"]
    assert op["function"] == "apply_rotary_pos_emb" or any("apply_rotary_pos_emb" in c for c in op["chain"]), op
    assert op["boundary"] == "model.layers.0.self_attn"


def test_sdpa_against_eager_attention_names_the_attention_call(drilled):
    doc = drilled["sdpa"]
    _assert_reproduced(doc)
    assert doc["verdict"] == "op_pivot"
    op = doc["op_pivot"]
    assert op["cause"] == "structure" and doc["signature"]["kind"] == "structure"
    sdpa_line = _line(TINYGPT, "F.scaled_dot_product_attention(")
    named = [op] + op["other_side"]
    assert any(o["op"].endswith("scaled_dot_product_attention") and o["line"] == sdpa_line for o in named), named
    # where the two streams join again, the values differ by reduction-order noise, not a logic change
    then = op["then"]
    assert then is not None and then["signature"]["kind"] == "few_ulp", then


def test_source_pivot_inside_a_module_of_several_ops(drilled):
    doc = drilled["rms-eps"]
    _assert_reproduced(doc)
    assert doc["verdict"] == "op_pivot"
    assert doc["boundary_pivot"]["blame"] == "source" and doc["window"]["boundary"] == "blocks.0.ln_1"
    op = doc["op_pivot"]
    assert op["cause"] == "digest" and op["line"] == _line(TINYGPT, "rsqrt(var + self.eps)")
    assert not op["inputs_differ"] and op["args_differ"], op
    assert "1e-05" in op["args_b"] and "1e-06" in op["args_a"]
    sig = doc["signature"]
    assert sig["elements_differing"] > 0 and sig["kind"] != "identical"
    # (helper 56: an eps changed read "few_ulp: reduction order, a nondeterministic kernel or a precision change")
    assert "a logic change" in sig["reading"] and "nondeterministic" not in sig["reading"], sig["reading"]


def test_nothing_to_drill_is_a_clear_error(tmp_path):
    demo = Path(__file__).resolve().parents[2] / "sample_traces" / "demo"
    got = subprocess.run([sys.executable, "-m", "bitguard", "drill", str(demo / "reference"), str(demo / "reference"),
                          "--out", str(tmp_path)], capture_output=True, text=True)
    assert got.returncode == 2 and "compare identical: there is no pivot to drill into" in got.stderr
    assert len(got.stderr.strip().splitlines()) == 1


def test_a_write_no_op_trace_sees_and_the_recorded_environment(tmp_path, monkeypatch):
    """A write through a NumPy view (as a C++ extension might): before the block's linear op, the
    drill names the op whose input it changed and says where such a difference comes from; after
    the block's last op, no op differs and the drill says so with exit 1 (never a made-up op).
    The script reads its block's scale from TOY_SCALE: recorded (BITGUARD_RECORD_ENV), the replay runs
    under the recorded value whatever the drilling shell has (not recorded: the extended tier's
    test_a_changed_environment_not_recorded_is_a_replay_that_does_not_reproduce)."""
    script = Path(__file__).parent / "scripts" / "untraced_write.py"
    kept = {"TOY_SCALE": "2", "BITGUARD_RECORD_ENV": "TOY_SCALE"}
    runs = record_all({tmp_path / "clean": ((), kept), tmp_path / "weight": (("--fault", "weight"), kept),
                       tmp_path / "output": (("--fault", "output"), kept)}, script)
    monkeypatch.setenv("TOY_SCALE", "3")  # the drilling shell's value differs from the recording's
    # no tensor kept whole: a second pass keeps the differing 1-MiB chunks, and the signature reads them
    doc = drill(runs["clean"], runs["weight"], max_tensor_bytes=0).to_dict()
    sig = doc["signature"]
    assert sig["window"] == {"chunks": [0], "chunks_total": 1, "elements": 32, "elements_total": 32}, sig
    assert sig["elements_differing"] == 4 and sig["first_indices"][0] == [0, 0] and "window_pass_s" in doc["cost"]
    assert doc["replay"]["reproduced"], doc["replay"]["detail"]
    assert any("TOY_SCALE" in n for n in doc["replay"]["b"]["notes"]), doc["replay"]["b"]["notes"]
    op = doc["op_pivot"]
    assert (doc["verdict"], op["op"], op["cause"], op["inputs_differ"]) == \
        ("op_pivot", "torch.nn.functional.linear", "digest", True)
    assert [p["index"] for p in op["inputs"] if p["differs"]] == [1] and "outside torch functions" in op["note"]
    # (helper 62: a buffer halved by hand read "bit_flip: a hardware SDC or memory fault is likely")
    assert "the difference came into it, not from its kernel or the hardware" in sig["reading"], sig["reading"]
    got = subprocess.run([sys.executable, "-m", "bitguard", "drill", str(runs["clean"]), str(runs["output"]), "--json"],
                         capture_output=True, text=True)
    assert got.returncode == 1, got.stderr
    doc = json.loads(got.stdout)
    assert doc["verdict"] == "no_difference" and doc["op_pivot"] is None and doc["replay"]["reproduced"]
    assert doc["boundary_signature"]["elements_differing"] == 1


@pytest.mark.extended  # (two replays, 9 s of CPU: not_reproduced is also the edited script's, below)
def test_a_changed_environment_not_recorded_is_a_replay_that_does_not_reproduce(tmp_path, monkeypatch):
    """TOY_SCALE not recorded (no BITGUARD_RECORD_ENV): the drilling shell's other value is a replay that
    does not reproduce its record, said of run B (exit 3)."""
    script = Path(__file__).parent / "scripts" / "untraced_write.py"
    runs = record_all({tmp_path / "clean": ((), {"TOY_SCALE": "2", "BITGUARD_RECORD_ENV": "TOY_SCALE"}),
                       tmp_path / "unrecorded": (("--fault", "output"), {"TOY_SCALE": "2"})}, script)
    monkeypatch.setenv("TOY_SCALE", "3")
    doc = bitguard_drill(runs["clean"], runs["unrecorded"])
    assert doc["verdict"] == "not_reproduced" and doc["op_pivot"] is None
    assert "run B" in doc["replay"]["detail"] and doc["replay"]["a"]["reproduced"], doc["replay"]["detail"]


@pytest.mark.extended  # (34 s of replays: paths, a timeout and an edited script, beside the drills above)
def test_relative_paths_a_timeout_and_an_edited_script(tmp_path):
    """Run paths relative to a folder that is not the one recorded in (the replays run in the
    recorded one); a replay past --timeout is stopped with every process it started, and said so;
    a script edited since the recording is a replay that does not reproduce (exit 3), named."""
    work = tmp_path / "work"
    work.mkdir()
    script = work / "train.py"
    shutil.copy(Path(__file__).parent / "scripts" / "untraced_write.py", script)
    record_all({work / "clean": ((), {}), work / "weight": (("--fault", "weight"), {})}, script, cwd=work)
    drill = [sys.executable, "-m", "bitguard", "drill", "work/clean", "work/weight"]
    got = subprocess.run([*drill, "--json"], capture_output=True, text=True, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["op_pivot"]["op"] == "torch.nn.functional.linear"
    assert not (work / "work").exists()  # nothing written into the recorded working directory's copy of the paths
    slow = {**os.environ, "TOY_SLEEP": "60"}
    got = subprocess.run([*drill, "--timeout", "6"], capture_output=True, text=True, cwd=tmp_path, env=slow)
    assert got.returncode == 2 and "ran past --timeout 6 s" in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1
    left = subprocess.run(["pgrep", "-f", str(work / "clean" / "drill")], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"replay processes left running: {left.stdout}"
    script.write_text(script.read_text().replace('os.environ.get("TOY_SCALE", "2")', 'os.environ.get("TOY_SCALE", "3")'))
    got = subprocess.run([*drill, "--json"], capture_output=True, text=True, cwd=tmp_path)
    assert got.returncode == 3, got.stderr
    doc = json.loads(got.stdout)
    assert doc["verdict"] == "not_reproduced" and doc["replay"]["reproduced"] is False and doc["op_pivot"] is None
    assert doc["replay"]["detail"].startswith("the replay does not reproduce the record: nondeterminism or a changed "
                                              "environment")
    assert "train.py changed since the recording" in doc["replay"]["detail"]
