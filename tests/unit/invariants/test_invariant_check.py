"""Offline checking of run directories and the command lines: exit statuses, the documents,
transfer (applied and skipped), bad input in one line."""

import json

import pytest

from bitguard.backend.invariants.check import Checker, load_invariants, parse_invariants
from bitguard.backend.invariants.infer import infer
from bitguard.cli import main
from bitguard.errors import BadInput
from invariant_loops import Loop, write_run


@pytest.fixture(scope="module")
def inv_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("clean")
    runs = [write_run(root, Loop(seed=s, world_size=2), name=f"clean-{s}") for s in "ab"]
    out = root / "inv.json"
    assert main(["invariants", "infer", *map(str, runs), "-o", str(out)]) == 0
    return out


def test_infer_writes_the_file_and_says_what_it_holds(inv_file, capsys, tmp_path):
    doc = json.loads(inv_file.read_text())
    assert doc["schema"] == "bitguard.invariants/1" and len(doc["inferred_from"]) == 2
    assert any(i["id"].startswith("Consistent/replicated:") for i in doc["invariants"])
    run = write_run(tmp_path, Loop(seed="a", world_size=2), name="again")
    assert main(["invariants", "infer", str(run), "-o", str(tmp_path / "one.json")]) == 0
    assert "invariants from 1 clean run(s)" in capsys.readouterr().out


def test_a_clean_run_exits_0_and_a_buggy_one_1_with_each_violation_on_a_line(inv_file, tmp_path, capsys):
    clean = write_run(tmp_path, Loop(seed="c", world_size=2), name="clean")
    assert main(["invariants", "check", str(clean), "--invariants", str(inv_file)]) == 0
    assert ": clean: 0 violation(s)" in capsys.readouterr().out
    buggy = write_run(tmp_path, Loop(seed="d", world_size=2, bugs={"no_zero_grad"}), name="buggy")
    assert main(["invariants", "check", str(buggy), "--invariants", str(inv_file)]) == 1
    out = capsys.readouterr().out
    assert "step 1 rank 0: each training step after the run's first calls zero_grad before its first backward" in out
    assert main(["invariants", "check", str(buggy), "--invariants", str(inv_file), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "bitguard.invariant-check/1" and report["verdict"] == "violated"
    assert report["violations"][0]["step"] == 1 and report["applied"]  # (step 0 has no older gradient to clear)
    assert {"id": "EventContain/zero_grad_before_backward", "count": 8, "first_step": 1} in report["violated"]


def test_transfer_to_another_model_reports_applied_and_skipped(inv_file, tmp_path, capsys):
    other = write_run(tmp_path, Loop(seed="e", params=("enc.weight", "dec.weight"), dropout=()), name="other")
    assert main(["invariants", "check", str(other), "--invariants", str(inv_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "EventContain/zero_grad_before_backward" in report["applied"]
    skipped = {s["id"]: s["why"] for s in report["skipped"]}
    assert skipped["Consistent/dtype:h.0.weight"].startswith("names absent")
    assert "cross-rank" in skipped["Consistent/replicated:h.0.weight"]


def test_a_run_without_api_events_is_exit_2_never_a_pass(inv_file, tmp_path, capsys):
    old = write_run(tmp_path, Loop(seed="f"), name="old", api_events=False)
    assert main(["invariants", "check", str(old), "--invariants", str(inv_file)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no API events recorded: re-record with bitguard >= this version" in err[0]
    assert main(["invariants", "infer", str(old), "-o", str(tmp_path / "x.json")]) == 2


def test_nothing_applied_is_inconclusive(tmp_path, capsys):
    invariants = tmp_path / "dp-only.json"
    doc = json.loads(json.dumps(infer({"a": Loop(seed="a", world_size=2).run(), "b": Loop(seed="b", world_size=2).run()})))
    doc["invariants"] = [i for i in doc["invariants"] if i["id"].startswith("Consistent/replicated:")]
    invariants.write_text(json.dumps(doc))
    run = write_run(tmp_path, Loop(seed="g"), name="one-rank")
    assert main(["invariants", "check", str(run), "--invariants", str(invariants)]) == 3
    assert "nothing was checked" in capsys.readouterr().out


@pytest.mark.parametrize("text, message", [
    ("not json", "is not JSON"),
    ('{"schema": "bitguard.compare/1"}', "is not a bitguard.invariants/1 document"),
    ('{"schema": "bitguard.invariants/1", "invariants": [{"id": "x"}]}', "invariant 0 is malformed"),
])
def test_a_bad_invariants_file_is_one_line_of_bad_input(tmp_path, text, message):
    path = tmp_path / "inv.json"
    path.write_text(text)
    with pytest.raises(BadInput, match=message):
        load_invariants(path)
    with pytest.raises(BadInput, match="is not a file"):
        load_invariants(tmp_path / "missing.json")


def test_online_checking_step_by_step_finds_the_violation_in_its_step():
    """What the recorder does at each step end: one Checker, the step's facts, the violations."""
    invariants = parse_invariants(infer({"a": Loop(seed="a").run(), "b": Loop(seed="b").run()}))
    checker = Checker(invariants)
    per_step = [(f.step, [v.invariant_id for v in checker.check_step(f)])
                for f in Loop(seed="c", bugs={"in_place_edit"}).facts()]
    assert per_step[2] == (2, ["Update/no_edit_between_steps"])
    assert all(not ids for step, ids in per_step if step != 2)
