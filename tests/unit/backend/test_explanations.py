"""What a pivot's explanation says where helpers found it wrong or silent: a `params` pivot's new
parameters apart from those an optimizer stepped (whatever root names them; backend/params_blame.py),
a forward whose buffers alone differ (backend/pivot.py), and a drill whose replay failed (backend/drill.py)."""

from __future__ import annotations

import polars as pl

from bitguard.backend.params_blame import params_detail as _params_detail


def _detail(stepped: list[str], differing: str) -> str:
    events = pl.DataFrame({"seq": list(range(len(stepped))) + [9], "phase": ["optimizer"] * (len(stepped) + 1),
                           "kind": ["step"] * len(stepped) + ["params"], "boundary": stepped + ["actor"]})
    diffs = pl.DataFrame({"a_seq": [9, 9], "role": ["param", "param"], "path": [f".{differing}", ".other"],
                          "differs": [True, False]})
    return _params_detail({"seq": 9, "call": 0, "step": 3}, events, diffs)


def test_a_parameter_stepped_under_its_model_s_name_is_not_new():
    """Helper 18: PPO calls `agent.actor` alone: its params event names `2.weight`, its optimizer events
    `actor.2.weight`, and a weight Adam had stepped every step was said to be new to the training."""
    assert _detail(["actor.2.weight"], "2.weight").startswith("the parameters differ at the start of this step "
                                                             "although every optimizer step before matched")
    assert _detail(["actor.0.weight"], "2.weight").startswith("2.weight differs at the start of this step, and no "
                                                             "optimizer step before updated them")


def test_weights_that_differ_at_a_first_call_after_another_model_ran_may_be_a_momentum_update():
    """Helper 48 (MoCo, BYOL): the key encoder, updated from the query encoder's weights at the start of
    each step, differs at its first call in step 0 with another momentum: that was worded as an
    initialisation only. Said too where another model ran before it in the step."""
    def detail(before: list[str]) -> str:
        events = pl.DataFrame({"seq": list(range(len(before))) + [9], "phase": ["forward"] * len(before) + ["optimizer"],
                               "kind": ["module"] * len(before) + ["params"], "boundary": before + ["key"],
                               "step": [0] * (len(before) + 1)})
        diffs = pl.DataFrame({"a_seq": [9], "role": ["param"], "path": [".0.weight"], "differs": [True]})
        return _params_detail({"seq": 9, "call": 0, "step": 0, "boundary": "key"}, events, diffs)

    assert detail([]).endswith("(the initialisation, its seed, a loaded checkpoint, weights copied in)")
    assert detail(["query", "query.0"]).endswith("a momentum or EMA update at the start of a step, as MoCo's and "
                                                 "BYOL's key encoders are, with another momentum)")


def test_a_forward_pivot_whose_buffers_alone_differ_says_where_they_may_have_changed():
    """Helper 18: SAC's `actor.action_scale` edited between steps made the actor's forward the pivot, every
    input and output equal, with no word of why: only its buffers differ."""
    from bitguard.backend.pivot import blame

    diffs = pl.DataFrame({"a_seq": [5, 5, 5], "role": ["input", "output", "state"], "idx": [0, 1, 2],
                          "differs": [False, False, True], "ignored": [False, False, False]})
    events = pl.DataFrame({"seq": [5], "phase": ["forward"], "kind": ["module"], "boundary": ["actor"], "step": [3]})
    pivot = {"seq": 5, "phase": "forward", "kind": "module", "boundary": "actor", "step": 3, "call": 0, "depth": 0}
    got = blame(pivot, events, {}, diffs)
    assert (got["blame"], got["fault_class"]) == ("source", "forward")
    assert got["blame_window"]["detail"].startswith("only this module's buffers differ after its call"), got


def test_a_replay_that_failed_says_so_first_and_where_its_output_is(tmp_path):
    """Helper 19: a drill's replay that crashed on an import (an environment variable not recorded) was
    reported as one that "never called the window module"."""
    from types import SimpleNamespace

    from bitguard.backend.drill import _not_reproduced
    from bitguard.backend.replay import REPLAY_LOG

    (tmp_path / f"a.{REPLAY_LOG}").write_text("Traceback ...\nModuleNotFoundError: No module named 'tensorflow'\n")
    replays = [SimpleNamespace(side="a", exit_status=1, timed_out=False, out=tmp_path / "a"),
               SimpleNamespace(side="b", exit_status=0, timed_out=False, out=tmp_path / "b")]
    checks = {s: {"reproduced": s == "b", "compared": 0, "detail": "no event compared", "notes": []} for s in "ab"}
    detail = _not_reproduced(replays, checks, ["run A's replay never called the window module in the step"])["detail"]
    assert "(run A's replay failed with exit status 1: Traceback ... | ModuleNotFoundError: No module named " \
           "'tensorflow' (its output: " in detail, detail
    assert detail.count("tensorflow") == 1  # (not repeated as what the replay said)


def test_a_source_pivot_with_an_input_that_could_not_be_observed_does_not_say_its_inputs_matched():
    """Helper 49 (PyG, a CSR adjacency or PyG's Index as a layer's input): the pivot was blamed on the
    layer's own code, "its inputs matched", while the input that differed could not be digested."""
    from bitguard.backend.pivot import blame

    diffs = pl.DataFrame({"a_seq": [5, 5, 5], "role": ["input", "input", "output"], "idx": [0, 1, 2],
                          "path": ["[0]", "[1]", ""], "differs": [False, False, True], "ignored": [False] * 3,
                          "unobserved": [None, "torch.sparse_csr layout", None],
                          "unobserved_b": [None, "torch.sparse_csr layout", None]})
    events = pl.DataFrame({"seq": [5], "phase": ["forward"], "kind": ["module"], "boundary": ["c1"], "step": [2],
                           "depth": [1], "t_start_ns": [0], "t_end_ns": [1]})
    pivot = {"seq": 5, "phase": "forward", "kind": "module", "boundary": "c1", "step": 2, "call": 0, "depth": 1,
             "t_start_ns": 0, "t_end_ns": 1}
    got = blame(pivot, events, {}, diffs)
    assert got["blame"] == "source" and got["blame_window"]["detail"].startswith(
        "of its inputs, input[1] could not be observed"), got


def test_a_backward_drill_s_first_input_that_differs_is_said_to_be_the_gradient_arriving():
    """Helper 51 (a loss's targets shifted outside the model): drilled into the model's backward, the
    first differing op's input was said "written outside torch functions or came from outside (a
    parameter, a global)", never the gradient arriving from the loss."""
    from bitguard.backend import opdiff
    from bitguard.backend.drill import Window, _entered

    d = opdiff.OpDifference(cause="digest", side_only=None, index_a=3, index_b=3, op_a={}, op_b={},
                            inputs=[{"index": 0, "differs": True}], outputs=[], inputs_differ=True, args_differ=False,
                            other_side=[], paired_before=3)
    window = Window(rank=0, step=0, boundary="Sequential", module_type="Sequential", call=0, why="", seq_a=1, seq_b=1,
                    phase="backward")
    assert "the gradient arriving at Sequential's output from after it (the loss" in _entered(d, window)
    window.phase = "forward"
    assert "came into the window from outside it" in _entered(d, window)


def test_weights_one_run_keeps_apart_and_the_other_shares_with_the_trained_model_are_said_to_be():
    """Helper 51 (a DPO reference made by copy.copy(model)): run B's reference shares the policy's
    parameters, which the optimizer steps; they were said to be "not the trained parameters but a copy"."""
    events = pl.DataFrame({"seq": [1, 2, 9], "phase": ["optimizer"] * 3, "kind": ["params", "step", "params"],
                           "boundary": ["ref", "fc.weight", "ref"], "step": [0, 0, 1], "call": [0, 0, 0]})
    tensors_a = pl.DataFrame({"seq": [1, 2, 9], "role": ["param"] * 3, "tid": [100, -1, 100]})
    tensors_b = pl.DataFrame({"seq": [1, 2, 9], "role": ["param"] * 3, "tid": [-1, -1, -1]})
    diffs = pl.DataFrame({"a_seq": [9], "role": ["param"], "path": [".fc.weight"], "differs": [True]})
    pivot = {"seq": 9, "b_seq": 9, "call": 0, "step": 1, "boundary": "ref", "module_type": "Net"}
    got = _params_detail(pivot, events, diffs, tensors_a, 0, events, tensors_b)
    assert "in run A they are a copy kept beside the trained parameters" in got and "copy.copy()" in got, got
    assert "they are not the trained parameters but a copy" in _params_detail(pivot, events, diffs, tensors_a, 0,
                                                                                events, tensors_a)


def test_a_final_state_taken_mid_run_is_a_model_let_go_of_not_the_run_s_end():
    """Helper 52: a model rebuilt and loaded in the same process (an in-process resume): the old model's
    final state, taken when the script let go of it, read as "run B ends here"."""
    from bitguard.backend.pivot import structure_blame

    events = pl.DataFrame({"seq": [1, 2, 3, 4], "phase": ["forward", "optimizer", "optimizer", "forward"],
                           "kind": ["module", "final", "params", "module"], "step": [2, 2, 2, 2],
                           "boundary": ["Linear", "Linear", "Linear#2", "Linear#2"], "call": [0] * 4})
    final = {"seq": 2, "phase": "optimizer", "kind": "final", "boundary": "Linear", "step": 2, "call": 0}
    got = structure_blame(final, "b", events, None)
    assert got["blame_window"]["detail"].startswith("run B took the final state of Linear (call 0) at step 2 mid-run, "
                                                    "when the training let go of that model"), got
    ended = structure_blame(final, "b", events.filter(pl.col("seq") <= 2), None)
    assert ended["blame_window"]["detail"].startswith("run B's recording ends here"), ended


def test_an_update_that_differs_with_its_inputs_matched_may_be_an_edit_before_step():
    """Helper 52 (open_clip's logit_scale clamp put before opt.step()): the weight edited between
    backward() and step() was blamed on the optimizer's computation or state alone."""
    from bitguard.backend.pivot import _optimizer_detail

    events = pl.DataFrame({"seq": [1, 2], "boundary": ["w", "w"], "phase": ["optimizer", "backward"],
                           "kind": ["step", "grad"], "step": [1, 2]})
    used = pl.DataFrame({"differs": [False], "ignored": [False], "unknown": [False]})
    got = _optimizer_detail({"boundary": "w", "step": 2}, events, {1: "identical", 2: "identical"}, used)
    assert got.startswith("the parameter differs after step() while the gradient step() used and the previous "
                          "parameters matched") and "a clamp or an edit under no_grad or through .data between " \
                                                    "backward() and step()" in got, got


def test_a_new_wrapper_around_trained_weights_is_not_a_newly_initialised_model():
    """Helper 53 (torchdiffeq wraps the ODE function in a new module at every odeint call): a `.data`
    edit of the trained weights was said to be a model made since and initialised differently."""
    events = pl.DataFrame({"seq": [1, 2, 9, 10], "phase": ["optimizer"] * 4, "kind": ["params", "step", "params", "step"],
                           "boundary": ["W#2", "0.weight", "W#3", "0.weight"], "step": [1, 1, 2, 2], "call": [0] * 4})
    tensors = pl.DataFrame({"seq": [1, 2, 9, 10], "role": ["param"] * 4, "tid": [-5] * 4})
    diffs = pl.DataFrame({"a_seq": [9], "role": ["param"], "path": [".0.weight"], "differs": [True]})
    pivot = {"seq": 9, "call": 0, "step": 2, "boundary": "W#3", "module_type": "W"}
    got = _params_detail(pivot, events, diffs, tensors, 0, events, tensors)
    assert got.startswith("the parameters differ at the start of this step although every optimizer step before "
                          "matched"), got


def test_a_backward_pivot_with_no_observed_module_after_it_is_not_blamed_on_the_data_pipeline():
    """Helper 53 (trusted mode, the ODE's end time changed): the gradient from the loss, reaching a
    module whose root's backward trusted mode does not observe, was said to come from "the data
    pipeline"."""
    from bitguard.backend.pivot import _window

    events = pl.DataFrame({"seq": [5], "phase": ["backward"], "kind": ["module"], "boundary": ["net.0"], "step": [0],
                           "depth": [1]})
    diffs = pl.DataFrame({"a_seq": [5], "role": ["grad_output"], "differs": [True], "ignored": [False]})
    got = _window({"seq": 5, "phase": "backward", "boundary": "net.0", "step": 0, "depth": 1}, events, {}, diffs)
    assert got["module"] is None and got["detail"].startswith("the gradient reaching it already differs, and no "
                                                              "observed module after it received a matching one"), got


def test_a_parameter_s_accumulation_drilled_names_its_other_uses():
    """Helper 69 (an EWC penalty outside the model): drilled into the module, the first differing op was the
    parameter's AccumulateGrad, said to come from the gradient arriving at the module's output, which
    `compare` had shown matched; what it sums is every use of the parameter, a penalty in the loss among them."""
    from bitguard.backend import opdiff
    from bitguard.backend.drill import Window, _entered

    d = opdiff.OpDifference(cause="digest", side_only=None, index_a=3, index_b=3,
                            op_a={"node": "torch::autograd::AccumulateGrad", "param": "0.bias"}, op_b={},
                            inputs=[{"index": 0, "differs": True}], outputs=[], inputs_differ=True, args_differ=False,
                            other_side=[], paired_before=3)
    window = Window(rank=0, step=0, boundary="0", module_type="Linear", call=0, why="", seq_a=1, seq_b=1,
                    phase="backward")
    said = _entered(d, window)
    assert "summing the gradients of 0.bias from each of its uses" in said and "EWC penalty" in said, said


def test_an_accumulation_into_a_grad_that_differs_alone_is_read_as_a_missed_zero_grad():
    """Helper 75 (fastai zeroes .grad in place, so both runs add into it; a zero_grad skipped after step 2): drilled,
    the first differing op was head.bias's `aten.add_` whose input 0 (the .grad added into) differed and input 1 (the
    new gradient) matched, and the note spoke of the parameter's other uses."""
    from bitguard.backend import opdiff
    from bitguard.backend.drill import Window, _entered

    d = opdiff.OpDifference(cause="digest", side_only=None, index_a=3, index_b=3,
                            op_a={"node": "torch::autograd::AccumulateGrad", "param": "head.bias", "op": "aten.add_.Tensor"},
                            op_b={}, inputs=[{"index": 0, "differs": True}, {"index": 1, "differs": False}], outputs=[],
                            inputs_differ=True, args_differ=False, other_side=[], paired_before=3)
    window = Window(rank=0, step=3, boundary="head", module_type="Linear", call=0, why="", seq_a=1, seq_b=1,
                    phase="backward")
    said = _entered(d, window)
    assert "the .grad of head.bias that autograd adds the new gradient into, differs while the new gradient matches" \
        in said and "missed zero_grad()" in said, said
