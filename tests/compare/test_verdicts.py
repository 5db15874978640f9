"""Verdict integrity: `identical` only when nothing is hidden; otherwise `diverged` or
`inconclusive`, with the reason, and the exit status that says which.

Synthetic run pairs (tests/fixtures_runs.py), edited the way real runs go wrong: a side with no
events, a killed run, a missing rank, boundary names with a prefix, a dropped or extra event, a
tensor that could not be observed, a damaged rank, collector errors, differences accepted by
rules and what follows from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

import bitguard
from bitguard import cli
from bitguard.backend.ingest import open_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fixtures_runs import RunSpec, Taint, benign_probe_then_real, write_pair, write_run  # noqa: E402


def _edit(run_dir, sql: str, params=(), rank: int = 0) -> None:
    con = duckdb.connect(os.path.join(run_dir, f"rank-{rank}.duckdb"))
    try:
        con.execute(sql, list(params))
        con.execute("CHECKPOINT")
    finally:
        con.close()


def _manifest(run_dir, **changes) -> None:
    path = Path(run_dir) / "manifest.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _codes(c) -> set[str]:
    return {r["code"] for r in c.to_dict()["certification"]["reasons"]}


def test_identical_pair_is_identical_with_exit_0(tmp_path):
    a, b = write_pair(str(tmp_path), "same", RunSpec(layers=3, steps=2))
    c = bitguard.compare(a, b)
    assert (c.verdict, c.exit_status) == ("identical", 0)
    d = c.to_dict()
    assert d["schema"] == "bitguard.compare/1" and d["inconclusive"] is None and d["certification"]["reasons"] == []


@pytest.mark.parametrize("manifest, certified", [
    ({"digest_build": None, "determinism": {"torch_threads": 2}}, False),  # the team digest, before its fix
    ({"digest_build": None}, False),  # how many threads is not known
    ({"digest_build": None, "determinism": {"torch_threads": 1}}, True),  # the caller alone: never the team
    ({"digest_build": 2, "determinism": {"torch_threads": 2}}, True),
])
def test_a_run_recorded_before_the_host_digest_fix_is_never_certified(tmp_path, manifest, certified):
    a, b = write_pair(str(tmp_path), "same", RunSpec(layers=3, steps=2))
    _manifest(b, **manifest)
    c = bitguard.compare(a, b)
    if certified:
        assert c.verdict == "identical", _codes(c)
    else:
        assert (c.verdict, c.exit_status) == ("inconclusive", 3)
        (r,) = c.to_dict()["inconclusive"]["reasons"]
        assert (r["code"], r["side"]) == ("digest_build", "b") and "re-record" in r["message"]


def test_a_side_without_events_is_inconclusive_not_identical(tmp_path):
    a = write_run(str(tmp_path / "a"), RunSpec(layers=3, steps=2))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=3, steps=0))
    c = bitguard.compare(a, b)
    assert (c.verdict, c.exit_status) == ("inconclusive", 3)
    reasons = c.to_dict()["inconclusive"]["reasons"]
    assert [r["code"] for r in reasons] == ["empty"] and "run B recorded no events" in reasons[0]["message"]


def test_two_runs_that_failed_before_any_event_say_so(tmp_path):
    """Helper 59 (mmengine's AmpOptimWrapper refuses a CPU before training): both runs failed at once, and the
    reason said that a script "that trains tensors by hand" has no boundary to record."""
    import torch

    for name in ("a", "b"):
        with pytest.raises(AssertionError):
            with bitguard.record(tmp_path / name, determinism=False):
                torch.nn.Linear(4, 2)
                raise AssertionError("only available training on gpu")
    reasons = {r["code"]: r["message"] for r in bitguard.compare(tmp_path / "a", tmp_path / "b").blocking_reasons()}
    assert "both failed before their first module call" in reasons["empty"], reasons
    assert "by hand" not in reasons["empty"]


def test_a_killed_run_is_inconclusive_and_says_what_was_compared(tmp_path):
    a = write_run(str(tmp_path / "a"), RunSpec(layers=3, steps=5))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=3, steps=2))
    _manifest(b, status="failed", complete=False, exit_status=137, signal="SIGKILL")
    _edit(b, "UPDATE meta SET value = ? WHERE key = 'status'", [json.dumps("running")])
    c = bitguard.compare(a, b)
    assert (c.verdict, c.exit_status) == ("inconclusive", 3)
    d = c.to_dict()
    assert "incomplete" in _codes(c)
    assert d["certification"]["compared_steps"]["0"] == [None, 1]  # step 1 may be cut short, 0 is whole
    assert d["alignment"]["identical_prefix"] > 0 and d["alignment"]["not_compared"] > 0


def test_a_killed_run_that_differs_before_it_ends_is_diverged(tmp_path):
    a = write_run(str(tmp_path / "a"), RunSpec(layers=3, steps=5))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=3, steps=3, taints=(Taint(1, "model.layers.1"),)))
    _manifest(b, status="failed", complete=False, exit_status=137)
    c = bitguard.compare(a, b)
    fd = c.first_divergence
    assert c.verdict == "diverged" and (fd["step"], fd["boundary"], fd["cause"]) == (1, "model.layers.1", "digest")
    assert "incomplete" in _codes(c)  # what follows the divergence is still named as uncertified


def test_a_shorter_complete_run_diverges_structurally(tmp_path):
    a = write_run(str(tmp_path / "a"), RunSpec(layers=3, steps=3))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=3, steps=2))
    c = bitguard.compare(a, b)
    fd = c.first_divergence
    assert (c.verdict, c.exit_status) == ("diverged", 1)
    assert (fd["cause"], fd["missing_side"], fd["step"], fd["blame"], fd["fault_class"]) == (
        "structure", "b", 2, "structure", "missing")
    assert fd["b_seq"] is None and fd["a_seq"] is not None


def test_a_missing_rank_is_inconclusive(tmp_path):
    a = write_run(str(tmp_path / "a"), RunSpec(layers=3, steps=2, world_size=2))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=3, steps=2, world_size=2))
    os.remove(os.path.join(b, "rank-1.duckdb"))
    c = bitguard.compare(a, b)
    assert (c.verdict, c.exit_status) == ("inconclusive", 3) and "missing_ranks" in _codes(c)
    os.remove(os.path.join(a, "rank-1.duckdb"))  # both declare two ranks, both have only rank 0
    c = bitguard.compare(a, b)
    assert c.verdict == "inconclusive" and "missing_ranks" in _codes(c)
    assert bitguard.compare(a, b, rank=0).verdict == "identical"  # the rank asked for is certified


def test_boundaries_renamed_by_a_prefix_pair_nothing_and_say_why(tmp_path):
    a, b = write_pair(str(tmp_path), "compiled", RunSpec(layers=3, steps=2))
    _edit(b, "UPDATE events SET boundary = '_orig_mod.' || boundary")
    c = bitguard.compare(a, b)
    assert (c.verdict, c.exit_status) == ("inconclusive", 3)
    reason = c.to_dict()["inconclusive"]["reasons"][0]
    assert reason["code"] == "nothing_paired" and "'_orig_mod.'" in reason["message"]
    # the text does not call what it could not compare identical (helper 17: two unrelated scripts)
    from bitguard.backend.report import render_text

    text = render_text(c)
    assert "no event of the two runs could be paired, so nothing was compared" in text, text
    assert "identical" not in text.split("VERDICT:")[1].splitlines()[0]


@pytest.mark.parametrize("dropped_from, missing_side, fault_class", [("b", "b", "missing"), ("a", "a", "extra")])
def test_an_event_on_one_side_only_is_a_structural_divergence(tmp_path, dropped_from, missing_side, fault_class):
    drop = frozenset({(1, "model.layers.1", "forward")})
    plain, short = RunSpec(layers=3, steps=3), RunSpec(layers=3, steps=3, drop=drop)
    a = write_run(str(tmp_path / "a"), short if dropped_from == "a" else plain)
    b = write_run(str(tmp_path / "b"), short if dropped_from == "b" else plain)
    c = bitguard.compare(a, b)
    fd = c.first_divergence
    assert c.verdict == "diverged"
    assert (fd["cause"], fd["missing_side"], fd["step"], fd["phase"], fd["boundary"], fd["fault_class"]) == (
        "structure", missing_side, 1, "forward", "model.layers.1", fault_class)
    assert "does not" in fd["blame_window"]["detail"]
    pivots = c.events().filter(c.events()["is_pivot"])
    assert pivots.height == 1 and pivots["status"][0] == f"only_{'a' if missing_side == 'b' else 'b'}"


def test_an_allowed_gap_is_not_a_divergence(tmp_path):
    drop = frozenset({(1, "model.layers.1", "forward")})
    a = write_run(str(tmp_path / "a"), RunSpec(layers=3, steps=3))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=3, steps=3, drop=drop))
    rules = {"rules": [{"id": "skip-l1", "action": "allow-gap", "match": {"boundary": "model.layers.1"}}]}
    c = bitguard.compare(a, b, rules=rules)
    assert c.verdict == "identical" and c.to_dict()["alignment"]["allowed_gaps"] == 1


def test_an_unobserved_tensor_is_inconclusive_and_qualifies_a_later_pivot(tmp_path):
    a, b = write_pair(str(tmp_path), "unobserved", RunSpec(layers=3, steps=3))
    for run in (a, b):
        _edit(run, "UPDATE tensors SET unobserved = 'sparse layout' WHERE seq = 2 AND role = 'output'")
    c = bitguard.compare(a, b)
    assert c.verdict == "inconclusive" and "unobserved" in _codes(c)
    assert "sparse layout" in c.to_dict()["inconclusive"]["reasons"][0]["message"]
    # a real difference later is still a divergence, with a note that the runs may have parted earlier
    a2 = write_run(str(tmp_path / "a2"), RunSpec(layers=3, steps=3))
    b2 = write_run(str(tmp_path / "b2"), RunSpec(layers=3, steps=3, taints=(Taint(2, "model.layers.0"),)))
    for run in (a2, b2):
        _edit(run, "UPDATE tensors SET unobserved = 'sparse layout' WHERE seq = 2 AND role = 'output'")
    fd = bitguard.compare(a2, b2).first_divergence
    assert fd["step"] == 2 and any("could not be observed" in n for n in fd["notes"])


def test_an_unobserved_tensor_never_counts_as_equal_even_when_its_zero_digests_are(tmp_path):
    a, b = write_pair(str(tmp_path), "zeros", RunSpec(layers=2, steps=1))
    for run in (a, b):
        _edit(run, "UPDATE tensors SET xor = 0, pos = 0, unobserved = 'nested tensor' WHERE role = 'output'")
    assert bitguard.compare(a, b).verdict == "inconclusive"


def test_a_damaged_rank_is_cut_where_its_damage_starts(tmp_path):
    a, b = write_pair(str(tmp_path), "damaged", RunSpec(layers=3, steps=4))
    run_b = open_run(b)
    run_b.damage = {0: {"from_step": 2, "reason": "journal group 3 fails its checksum"}}
    c = bitguard.compare(open_run(a), run_b)
    assert c.verdict == "inconclusive" and "damaged" in _codes(c)
    assert c.to_dict()["certification"]["compared_steps"]["0"] == [None, 2]


@pytest.mark.parametrize("taint_step, verdict", [(1, "diverged"), (2, "inconclusive"), (3, "inconclusive")])
def test_a_difference_where_a_rank_is_damaged_is_no_pivot(tmp_path, taint_step, verdict):
    """A journal group lost in the middle of a step leaves that step's later events, and the next
    steps', to be paired with the wrong partners: a digest difference from the damaged step on is
    no divergence to report (it made one, found on a run with a flipped bit in its journal), while
    one before it still is."""
    a = write_run(str(tmp_path / "a"), RunSpec(layers=3, steps=4))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=3, steps=4, taints=(Taint(taint_step, "model.layers.1"),)))
    run_b = open_run(b)
    run_b.damage = {0: {"from_step": 2, "reason": "journal group 3 fails its checksum"}}
    c = bitguard.compare(open_run(a), run_b)
    assert c.verdict == verdict and "damaged" in _codes(c)
    if verdict == "diverged":
        assert c.first_divergence["step"] == taint_step
    else:
        assert c.first_divergence is None and c.exit_status == 3


def test_collector_errors_make_an_otherwise_identical_pair_inconclusive(tmp_path):
    a, b = write_pair(str(tmp_path), "errors", RunSpec(layers=3, steps=2))
    _manifest(b, collector_errors=["forward: RuntimeError: boom"])
    c = bitguard.compare(a, b)
    assert c.verdict == "inconclusive" and "collector_errors" in _codes(c)


def test_different_step_windows_compare_only_the_common_window(tmp_path):
    a = write_run(str(tmp_path / "a"), RunSpec(layers=2, steps=4))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=2, steps=2))
    _manifest(b, steps=[0, 2])
    c = bitguard.compare(a, b)
    assert c.verdict == "inconclusive" and "step_window" in _codes(c)


# -- blame under rules ------------------------------------------------------------------------------

def _ignore(rule_id: str, **match) -> dict:
    return {"schema": "bitguard.rules/1", "rules": [{"id": rule_id, "action": "ignore", "match": match}]}


def test_what_follows_an_accepted_difference_is_labelled_not_blamed(tmp_path):
    a = write_run(str(tmp_path / "a"), RunSpec(layers=4, steps=2))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=4, steps=2, taints=(Taint(1, "model.layers.1"),)))
    rules = _ignore("l1-out", boundary="model.layers.1", role="output", steps=[1, 1])
    c = bitguard.compare(a, b, rules=rules)
    # layers 2 and 3, the root, gradients and the optimizer only follow from the accepted output
    assert c.first_divergence is None and c.verdict == "inconclusive"
    assert "follows_accepted" in _codes(c)
    ev = c.events()
    follows = ev.filter(ev["status"] == "follows")
    assert follows.height > 0 and set(follows["rule_id"].to_list()) == {"l1-out"}
    assert "model.layers.2" in follows["boundary"].to_list()
    assert c.to_dict()["alignment"]["follows_accepted"] == follows.height


def test_the_next_pivot_is_the_first_difference_accepted_ones_do_not_explain(tmp_path):
    a, b = benign_probe_then_real(str(tmp_path))
    c = bitguard.compare(a, b, rules=_ignore("probe", boundary="model.probe", role="output"))
    fd = c.first_divergence
    assert (fd["step"], fd["boundary"], fd["blame"]) == (1, "model.layers.2", "source")
    assert c.events(0).filter(c.events(0)["status"] == "benign")["boundary"].to_list() == ["model.probe"]


def test_event_detail_marks_each_accepted_tensor_with_its_rule(tmp_path):
    a, b = benign_probe_then_real(str(tmp_path))
    c = bitguard.compare(a, b, rules=_ignore("probe", boundary="model.probe", role="output"))
    ev = c.events(0)
    probe = ev.filter((ev["boundary"] == "model.probe") & (ev["step"] == 0)).row(0, named=True)
    assert probe["status"] == "benign" and probe["rule_id"] == "probe"
    detail = c.event_detail(0, "a", probe["a_seq"])
    out = [t for t in detail["tensors_a"] if t["role"] == "output"][0]
    assert (out["differs"], out["ignored"], out["rule_id"]) == (True, True, "probe")
    inp = [t for t in detail["tensors_a"] if t["role"] == "input"][0]
    assert (inp["differs"], inp["ignored"]) == (False, False)


def test_an_optimizer_pivot_never_claims_an_unobserved_gradient_matched(tmp_path):
    drop = frozenset((s, f"model.layers.{i}.weight", "backward") for s in range(3) for i in range(3))
    a = write_run(str(tmp_path / "a"), RunSpec(layers=3, steps=3, drop=drop))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=3, steps=3, drop=drop))
    # only the optimizer step of step 1 differs in B
    _edit(b, "UPDATE tensors SET xor = xor::UBIGINT + 1 WHERE seq IN (SELECT seq FROM events WHERE phase = 'optimizer' "
             "AND step = 1)")
    fd = bitguard.compare(a, b).first_divergence
    assert fd["phase"] == "optimizer"
    detail = fd["blame_window"]["detail"]
    assert "gradient at this step was not observed" in detail and "gradient and the previous parameters matched" not in detail


# -- the command line: exit statuses ----------------------------------------------------------------

def test_cli_exit_statuses(tmp_path, capsys):
    same_a, same_b = write_pair(str(tmp_path), "same", RunSpec(layers=2, steps=1))
    empty = write_run(str(tmp_path / "empty"), RunSpec(layers=2, steps=0))
    bad = write_run(str(tmp_path / "bad"), RunSpec(layers=2, steps=1, taints=(Taint(0, "model.layers.0"),)))
    assert cli.main(["compare", same_a, same_b]) == 0
    assert cli.main(["compare", same_a, bad]) == 1
    assert cli.main(["compare", same_a, str(tmp_path / "nothing-here")]) == 2
    assert cli.main(["compare", same_a, empty, "--json"]) == 3
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["verdict"] == "inconclusive"


def test_an_internal_error_exits_70_with_a_saved_traceback(tmp_path, monkeypatch, capsys):
    a, b = write_pair(str(tmp_path), "same", RunSpec(layers=2, steps=1))

    def broken(*args, **kwargs):
        raise ValueError("a bug of ours")

    monkeypatch.setattr("bitguard.backend.compare.compare", broken)
    assert cli.main(["compare", a, b]) == 70
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "internal error (ValueError: a bug of ours)" in err
    saved = err.split("the traceback is in ")[1].split(":")[0]
    assert "Traceback" in Path(saved).read_text()
    os.remove(saved)


def test_a_closed_pipe_keeps_the_verdicts_exit_status(tmp_path):
    a = write_run(str(tmp_path / "a"), RunSpec(layers=6, steps=3))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=6, steps=3, taints=(Taint(0, "model.layers.0"),)))
    proc = subprocess.run(f"{sys.executable} -m bitguard compare --json {a} {b} | head -c 20; "
                          f"exit ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


@pytest.mark.parametrize("content", [b"\xff\xfe{not utf-8", b"[" * 100_000, b"{\"rules\": 3"])
def test_bad_rules_files_get_one_line_and_exit_2(tmp_path, capsys, content):
    a, b = write_pair(str(tmp_path), "same", RunSpec(layers=2, steps=1))
    rules = tmp_path / "rules.json"
    rules.write_bytes(content)
    assert cli.main(["compare", a, b, "--rules", str(rules)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rules" in err and "Traceback" not in err


def test_record_refuses_an_interpreter_that_cannot_import_bitguard_before_writing(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    fake.chmod(0o755)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "bitguard", "record", "--out", str(out), "--", str(fake),
                           str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "cannot import bitguard" in proc.stderr, proc.stderr
    assert not out.exists()
    proc = subprocess.run([sys.executable, "-m", "bitguard", "record", "--out", str(out), "--",
                           str(tmp_path / "no-such" / "python"), str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "not found" in proc.stderr and not out.exists()


def test_a_manifest_that_says_incomplete_anywhere_is_not_certified(tmp_path):
    a, b = write_pair(str(tmp_path), "half", RunSpec(layers=2, steps=2))
    _manifest(b, complete=False)  # status still says complete: the two fields disagree
    c = bitguard.compare(a, b)
    assert c.verdict == "inconclusive" and "incomplete" in _codes(c)


def test_export_perfetto_to_an_unwritable_file_is_one_line_and_exit_2(tmp_path, capsys):
    a, b = write_pair(str(tmp_path), "same", RunSpec(layers=2, steps=1))
    assert cli.main(["export-perfetto", a, b, "-o", "/dev/full"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "/dev/full" in err


def test_two_tensors_with_the_same_role_and_index_pair_in_order_not_as_a_cross_product(tmp_path):
    a, b = write_pair(str(tmp_path), "dup", RunSpec(layers=2, steps=2))
    for run in (a, b):  # an event holding two grad rows of index 0 (a stale listener once made one)
        _edit(run, "INSERT INTO tensors SELECT seq, role, idx, path || '#2', shape, dtype, strides, nbytes, "
                   "xor::UBIGINT + 7, pos::UBIGINT + 7, tid, storage, unobserved, shard FROM tensors "
                   "WHERE seq = (SELECT min(seq) FROM events WHERE kind = 'grad')")
    assert bitguard.compare(a, b).verdict == "identical"


def test_full_against_trusted_mode_compares_what_trusted_mode_observes(tmp_path):
    a = write_run(str(tmp_path / "a"), RunSpec(layers=3, steps=2))
    # trusted mode: no Probe or Net module calls (not heavy types), optimizer steps without their state
    drop = frozenset((s, name, "forward") for s in range(2) for name in ("model.probe", "Net"))
    b = write_run(str(tmp_path / "b"), RunSpec(layers=3, steps=2, drop=drop))
    _manifest(b, mode="trusted")
    for run in (a, b):
        _edit(run, "UPDATE tensors SET role = 'param' WHERE seq IN (SELECT seq FROM events WHERE phase = 'optimizer')")
    _edit(a, "INSERT INTO tensors SELECT seq, 'state', 1, '[''exp_avg'']', shape, dtype, strides, nbytes, xor, pos, "
             "tid, storage, unobserved, shard FROM tensors WHERE seq IN (SELECT seq FROM events WHERE phase = 'optimizer')")
    c = bitguard.compare(a, b)
    assert c.verdict == "identical", c.first_divergence
    assert "modes" in _codes(c)
    assert c.to_dict()["alignment"]["events_a"] == c.to_dict()["alignment"]["events_b"]


def test_a_killed_run_s_missing_api_calls_are_not_listed_as_differences(tmp_path):
    """Helper 63: a rank killed at step 2 left its last steps' API calls unmade, and the verdict's note listed
    each as a way the runs "called the training API differently" (steps 2-3: optimizer_step called in A, not in
    B). Only the steps compared are looked at."""
    import torch

    for name in ("a", "b"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(4):
                opt.zero_grad()
                model(torch.randn(2, 4)).pow(2).mean().backward()
                opt.step()
    b = tmp_path / "b"
    for table in ("tensors", "events", "api_events"):  # (the kill: nothing of steps 2 and 3)
        seqs = "seq IN (SELECT seq FROM events WHERE step >= 2)" if table == "tensors" else "step >= 2"
        _edit(b, f"DELETE FROM {table} WHERE {seqs}")
    _manifest(b, status="failed", complete=False, exit_status=137, signal="SIGKILL")
    _edit(b, "UPDATE meta SET value = ? WHERE key = 'status'", [json.dumps("running")])
    d = bitguard.compare(tmp_path / "a", b).to_dict()
    assert d["verdict"] == "inconclusive" and d["certification"]["compared_steps"]["0"][1] == 1, d["certification"]
    assert d["api_differences"] is None, d["api_differences"]
