"""Each template on the simulated loop: inferred from clean runs, silent on another clean run,
and each bug class of issue 17 caught in the step it happens, by the template meant for it."""

import re

import pytest

from bitguard.backend.invariants.check import check_facts, parse_invariants
from bitguard.backend.invariants.infer import infer
from invariant_loops import Loop

SHAPE = dict(frozen=("h.0.bias",), tied=("wte.weight", "head.weight"), world_size=2)


@pytest.fixture(scope="module")
def invariants():
    clean = {f"clean-{seed}-{accum}": Loop(seed=seed, accum=accum, **SHAPE).run()
             for seed, accum in (("a", 1), ("b", 1), ("c", 2))}
    return parse_invariants(infer(clean))


def violations(invariants, **kw):
    kw = {**SHAPE, **kw}
    return check_facts(Loop(seed="suspect", **kw).run(), invariants)["violations"]


def test_another_clean_run_violates_nothing(invariants):
    assert violations(invariants) == []
    assert violations(invariants, accum=2) == []


# bug -> (the invariant that must catch it, the first step it must be caught in)
CASES = {
    "no_zero_grad": ("EventContain/zero_grad_before_backward", 1),  # (step 0 has no older gradient to clear)
    "no_scheduler_step": ("EventContain/scheduler_stepped", 1),
    "clip_before_backward": ("Sequence/order:backward<clip_grad_norm", 0),
    "clip_wrong_params": ("Consistent/clip_covers", 0),
    "missing_group": ("Consistent/in_optimizer", 0),
    "dropout_eval": ("Mode/all_training", 0),
    "dtype": ("Consistent/stable_dtype", 2),
    "repeat_batch": ("Distinct/batch_changes", 1),
    "in_place_edit": ("Update/no_edit_between_steps", 2),
    "left_frozen": ("Consistent/stable_requires_grad", 2),
    "frozen_updated": ("Update/frozen_unchanged", 0),
    "untie": ("Consistent/stable_shares_storage_with", 2),
    "replica": ("Consistent/replicated:h.0.bias", 2),
    "accum_scale": ("Bound/loss_over_accum", 0),
    "clip_lost": ("Bound/clip_scales_grads", 0),
    "clip_skipped": ("EventContain/clip_kept", 2),
    "replica_step": ("Consistent/stable_replicated", 2),
}


@pytest.mark.parametrize("bug", sorted(CASES))
def test_each_bug_is_caught_in_its_step_by_its_template(invariants, bug):
    found = violations(invariants, bugs={bug}, accum=2 if bug == "accum_scale" else 1, bug_step=2)
    expected_id, step = CASES[bug]
    hits = [v for v in found if v["invariant_id"] == expected_id]
    assert hits, f"{bug}: {expected_id} not violated; got {sorted({v['invariant_id'] for v in found})}"
    assert min(v["step"] for v in hits) == step
    assert min(v["step"] for v in found) == step, f"{bug}: something fired before the bug happened"
    v = hits[0]
    assert v["template"] == expected_id.split("/")[0] and v["message"] and v["evidence"]


@pytest.mark.parametrize("bug, per_name", [("dtype", "Consistent/dtype:h.0.bias"),
                                           ("left_frozen", "Consistent/requires_grad:h.0.weight"),
                                           ("untie", "Consistent/storage:wte.weight")])
def test_a_change_of_configuration_mid_run_breaks_the_per_name_relation_too(invariants, bug, per_name):
    found = violations(invariants, bugs={bug}, bug_step=2)
    assert min(v["step"] for v in found if v["invariant_id"] == per_name) == 2


@pytest.mark.parametrize("bug", ["dtype", "left_frozen", "untie"])
def test_a_configuration_from_the_first_step_is_not_read_as_a_bug(invariants, bug):
    """Cast, frozen or untied from the start, a model is another configuration, not a changed one:
    the per-name relations are skipped for it (precondition absent), not violated. (A miss of such a
    bug from step 0 is the price: a model frozen by design looks the same.)"""
    report = check_facts(Loop(seed="s", bugs={bug}, **SHAPE).run(), invariants)
    assert not [v for v in report["violations"] if v["template"] == "Consistent"]
    skipped = {s["id"]: s["why"] for s in report["skipped"]}
    assert any(why.startswith("precondition absent: the parameters") for why in skipped.values())


def test_missing_zero_grad_is_also_seen_in_the_gradients_accumulating(invariants):
    found = violations(invariants, bugs={"no_zero_grad"})
    stale = [v for v in found if v["invariant_id"] == "EventContain/grads_fresh"]
    assert [v["step"] for v in stale if v["rank"] == 0] == [1, 2, 3, 4]
    assert stale[0]["evidence"]["count"] == 3  # the three trainable parameters, not the frozen one


def test_clipping_before_backward_returns_no_norm(invariants):
    found = violations(invariants, bugs={"clip_before_backward"})
    assert any(v["invariant_id"] == "Bound/clip_total_norm" and v["evidence"]["total_norm"] == 0.0 for v in found)


def test_a_replica_diverging_is_reported_for_every_rank_of_the_step(invariants):
    found = [v for v in violations(invariants, bugs={"replica"}) if v["template"] == "Consistent"]
    assert found[0]["rank"] is None and set(found[0]["evidence"]["xor_at_forward"]) == {"0", "1"}


def test_lr_overwritten_by_hand_breaks_the_schedule(invariants):
    class HandLr(Loop):
        def rows(self, rank=0):
            out = super().rows(rank)
            for api, _, _ in out[2:3]:
                for a in api:
                    if a["kind"] == "optimizer_step":
                        a["value"] = a["value"].replace('"lr": 0.', '"lr": 0.5', 1)  # 0.081 -> 0.5081
            return out
    found = check_facts(HandLr(seed="s", **SHAPE).run(), invariants)["violations"]
    assert [(v["invariant_id"], v["step"]) for v in found if v["rank"] == 0] == [("Bound/lr_is_scheduled", 2)]


def test_an_unscaled_accumulated_loss_is_over_its_bound_without_a_root_loss(invariants):
    """Where no root module returns the loss (nothing to divide by), the backward root times the
    calls per step is bounded by the clean runs' largest."""
    class NoRootLoss(Loop):
        def rows(self, rank=0):
            out = super().rows(rank)
            for _, ev, _ in out:
                ev[:] = [e for e in ev if e["kind"] != "module"]
            return out
    found = check_facts(NoRootLoss(seed="s", accum=2, bugs={"accum_scale"}, **SHAPE).run(), invariants)["violations"]
    hits = [v for v in found if v["invariant_id"] == "Bound/loss_bound:Model"]
    assert hits and hits[0]["step"] == 0 and hits[0]["evidence"]["observed"] > hits[0]["evidence"]["at_most"]
    assert check_facts(NoRootLoss(seed="t", accum=2, **SHAPE).run(), invariants)["violations"] == []


def test_a_tensor_whose_xor_cancels_is_not_read_as_unchanged(invariants):
    """A LayerNorm weight of equal values has xor 0 before and after a step (its words cancel in
    pairs): whether it changed is read from (xor, pos) of the optimizer step events, never from the
    params row's xor alone."""
    class Cancelling(Loop):
        def rows(self, rank=0):
            out = super().rows(rank)
            for api, _, te in out:
                for t in te:
                    if t["role"] == "param":
                        t["xor"] = 0
                for a in api:
                    if a["kind"] == "params":
                        a["value"] = re.sub(r'"xor": "[0-9a-f]{16}"', '"xor": "0000000000000000"', a["value"])
            return out
    assert violations(invariants) == []
    found = check_facts(Cancelling(seed="x", **SHAPE).run(), invariants)["violations"]
    assert not [v for v in found if v["invariant_id"] == "Update/changes_at_step"]


def test_a_replica_diverging_in_its_step_is_caught_on_a_model_of_other_names(invariants):
    """`stable_replicated` is name-free: inferred on one model, it applies to another whose
    parameters the clean runs never had (the per-name `replicated:` ones are skipped there)."""
    names = dict(params=("enc.weight", "enc.bias", "cls.weight"), frozen=(), tied=(), world_size=2)
    clean = check_facts(Loop(seed="other", **names).run(), invariants)
    assert clean["violations"] == [] and "Consistent/stable_replicated" in clean["applied"]
    assert not [i for i in clean["applied"] if i.startswith("Consistent/replicated:")]
    found = check_facts(Loop(seed="other", bugs={"replica_step"}, bug_step=3, **names).run(), invariants)["violations"]
    assert {(v["invariant_id"], v["rank"]) for v in found} == {("Consistent/stable_replicated", None)}
    assert min(v["step"] for v in found) == 3  # (and every step after: the replicas stay apart)


def test_a_parameter_different_per_rank_from_the_start_is_never_asked_to_be_replicated(invariants):
    """A shard, or a parameter each rank keeps its own, differs at its first cross-rank observation:
    `stable_replicated` does not cover it (no violation, however it changes later)."""
    names = dict(params=("enc.weight", "enc.bias"), frozen=(), tied=(), world_size=2)
    report = check_facts(Loop(seed="own", bugs={"replica_step"}, bug_step=0, **names).run(), invariants)
    assert not [v for v in report["violations"] if v["invariant_id"] == "Consistent/stable_replicated"]


def test_a_run_that_never_clipped_is_not_asked_to_clip(invariants):
    report = check_facts(Loop(seed="noclip", clip=False, **SHAPE).run(), invariants)
    assert report["violations"] == []
    assert "EventContain/clip_kept" not in report["applied"]
