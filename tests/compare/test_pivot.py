"""Compare on recorded runs: the pivot lands where the fault was injected, with the right blame."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bitguard
import recorded
import warm
from incli import run_cli

pytestmark = pytest.mark.slow  # records tiny GPT runs (forked from a warm recorder: tests/warm.py)

ROOT = Path(__file__).resolve().parents[2]
TINYGPT = ROOT / "sample_traces" / "tinygpt.py"
BITGUARD = [sys.executable, "-m", "bitguard"]
STEPS = ["--steps", "3"]

FAULTS = {  # fault -> (step, phase, boundary, blame, fault_class)
    "forward-bitflip": (1, "forward", "blocks.0.mlp.fc", "source", "forward"),
    "functional": (1, "forward", "blocks.0.ln_2", "consumer", "forward"),
    "backward": (1, "backward", "blocks.0.attn.proj", "source", "backward"),
    "grad-accum": (1, "backward", "lm_head.weight", "source", "accumulation"),
    "optimizer": (1, "optimizer", "lm_head.weight", "source", "optimizer"),
    "data": (1, "data", "GPT", "data", "data"),
}


def _record(out: Path, *args: str) -> None:
    warm.record(out, TINYGPT, *STEPS, *args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pivot-runs")
    # the reference and the forward bit flip are recorded.forward_bitflip's pair (the same arguments),
    # recorded once for the session's workers (tests/unit/backend and tests/api read it too): copied in
    reference, bitflip = recorded.shared(tmp_path_factory, recorded.forward_bitflip)
    shutil.copytree(reference, base / "reference")
    shutil.copytree(bitflip, base / "forward-bitflip")
    jobs = {"rerun": [], **{f: ["--fault", f, "--fault-step", "1"] for f in FAULTS if f != "forward-bitflip"}}
    warm.record_all(*(dict(out=base / name, script=TINYGPT, args=(*STEPS, *args)) for name, args in jobs.items()))
    return base


def compare_cli(*args, process: bool = False):
    """`bitguard compare ARGS`: in this process (tests/incli.py), or in its own (`process`: what a
    shell sees, stderr whole)."""
    if not process:
        return run_cli("compare", *args)
    return subprocess.run([*BITGUARD, "compare", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_identical_runs_compare_identical(runs):
    proc = compare_cli(runs / "reference", runs / "rerun", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["schema"] == "bitguard.compare/1" and report["verdict"] == "identical"
    assert report["first_divergence"] is None
    al = report["alignment"]
    assert al["events_a"] == al["events_b"] == al["matched"] == al["identical_prefix"] > 0
    assert al["gaps_a"] == al["gaps_b"] == 0


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_pivot_lands_on_the_injected_fault(runs, fault):
    proc = compare_cli(runs / "reference", runs / fault, "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    fd = report["first_divergence"]
    got = (fd["step"], fd["phase"], fd["boundary"], fd["blame"], fd["fault_class"])
    assert got == FAULTS[fault], f"{fault}: pivot {got}, expected {FAULTS[fault]}"
    for key in ("rank", "module_type", "call", "blame_window", "stack", "tensors"):
        assert key in fd
    assert any(t["differs"] for t in fd["tensors"])
    for key in ("events_a", "events_b", "matched", "gaps_a", "gaps_b", "identical_prefix", "band", "max_window"):
        assert key in report["alignment"]
    assert report["alignment"]["identical_prefix"] > 0
    assert report["propagation"]["nodes"][0]["is_pivot"]


def test_consumer_blame_names_its_window(runs):
    fd = bitguard.compare(runs / "reference", runs / "functional").first_divergence
    window = fd["blame_window"]
    assert window["module"] == "blocks.0" and window["after"] == "blocks.0.attn"
    assert "blocks.0.attn" in window["excluding_children"] and "blocks.0.mlp" in window["excluding_children"]


def test_propagation_reaches_later_modules_and_steps(runs):
    c = bitguard.compare(runs / "reference", runs / "forward-bitflip")
    graph = c.propagation_graph()
    ids = {n["id"] for n in graph["nodes"]}
    assert "r0:forward:module:blocks.0.mlp.act" in ids and "r0:forward:module:lm_head" in ids
    assert "r0:optimizer:step:blocks.0.mlp.fc.weight" in ids
    # the corrupted weights carry it into the next step: modules first reached at step 2, and the
    # model's final state after the last one (step 3)
    assert {n["first_step"] for n in graph["nodes"]} == {1, 2, 3}
    assert [n["first_step"] for n in graph["nodes"] if n["id"] == "r0:optimizer:final:GPT"] == [3]
    assert any(e["kind"] == "weights" for e in graph["edges"])
    hop = c.neighbours("r0:forward:module:blocks.0.mlp.fc")
    assert {n["boundary"] for n in hop["consumers"]} >= {"blocks.0.mlp.act", "blocks.0.mlp"}
    text = compare_cli(runs / "reference", runs / "forward-bitflip").stdout
    assert "VERDICT: diverged" in text and "blocks.0.mlp.fc" in text and "blame: source" in text


def test_ignore_rule_on_the_pivot_labels_what_follows_instead_of_blaming_it(runs, tmp_path):
    rules = {"schema": "bitguard.rules/1", "rules": [
        {"id": "fc-noise", "action": "ignore", "match": {"boundary": "blocks.0.mlp.fc", "phase": "forward"},
         "note": "test", "author": "tests", "created": "2026-11-29"}]}
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(rules))
    report = json.loads(compare_cli(runs / "reference", runs / "forward-bitflip", "--rules", path, "--json").stdout)
    # everything after the accepted output follows from it (the false "consumer" blame of
    # blocks.0.mlp.act): nothing is left to blame, and nothing downstream can be certified
    assert report["first_divergence"] is None and report["verdict"] == "inconclusive"
    assert [r["code"] for r in report["inconclusive"]["reasons"]] == ["follows_accepted"]
    assert report["rules_fired"] == [{"id": "fc-noise", "count": 2}]  # steps 1 and 2
    ev = bitguard.compare(runs / "reference", runs / "forward-bitflip", rules=path).events()
    act = ev.filter((ev["boundary"] == "blocks.0.mlp.act") & (ev["step"] == 1) & (ev["phase"] == "forward"))
    assert act["status"].to_list() == ["follows"] and act["rule_id"].to_list() == ["fc-noise"]


def test_allow_gap_rule_accepts_an_inserted_helper(runs, tmp_path):
    _record(tmp_path / "helper", "--fault", "benign-dropout", "--fault-step", "0")
    c = bitguard.compare(runs / "reference", tmp_path / "helper")
    d = c.to_dict()
    # the inserted Sequential(GELU, Dropout) is structure only: the digests still all match, but
    # unallowed, its extra module calls are a structural divergence
    fd = d["first_divergence"]
    assert d["alignment"]["gaps_b"] > 0 and d["verdict"] == "diverged"
    assert (fd["cause"], fd["missing_side"], fd["blame"], fd["fault_class"]) == ("structure", "a", "structure", "extra")
    assert fd["boundary"].startswith("blocks.0.mlp.act")
    rules = {"rules": [{"id": "helper", "action": "allow-gap", "match": {"boundary": "blocks.0.mlp.act*"}}]}
    d2 = bitguard.compare(runs / "reference", tmp_path / "helper", rules=rules).to_dict()
    assert d2["verdict"] == "identical" and d2["rules_fired"][0]["id"] == "helper"


def _corrupt_copies(src: Path, tmp: Path) -> dict:
    import shutil

    cases = {}
    cases["not-a-run"] = tmp / "empty"
    cases["not-a-run"].mkdir()
    newer = tmp / "newer"
    shutil.copytree(src, newer)
    m = json.loads((newer / "manifest.json").read_text())
    m["schema_version"] = 99
    (newer / "manifest.json").write_text(json.dumps(m))
    cases["newer-schema"] = newer
    trunc = tmp / "truncated"
    shutil.copytree(src, trunc)
    data = (trunc / "rank-0.duckdb").read_bytes()
    (trunc / "rank-0.duckdb").write_bytes(data[: len(data) // 3])
    cases["truncated"] = trunc
    wider = tmp / "wider"
    shutil.copytree(src, wider)
    shutil.copy(src / "rank-0.duckdb", wider / "rank-1.duckdb")
    m = json.loads((wider / "manifest.json").read_text())
    m["world_size"] = 2
    (wider / "manifest.json").write_text(json.dumps(m))
    cases["world-size"] = wider
    return cases


@pytest.mark.parametrize("case,needle", [
    ("not-a-run", "no manifest.json"),
    ("newer-schema", "schema version 99"),
    ("truncated", "truncated"),
    ("world-size", "recorded with world size 1, not the 2"),
    ("missing", "does not exist"),
    ("bad-rules", "rule 'x': field 'action'"),
])
def test_bad_input_gets_one_line_and_exit_2(runs, tmp_path, case, needle):
    cases = _corrupt_copies(runs / "reference", tmp_path)
    cases["missing"] = tmp_path / "nowhere"
    args = [runs / "reference", cases.get(case, runs / "rerun")]
    if case == "bad-rules":
        (tmp_path / "r.json").write_text(json.dumps({"rules": [{"id": "x", "action": "hide"}]}))
        args += ["--rules", tmp_path / "r.json"]
    proc = compare_cli(*args, process=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bitguard compare: error: ") and needle in lines[0], proc.stderr


def test_manifest_differences_are_reported_before_the_verdict(runs, tmp_path):
    _record(tmp_path / "threads", "--seed", "1234")  # same numbers...
    m = json.loads((tmp_path / "threads" / "manifest.json").read_text())
    m["determinism"]["torch_threads"] = 7  # ...but say the thread count differed
    (tmp_path / "threads" / "manifest.json").write_text(json.dumps(m))
    d = bitguard.compare(runs / "reference", tmp_path / "threads").to_dict()
    assert any(x["field"] == "determinism.torch_threads" and x["b"] == 7 for x in d["manifest_diffs"])


def test_a_retyped_module_is_paired_and_compared_not_left_as_two_gaps(tmp_path):
    script = ROOT / "tests" / "scripts" / "retype.py"
    warm.record_all(*(dict(out=tmp_path / name, script=script, args=extra)
                      for name, extra in (("plain", []), ("retyped", ["swap"]))))
    d = bitguard.compare(tmp_path / "plain", tmp_path / "retyped").to_dict()
    fd = d["first_divergence"]
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"]) == (0, "forward", "blocks.0.ln_1", "source")
    assert fd["retyped"] and (fd["module_type"], fd["module_type_b"]) == ("LayerNorm", "MyLN")
    assert d["alignment"]["gaps_a"] == d["alignment"]["gaps_b"] == 0


def test_propagation_crosses_functional_ops_by_inferred_edges():
    demo = ROOT / "sample_traces" / "demo"
    graph = bitguard.compare(demo / "reference", demo / "suspect").propagation_graph()
    inferred = [e for e in graph["edges"] if e["kind"] == "inferred"]
    # wte(idx) + wpe(pos) is a functional add: the embedding dropout's input has no observed producer
    assert any(e["source"].endswith(":wte") and e["target"].endswith(":drop") for e in inferred), inferred
    assert any(n["boundary"] == "lm_head" for n in graph["nodes"])
