"""Activation checkpointing (torch.utils.checkpoint, reentrant and not; Hugging Face's
gradient_checkpointing_enable): the stacks tier's claims (see harness.py), plus the in-run
check: every recompute is recorded as a `recompute` event of its module, paired with its
original forward, and a fault in the recompute alone is found by `bitguard check` with no
reference run and localized by compare."""

import polars as pl
import pytest

from bitguard.backend.ingest import load_rank, open_run

from . import harness as h

FAULT = {"STACK_FAULT": "recompute:step=2"}
FAULTY = "blocks.1.mlp.0"  # the module whose output the fault flips when it is recomputed
STEPS = 4


def events(run) -> pl.DataFrame:
    return load_rank(open_run(run), 0)[0]


@pytest.fixture(scope="module", params=[(), pytest.param(("--reentrant",), marks=pytest.mark.extended)],
                ids=["non-reentrant", "reentrant"])
def runs(request, tmp_path_factory):
    args = request.param
    tmp = tmp_path_factory.mktemp("checkpoint")
    got = h.together({
        "plain": lambda: h.plain("checkpointing.py", tmp, *args),
        "plain_fault": lambda: h.plain("checkpointing.py", tmp, *args, env=FAULT, name="plain-fault"),
        "a": lambda: h.recorded("checkpointing.py", tmp / "a", *args),
        "b": lambda: h.recorded("checkpointing.py", tmp / "b", *args),
        "fault": lambda: h.recorded("checkpointing.py", tmp / "fault", *args, env=FAULT)})
    plain, plain_fault, (a, ra), (b, _), (fault, rf) = (got[k] for k in ("plain", "plain_fault", "a", "b", "fault"))
    return {"args": args, "plain": plain, "plain_fault": plain_fault, "a": a, "ra": ra, "b": b, "fault": fault,
            "rf": rf}


def test_records_unedited_and_numbers_unchanged(runs):
    h.assert_unchanged(runs["plain"], runs["ra"])
    h.assert_unchanged(runs["plain_fault"], runs["rf"])
    assert runs["plain_fault"][0]["params"] != runs["plain"][0]["params"], "the recompute fault changes no weight"
    m = h.manifest(runs["a"])
    assert m["status"] == "complete" and not m["collector_errors"] and m["steps_completed"] == STEPS


def test_recomputes_are_recompute_events_never_roots(runs):
    e = events(runs["a"])
    data = e.filter(pl.col("phase") == "data")
    assert data["boundary"].to_list() == ["TinyLM"] * STEPS, "a recompute was taken for a model root"
    rec = e.filter(pl.col("phase") == "recompute")
    assert sorted(set(rec["step"].to_list())) == list(range(STEPS))
    names = set(rec["boundary"].to_list())
    assert {"blocks.0.ln", "blocks.1.attn", FAULTY, "blocks.1.mlp"} <= names
    # every recompute event is of a module that ran forward in the same step, under the same name, type and depth
    forwards = e.filter(pl.col("phase") == "forward").select("step", "boundary", "module_type", "depth").unique()
    assert rec.join(forwards, on=["step", "boundary", "module_type", "depth"], how="anti").is_empty()
    # every module's backward is recorded once per step: no recompute added or corrupted one
    backward = e.filter((pl.col("phase") == "backward") & (pl.col("kind") == "module"))
    assert backward.group_by("step", "boundary").len()["len"].max() == 1
    assert set(backward["boundary"].to_list()) >= {"blocks.1", "blocks.1.mlp", FAULTY}
    if runs["args"]:  # reentrant: no early stop, the checkpointed block itself is recomputed
        assert {"blocks.0", "blocks.1"} <= names


def test_rerun_identical_with_recompute_events_paired(runs):
    code, doc = h.compare(runs["a"], runs["b"])
    assert (code, doc["verdict"]) == (0, "identical"), doc.get("inconclusive") or doc.get("first_divergence")
    assert doc["run_checks"] == {"a": [], "b": []}
    code, doc = h.check(runs["a"])
    recomputes = events(runs["a"]).filter(pl.col("phase") == "recompute").height
    assert (code, doc["verdict"], doc["findings"]) == (0, "clean", []), doc
    assert doc["checks"][0]["name"] == "recompute" and doc["checks"][0]["compared"] == recomputes, doc["checks"]


def test_check_finds_the_recompute_fault_without_a_reference(runs):
    code, doc = h.check(runs["fault"])
    assert (code, doc["verdict"]) == (1, "findings"), doc
    first = doc["findings"][0]
    assert (first["check"], first["step"], first["boundary"], first["phase"], first["blame"]) == \
        ("recompute", 2, FAULTY, "recompute", "source"), first
    assert first["differing_roles"] == ["output"] and first["against"]["phase"] == "forward"
    assert {f["step"] for f in doc["findings"]} == {2}


def test_compare_localizes_the_recompute_fault(runs):
    code, doc = h.compare(runs["a"], runs["fault"])
    assert code == 1
    h.assert_localized(doc, step=2, rank=0, boundary=FAULTY, blame="source", fault_class="recompute")
    assert doc["first_divergence"]["phase"] == "recompute"
    assert doc["run_checks"]["a"] == []
    assert doc["run_checks"]["b"][0]["boundary"] == FAULTY and doc["run_checks"]["b"][0]["step"] == 2


@pytest.mark.parametrize("args", [(), pytest.param(("--reentrant",), marks=pytest.mark.extended)],
                         ids=["non-reentrant", "reentrant"])
def test_hf_gradient_checkpointing_records_recomputes_not_roots(args, tmp_path):
    got = h.together({"plain": lambda: h.plain("hf_checkpointing.py", tmp_path, *args),
                      "run": lambda: h.recorded("hf_checkpointing.py", tmp_path / "hf", *args)})
    plain, (run, result) = got["plain"], got["run"]
    h.assert_unchanged(plain, result)
    e = events(run)
    assert e.filter(pl.col("phase") == "data")["boundary"].to_list() == ["LlamaForCausalLM"] * 3
    rec = e.filter(pl.col("phase") == "recompute")
    assert {"model.layers.0.mlp.up_proj", "model.layers.1.self_attn"} <= set(rec["boundary"].to_list())
    code, doc = h.check(run)
    assert (code, doc["verdict"]) == (0, "clean") and doc["checks"][0]["compared"] == rec.height, doc


@pytest.fixture(scope="module")
def unchecked(tmp_path_factory):
    """The same training without checkpointing, recorded once for both modes."""
    return h.recorded("checkpointing.py", tmp_path_factory.mktemp("none") / "none", "--no-checkpoint")


def test_checkpointing_changes_no_number_and_compares_identical_to_no_checkpointing(runs, unchecked):
    none, result = unchecked
    h.assert_unchanged(runs["ra"], result)  # checkpointing (either mode) leaves every number as it was
    code, doc = h.compare(none, runs["a"])
    assert (code, doc["verdict"]) == (0, "identical"), doc.get("inconclusive") or doc.get("first_divergence")
    notes = [r for r in doc["certification"]["reasons"] if r["code"] == "recompute"]
    assert len(notes) == 1 and "run B" in notes[0]["message"], doc["certification"]
    assert doc["alignment"]["gaps_b"] == events(runs["a"]).filter(pl.col("phase") == "recompute").height


@pytest.mark.parametrize("mode", [(), pytest.param(("--reentrant",), marks=pytest.mark.extended)],
                         ids=["non-reentrant", "reentrant"])
def test_check_finds_a_recompute_that_draws_other_random_numbers(tmp_path, mode):
    # preserve_rng_state=False: each dropout recompute draws another mask than its forward did (a real
    # nondeterminism of the training). Non-reentrant stops recomputing at the dropout's mask, the last saved
    # tensor of the block, so the dropout's recompute is cut short: helper 85's `check` said clean, comparing
    # nothing of it; the cut call is now recorded with its inputs and the RNG state it began from.
    got = h.together({"plain": lambda: h.plain("checkpointing.py", tmp_path, *mode, "--no-preserve-rng"),
                      "run": lambda: h.recorded("checkpointing.py", tmp_path / "norng", *mode, "--no-preserve-rng")})
    plain, (run, result) = got["plain"], got["run"]
    h.assert_unchanged(plain, result)
    code, doc = h.check(run)
    assert (code, doc["verdict"]) == (1, "findings"), doc
    drops = [f for f in doc["findings"] if f["boundary"].endswith(".drop")]
    assert drops and all("rng" in f["differing_roles"] and "RNG state" in f["detail"] for f in drops), doc["findings"]
    assert {f["step"] for f in drops} == set(range(STEPS))
    recompute = next(c for c in doc["checks"] if c["name"] == "recompute")
    assert not mode == any("cut short" in n for n in recompute["notes"]), doc["checks"]
    assert not mode == (recompute["inputs_only"] > 0), recompute
