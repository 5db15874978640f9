"""In-run checks (backend/check.py) and the recompute check (backend/recompute.py) on made-up
events: pairing a recompute with its original forward, what is a finding, and the verdicts of
`bitguard check` (exit 0 clean, 1 findings, 3 inconclusive)."""

from __future__ import annotations

import json
from pathlib import Path

import fixtures_runs
import polars as pl

from bitguard.backend.check import LoadedRun, run_checks
from bitguard.backend.ingest import RunInfo
from bitguard.backend.recompute import check_recompute
from bitguard.cli import main

_EVENT_SCHEMA = {"seq": pl.Int64, "step": pl.Int32, "phase": pl.String, "kind": pl.String, "boundary": pl.String,
                 "module_type": pl.String, "call": pl.Int32}
_TENSOR_SCHEMA = {"seq": pl.Int64, "role": pl.String, "idx": pl.Int32, "path": pl.String,
                  "shape": pl.List(pl.Int64), "dtype": pl.String, "xor": pl.UInt64, "pos": pl.UInt64,
                  "unobserved": pl.String}


class _Run:
    """Events and tensors of one rank, as ingest.load_rank gives them (the columns the check reads)."""

    def __init__(self):
        self.events, self.tensors = [], []

    def add(self, phase: str, boundary: str, inputs: list[int], outputs: list[int], step: int = 0,
            unobserved: str | None = None) -> int:
        seq = len(self.events)
        call = sum(e["phase"] == phase and e["boundary"] == boundary and e["step"] == step for e in self.events)
        self.events.append({"seq": seq, "step": step, "phase": phase, "kind": "module", "boundary": boundary,
                            "module_type": "Linear", "call": call})
        for role, digests in (("input", inputs), ("output", outputs)):
            for i, d in enumerate(digests):
                self.tensors.append({"seq": seq, "role": role, "idx": i, "path": f"[{i}]", "shape": [2, 3],
                                     "dtype": "float32", "xor": d, "pos": d * 7 + 1,
                                     "unobserved": unobserved if role == "output" else None})
        return seq

    def frames(self) -> dict:
        return {0: (pl.DataFrame(self.events, schema=_EVENT_SCHEMA), pl.DataFrame(self.tensors, schema=_TENSOR_SCHEMA))}

    def check(self):
        return check_recompute(LoadedRun(None, [0], self.frames()))


def test_a_recompute_equal_to_its_forward_is_compared_and_clean():
    run = _Run()
    run.add("forward", "blocks.0.fc", [1], [2])
    run.add("recompute", "blocks.0.fc", [1], [2])
    out = run.check()
    assert (out.compared, out.findings, out.notes) == (1, [], [])


def test_a_recompute_whose_output_differs_on_the_same_inputs_is_a_source_finding():
    run = _Run()
    fwd = run.add("forward", "blocks.0.fc", [1], [2], step=2)
    rec = run.add("recompute", "blocks.0.fc", [1], [3], step=2)
    out = run.check()
    assert out.compared == 1 and len(out.findings) == 1
    f = out.findings[0]
    assert (f.check, f.step, f.boundary, f.phase, f.blame, f.seq, f.against.seq) == \
        ("recompute", 2, "blocks.0.fc", "recompute", "source", rec, fwd)
    assert f.differing_roles == ["output"]
    assert [(t.role, t.expected.xor, t.got.xor) for t in f.tensors] == [("output", f"{2:016x}", f"{3:016x}")]
    assert "same inputs" in f.detail


def test_inputs_that_already_differ_make_a_consumer_finding():
    run = _Run()
    run.add("forward", "blocks.0.act", [2], [4])
    run.add("recompute", "blocks.0.act", [3], [5])
    (f,) = run.check().findings
    assert f.blame == "consumer" and f.differing_roles == ["input", "output"]


def test_a_module_shared_by_two_regions_pairs_by_inputs_not_by_order():
    # a reentrant checkpoint recomputes its regions in backward order: the last region first
    run = _Run()
    run.add("forward", "shared", [1], [10])
    run.add("forward", "shared", [2], [20])
    run.add("recompute", "shared", [2], [20])
    run.add("recompute", "shared", [1], [10])
    out = run.check()
    assert (out.compared, out.findings) == (2, [])


def test_of_two_calls_on_the_same_inputs_the_recompute_pairs_with_the_one_it_repeats():
    """Helper 44 (PEFT): a reference pass under no_grad with the adapter off, then the checkpointed
    call, on the same inputs: the recompute was paired with the first, a false "same inputs, different
    output" finding; a recompute that matches neither is still one."""
    run = _Run()
    run.add("forward", "proj", [1], [10])  # adapter off
    checkpointed = run.add("forward", "proj", [1], [11])
    run.add("recompute", "proj", [1], [11])
    out = run.check()
    assert (out.compared, out.findings) == (1, []), out.findings
    run.add("forward", "proj", [1], [10], step=1)
    run.add("forward", "proj", [1], [11], step=1)
    rec = run.add("recompute", "proj", [1], [12], step=1)
    (f,) = run.check().findings
    assert (f.seq, f.blame, f.step) == (rec, "source", 1) and checkpointed != f.against.seq


def test_without_matching_inputs_the_nth_recompute_pairs_with_the_nth_forward():
    run = _Run()
    first = run.add("forward", "m", [1], [10])
    run.add("forward", "m", [2], [20])
    run.add("recompute", "m", [9], [11])
    (f,) = run.check().findings
    assert f.against.seq == first and f.blame == "consumer"


def test_forwards_of_other_steps_and_later_forwards_are_not_candidates():
    run = _Run()
    run.add("forward", "m", [1], [10], step=0)
    run.add("recompute", "m", [1], [10], step=1)  # its step has no forward before it
    run.add("forward", "m", [1], [10], step=1)
    out = run.check()
    assert out.compared == 0 and out.findings == []
    assert "no forward of their module" in out.notes[0]


def test_a_pair_holding_an_unobserved_tensor_is_not_compared_and_says_so():
    run = _Run()
    run.add("forward", "m", [1], [10])
    run.add("recompute", "m", [1], [11], unobserved="nested tensor")
    out = run.check()
    assert out.compared == 0 and out.findings == []
    assert "could not be observed" in out.notes[0]


def test_a_run_without_recompute_has_nothing_to_check():
    run = _Run()
    run.add("forward", "m", [1], [10])
    out = run.check()
    assert out.compared == 0 and "no activation recompute" in out.notes[0]


def _info(tmp_path: Path, **manifest) -> RunInfo:
    return RunInfo(path=tmp_path, manifest={"status": "complete", "complete": True, **manifest}, ranks={0: tmp_path},
                   world_size=1, rank_meta={0: {"status": "complete"}})


def test_verdicts_clean_findings_inconclusive(tmp_path):
    clean, faulty = _Run(), _Run()
    for run, out in ((clean, 2), (faulty, 3)):
        run.add("forward", "m", [1], [2])
        run.add("recompute", "m", [1], [out])
    result = run_checks(_info(tmp_path), frames=clean.frames())
    assert (result.verdict, result.exit_status, result.reasons) == ("clean", 0, [])
    assert result.to_dict()["schema"] == "bitguard.check/1"
    result = run_checks(_info(tmp_path), frames=faulty.frames())
    assert (result.verdict, result.exit_status, len(result.findings)) == ("findings", 1, 1)
    # a run that did not finish is not called clean, but a finding in what it recorded stands
    result = run_checks(_info(tmp_path, status="failed", complete=False), frames=clean.frames())
    assert (result.verdict, result.exit_status) == ("inconclusive", 3)
    assert [r.code for r in result.reasons] == ["incomplete"]
    result = run_checks(_info(tmp_path, status="failed", complete=False), frames=faulty.frames())
    assert (result.verdict, result.exit_status) == ("findings", 1)
    result = run_checks(_info(tmp_path, collector_errors=["forward: boom"]), frames=clean.frames())
    assert result.verdict == "inconclusive" and [r.code for r in result.reasons] == ["collector_errors"]


def test_cli_check_on_a_run_with_nothing_to_check_exits_3(tmp_path, capsys):
    run = fixtures_runs.write_run(str(tmp_path / "run"), steps=2)
    assert main(["check", run, "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "bitguard.check/1" and doc["verdict"] == "inconclusive" and doc["findings"] == []
    assert [r["code"] for r in doc["reasons"]] == ["nothing_checked"]
    assert doc["checks"][0]["name"] == "recompute" and doc["checks"][0]["compared"] == 0
    assert main(["check", run]) == 3
    assert "VERDICT: inconclusive" in capsys.readouterr().out


def test_cli_check_bad_input_exits_2(tmp_path, capsys):
    assert main(["check", str(tmp_path / "missing")]) == 2
    run = fixtures_runs.write_run(str(tmp_path / "run"), steps=1)
    assert main(["check", run, "--rank", "5"]) == 2
    err = capsys.readouterr().err
    assert "rank 5 is not recorded" in err and err.count("\n") == 2


def test_compare_does_not_count_recompute_events_on_one_side_only():
    from bitguard.backend.recompute import one_sided

    plain, checkpointed = _Run(), _Run()
    plain.add("forward", "m", [1], [2])
    checkpointed.add("forward", "m", [1], [2])
    extra = checkpointed.add("recompute", "m", [1], [2])
    other = checkpointed.add("forward", "n", [2], [3])  # a real one-sided event: still counted
    (ea, _), (eb, _) = plain.frames()[0], checkpointed.frames()[0]
    gaps = pl.DataFrame({"side": ["b", "b"], "seq": [extra, other], "counted": [True, True]})
    gaps, reasons = one_sided(gaps, ea, eb, rank=0)
    assert gaps.filter(pl.col("counted"))["seq"].to_list() == [other]
    assert [(r["code"], r["rank"]) for r in reasons] == [("recompute", 0)] and "run B 1" in reasons[0]["message"]
    empty, none = one_sided(gaps.head(0), ea, eb, rank=0)
    assert empty.is_empty() and none == []


def test_a_recompute_that_drew_other_random_numbers_says_so():
    run = _Run()
    run.add("forward", "drop", [1], [2])
    run.add("recompute", "drop", [1], [3])
    run.tensors += [{"seq": 0, "role": "rng", "idx": 1, "path": "cpu", "shape": [5056], "dtype": "uint8", "xor": 7,
                     "pos": 8, "unobserved": None},
                    {"seq": 1, "role": "rng", "idx": 1, "path": "cpu", "shape": [5056], "dtype": "uint8", "xor": 9,
                     "pos": 10, "unobserved": None}]
    (f,) = run.check().findings
    assert f.blame == "consumer" and f.differing_roles == ["output", "rng"] and "RNG state" in f.detail


def test_a_replica_s_differing_parameter_keeps_its_index_in_the_event():
    """Helper 17: `check` printed every differing parameter as `param[0]`, where compare printed the same
    tensor as `param[4]`."""
    from bitguard.backend.replicas import _diffs

    row = {"idx": 4, "shape": [3, 32], "dtype": "float32", "xor": 1, "pos": 2}
    (diff,) = _diffs({".module.fc2.weight": row}, {".module.fc2.weight": {**row, "xor": 5}})
    assert (diff.role, diff.index, diff.path) == ("param", 4, ".module.fc2.weight")
