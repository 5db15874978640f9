"""Inference: preconditions found or the candidate dropped, supports, a deterministic readable file."""

import json

from bitguard.backend.invariants.check import check_facts, parse_invariants
from bitguard.backend.invariants.infer import MIN_SUPPORT, SCHEMA, infer
from invariant_loops import Loop


def by_id(doc):
    return {i["id"]: i for i in doc["invariants"]}


def test_the_file_is_versioned_readable_and_deterministic():
    runs = {"a": Loop(seed="a").run(), "b": Loop(seed="b", accum=2).run()}
    doc = infer(runs)
    again = infer({"a": Loop(seed="a").run(), "b": Loop(seed="b", accum=2).run()})
    assert json.dumps(doc) == json.dumps(again)
    assert doc["schema"] == SCHEMA and doc["inferred_from"] == ["a", "b"]
    for inv in doc["invariants"]:
        assert set(inv) >= {"id", "template", "names", "relation", "precondition", "support", "params"}
        assert inv["support"] >= MIN_SUPPORT and inv["relation"] and inv["names"]
        json.dumps(inv)
    assert len(parse_invariants(json.loads(json.dumps(doc)))) == len(doc["invariants"])


def test_a_failure_at_the_first_step_becomes_the_precondition():
    """scheduler.step() comes after optimizer.step(), so it lands in the next step: never in the first."""
    inv = by_id(infer({"a": Loop(seed="a").run(), "b": Loop(seed="b").run()}))["EventContain/scheduler_stepped"]
    features = {(c["feature"], c["op"], c["value"]) for c in inv["precondition"]}
    assert ("first_step", "==", False) in features and ("scheduler", "==", True) in features


def test_a_candidate_failing_in_a_clean_run_without_a_separating_feature_is_dropped():
    class EvalOnce(Loop):  # a clean pipeline that puts its dropout in eval mode for one training step
        def rows(self, rank=0):
            out = super().rows(rank)
            for a in out[3][0]:
                if a["kind"] == "modes":
                    a["value"] = '{"training": ["Model"], "eval": ["h.0.drop"]}'
            return out
    runs = {"a": Loop(seed="a").run(), "b": EvalOnce(seed="b").run()}
    doc = infer(runs)
    assert "Mode/all_training" not in by_id(doc)
    dropped = {d["id"]: d["why"] for d in doc["dropped"]}
    assert "no precondition separates" in dropped["Mode/all_training"]
    eval_first = infer({"a": Loop(seed="a").run(), "b": Loop(seed="b", bugs={"dropout_eval"}).run()})
    assert "no majority value" in {d["id"]: d["why"] for d in eval_first["dropped"]}["Mode/mode:h.0.drop"]
    kept = by_id(eval_first)["Mode/all_training"]  # eval by design from the first step: a configuration
    assert [c["feature"] for c in kept["precondition"]] == ["eval_at_start"]


def test_relevant_features_keep_an_invariant_from_runs_unlike_its_clean_ones():
    """Inferred only where a scheduler was attached, the scheduler invariants are skipped, not
    violated, on a run without one (transfer)."""
    invariants = parse_invariants(infer({"a": Loop(seed="a").run(), "b": Loop(seed="b").run()}))
    report = check_facts(Loop(seed="c", scheduler=False).run(), invariants)
    assert report["violations"] == []
    skipped = {s["id"]: s["why"] for s in report["skipped"]}
    assert skipped["EventContain/scheduler_stepped"].startswith("precondition absent: an LR scheduler is attached")
    assert "EventContain/zero_grad_before_backward" in report["applied"]


def test_too_little_support_is_dropped():
    doc = infer({"a": Loop(seed="a", steps=2).run()})  # (zero_grad_before_backward: the second step only)
    dropped = {d["id"]: d["why"] for d in doc["dropped"]}
    assert "fewer than" in dropped["EventContain/zero_grad_before_backward"]


def test_a_per_name_relation_seen_on_two_configurations_applies_to_those_only():
    doc = infer({"untied": Loop(seed="a").run(), "tied": Loop(seed="b", tied=("wte.weight", "head.weight")).run()})
    inv = by_id(doc)["Consistent/dtype:h.0.weight"]
    tied = next(c for c in inv["precondition"] if c["feature"] == "tied_at_start")
    assert tied["op"] == "in" and len(tied["value"]) == 2 and "is one of" in tied["text"]
    invariants = parse_invariants(doc)
    assert "Consistent/dtype:h.0.weight" in check_facts(Loop(seed="c").run(), invariants)["applied"]
    frozen = check_facts(Loop(seed="d", frozen=("h.0.bias",)).run(), invariants)
    assert {s["id"]: s["why"] for s in frozen["skipped"]}["Consistent/dtype:h.0.weight"].startswith(
        "precondition absent: the parameters frozen at the first training step")


def test_a_batch_event_without_inputs_is_no_repeated_batch():
    """A model called with keyword arguments only: its batch events hold no input rows (the
    collector reads positional ones), which must not read as the same batch every step."""
    class KwargsOnly(Loop):
        def rows(self, rank=0):
            out = super().rows(rank)
            for _, ev, te in out:
                batch = {e["seq"] for e in ev if e["kind"] == "batch"}
                te[:] = [t for t in te if t["seq"] not in batch]
            return out
    report = check_facts(KwargsOnly(seed="k").run(), parse_invariants(infer({"a": Loop(seed="a").run()})))
    assert report["violations"] == []
    assert {s["id"]: s["why"] for s in report["skipped"]}["Distinct/batch_changes"].startswith("names absent")


def test_two_features_together_separate_when_one_does_not():
    """Inferred on a scheduled and an unscheduled pipeline, 'each step steps the scheduler' fails at
    the first step of the one and everywhere in the other: only 'a scheduler is attached and this is
    not the first step' separates, and the scheduler bug is still caught."""
    doc = infer({"sched": Loop(seed="a").run(), "plain": Loop(seed="b", scheduler=False).run()})
    inv = by_id(doc)["EventContain/scheduler_stepped"]
    assert {(c["feature"], c["value"]) for c in inv["precondition"]} == {("scheduler", True), ("first_step", False)}
    found = check_facts(Loop(seed="c", bugs={"no_scheduler_step"}).run(), parse_invariants(doc))["violations"]
    assert [v["step"] for v in found if v["invariant_id"] == "EventContain/scheduler_stepped"] == [1, 2, 3, 4]
    assert check_facts(Loop(seed="d", scheduler=False).run(), parse_invariants(doc))["violations"] == []


def test_a_keyword_called_model_reads_its_batch_from_the_token_ids_of_its_first_embedding():
    class KwargsEmbedding(Loop):
        def rows(self, rank=0):
            out = super().rows(rank)
            for _, ev, te in out:
                for e in [e for e in ev if e["kind"] == "batch"]:
                    ids = next(t for t in te if t["seq"] == e["seq"] and t["role"] == "input")
                    te.remove(ids)
                    seq = e["seq"] + 0.5  # completes after the batch event, before the root's forward
                    ev.append({**e, "seq": seq, "phase": "forward", "kind": "module", "boundary": "wte", "depth": 2})
                    te.append({**ids, "seq": seq})
            return out
    invariants = parse_invariants(infer({"a": KwargsEmbedding(seed="a").run(), "b": KwargsEmbedding(seed="b").run()}))
    assert any(i.id == "Distinct/batch_changes" for i in invariants)
    found = check_facts(KwargsEmbedding(seed="c", bugs={"repeat_batch"}).run(), invariants)["violations"]
    assert [v["step"] for v in found if v["invariant_id"] == "Distinct/batch_changes"] == [1, 2, 3, 4]
