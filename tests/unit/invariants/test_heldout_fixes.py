"""The engine defects the held-out evaluation revealed (docs/INVARIANTS.md, 'Held-out evaluation'),
each on the smallest facts that show it: a step with a second root module (an EMA copy evaluated
before the training forward), a disabled GradScaler, an update below the parameter's last bit at
a tiny learning rate, and a first step without zero_grad (nanoGPT zeroes after the step)."""

import json

from bitguard.backend.invariants.check import Checker, parse_invariants
from bitguard.backend.invariants.facts import step_facts
from bitguard.backend.invariants.infer import infer
from bitguard.backend.invariants.templates import Observer, context


def _row(ord_, kind, target, value, step=1):
    return {"step": step, "rank": 0, "ord": ord_, "kind": kind, "target": target, "value": json.dumps(value), "t_ns": ord_}


def _params(*names, requires_grad=True):
    return {n: {"requires_grad": requires_grad, "dtype": "float32", "xor": "00000000000000aa", "storage": i}
            for i, n in enumerate(names)}


def test_the_trained_root_is_the_one_the_optimizer_steps_not_the_first_called():
    api = [_row(0, "params", "AveragedModel", _params("module.w", "module.b")),  # the EMA, evaluated first
           _row(1, "params", "Model", _params("w", "b")),
           _row(2, "zero_grad", "SGD#0", {"set_to_none": True, "params": ["w", "b"]}),
           _row(3, "backward", "loss", {"value": 1.0, "calls_in_step": 1}),
           _row(4, "optimizer_step", "SGD#0", {"groups": [{"lr": 0.1, "params": ["w", "b"]}]})]
    facts = step_facts(api, [], [])
    assert set(facts.params) == {"w", "b"} and facts.params_row()["target"] == "Model"
    # the EMA's parameters require grad and are in no param group: no longer read as the model's
    found = Checker(parse_invariants(_in_optimizer_doc())).check_step(facts)
    assert found == []
    alone = step_facts([r for r in api if r["target"] != "Model"], [], [])
    assert set(alone.params) == {"module.w", "module.b"}  # one root: that one, whatever the optimizer


def _in_optimizer_doc():
    return {"schema": "bitguard.invariants/1", "inferred_from": ["x"], "dropped": [], "invariants": [
        {"id": "Consistent/in_optimizer", "template": "Consistent", "names": ["*"], "relation": "r",
         "precondition": [], "support": 9, "runs": 1, "params": {"key": "in_optimizer", "kind": "holds",
                                                                "expected": True}}]}


def test_a_disabled_grad_scaler_is_no_loss_scaling():
    def amp_of(enabled):
        api = [_row(0, "loss_scale", "GradScaler#0", {"scale": 1.0, "enabled": enabled}),
               _row(1, "optimizer_step", "AdamW#0", {"groups": [{"lr": 0.1, "params": []}]})]
        return context(step_facts(api, [], []), {})["amp"]

    assert amp_of(False) is False and amp_of(True) is True


def _update_step(step, lr, before, after):
    """A training step of one parameter `w` the optimizer steps at `lr`: (xor, pos) before and after."""
    api = [_row(0, "params", "Model", {"w": {"requires_grad": True, "dtype": "float32", "xor": f"{before[0]:016x}",
                                             "pos": f"{before[1]:016x}", "storage": 0}}, step),
           _row(1, "optimizer_step", "SGD#0", {"groups": [{"lr": lr, "params": ["w"]}]}, step)]
    t = lambda seq, role, xor, pos: {"seq": seq, "role": role, "idx": 0, "xor": xor, "pos": pos,  # noqa: E731
                                     "dtype": "float32", "shape": [4], "unobserved": None}
    events = [{"seq": 1, "rank": 0, "world_size": 1, "step": step, "phase": "optimizer", "kind": "step",
               "boundary": "w", "depth": 0}]
    return step_facts(api, events, [t(1, "param", *after), t(1, "grad", 5, 6)])


def test_changes_at_step_is_held_to_the_learning_rates_it_was_seen_at():
    clean = {"a": {0: [_update_step(s, 0.05, (s + 1, s + 1), (s + 2, s + 2)) for s in range(5)]}}
    inv = {i["id"]: i for i in infer(clean)["invariants"]}["Update/changes_at_step"]
    assert {"feature": "lr_decade", "op": "==", "value": -2} in [
        {k: c[k] for k in ("feature", "op", "value")} for c in inv["precondition"]]
    # OneCycleLR's last step (lr 2e-7): an update below the last bit leaves the parameter as it was
    tiny = [_update_step(0, 0.05, (1, 1), (2, 2)), _update_step(1, 2e-7, (2, 2), (2, 2))]
    checker = Checker(parse_invariants(infer(clean)))
    assert [v for f in tiny for v in checker.check_step(f) if v.invariant_id == "Update/changes_at_step"] == []
    stuck = [_update_step(0, 0.05, (1, 1), (2, 2)), _update_step(1, 0.05, (2, 2), (2, 2))]
    checker = Checker(parse_invariants(infer(clean)))
    assert [v.step for f in stuck for v in checker.check_step(f) if v.invariant_id == "Update/changes_at_step"] == [1]


def test_the_first_step_needs_no_zero_grad_before_its_backward():
    def step(s, zero):
        api = ([_row(0, "zero_grad", "AdamW#0", {"set_to_none": True, "params": ["w"]}, s)] if zero else []) + [
            _row(1, "backward", "loss", {"value": 1.0, "calls_in_step": 1}, s),
            _row(2, "optimizer_step", "AdamW#0", {"groups": [{"lr": 0.1, "params": ["w"]}]}, s)]
        return step_facts(api, [], [])

    observer = Observer()
    seen = [[o.value for _, o in observer.step(f) if o.key == "zero_grad_before_backward"]
            for f in (step(0, False), step(1, True), step(2, False))]  # nanoGPT's order: zero_grad after step()
    assert seen == [[], [True], [False]]
