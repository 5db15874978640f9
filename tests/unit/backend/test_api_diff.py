"""The training API calls that differ between two runs up to the pivot's step (backend/api_diff.py):
configured values found, computed ones left out, calls made in one run only, runs without API events."""

import json

from bitguard.backend import api_diff
from bitguard.backend.ingest import open_run
from bitguard.backend.result import ApiDifferences
from invariant_loops import Loop, write_run


def _diff(tmp_path, a: Loop, b: Loop, step: int, **kw):
    ra = open_run(write_run(tmp_path, a, name="a", **kw))
    rb = open_run(write_run(tmp_path, b, name="b"))
    return api_diff.differences(ra, rb, 0, step)


def test_identical_loops_have_no_difference(tmp_path):
    got = _diff(tmp_path, Loop(seed="a"), Loop(seed="a"), step=5)
    assert got == {"available": True, "differences": [], "more": 0, "missing": []}


def test_computed_values_are_not_differences(tmp_path):
    # another seed: other batches, gradients, losses and parameter digests, the same configuration
    got = _diff(tmp_path, Loop(seed="a"), Loop(seed="b"), step=5)
    assert got["differences"] == []


def test_clipping_on_the_wrong_parameters_is_named_at_its_first_step(tmp_path):
    got = _diff(tmp_path, Loop(), Loop(bugs={"clip_wrong_params"}), step=3)
    first = got["differences"][0]
    assert (first["step"], first["kind"], first["field"]) == (0, "clip_grad_norm", "params")
    assert first["a"] == list(Loop().params) and first["b"] == list(Loop().params[:2])
    text = "\n".join(api_diff.lines(got))
    assert "clip_grad_norm (clip): params: only in A [h.0.bias, head.weight]" in text


def test_a_call_made_in_one_run_only_and_a_learning_rate(tmp_path):
    got = _diff(tmp_path, Loop(), Loop(bugs={"no_zero_grad", "no_scheduler_step"}), step=1)
    rows = {(d["step"], d["kind"], d["field"]): (d["a"], d["b"]) for d in got["differences"]}
    assert rows[(0, "zero_grad", None)] == ("called", "not called")
    assert rows[(1, "scheduler_step", None)] == ("called", "not called")
    lr_a, lr_b = rows[(1, "optimizer_step", "groups[0].lr")]
    assert abs(lr_a - 0.09) < 1e-12 and lr_b == 0.1
    assert all(step <= 1 for step, _, _ in rows)  # nothing after the pivot's step


def test_eval_mode_lists_what_moved(tmp_path):
    got = _diff(tmp_path, Loop(), Loop(bugs={"dropout_eval"}), step=0)
    text = "\n".join(api_diff.lines(got))
    assert "modes (Model): training: only in A [h.0.drop]" in text and "modes (Model): eval: only in B [h.0.drop]" in text


def test_a_run_without_api_events_is_unavailable_not_equal(tmp_path):
    got = _diff(tmp_path, Loop(), Loop(), step=5, api_events=False)
    assert got["available"] is False and got["missing"] == ["a"] and api_diff.lines(got) == []


def test_the_same_difference_at_every_step_is_one_entry(tmp_path):
    """Helper 44: one line a step for the same difference filled the list, and the cause at a later
    step was left out."""
    got = _diff(tmp_path, Loop(steps=14), Loop(steps=14, bugs={"no_zero_grad"}), step=14)  # steps 0-13 lack it
    assert [(d["step"], d["kind"], d["steps"]) for d in got["differences"]] == [(0, "zero_grad", list(range(14)))]
    assert got["more"] == 0
    assert api_diff.lines(got)[1].startswith("    steps 0-13: zero_grad (")


def test_many_differences_are_capped_and_counted(tmp_path):
    # a scheduler not stepped: a learning rate that differs by another value at every step
    got = _diff(tmp_path, Loop(steps=16), Loop(steps=16, bugs={"no_scheduler_step"}), step=16)
    assert len(got["differences"]) == api_diff.SHOWN and got["more"] > 0, got
    assert api_diff.lines(got)[-1].endswith(f"(--json lists the first {api_diff.SHOWN})")
    assert api_diff._steps([0, 1, 2, 5, 7, 8]) == "steps 0-2, 5, 7-8" and api_diff._steps([3]) == "step 3"


def test_compare_puts_them_under_the_pivot_in_the_json_and_the_report(tmp_path, capsys):
    from bitguard.cli import main

    a = write_run(tmp_path, Loop(), name="a")
    b = write_run(tmp_path, Loop(bugs={"clip_wrong_params"}), name="b")
    assert main(["compare", str(a), str(b), "--json"]) == 1
    fd = json.loads(capsys.readouterr().out)["first_divergence"]
    got = fd["api_differences"]
    assert got["available"] and got["differences"][0]["field"] == "params"
    assert all(d["step"] <= fd["step"] for d in got["differences"])
    assert main(["compare", str(a), str(b)]) == 1
    assert "training API calls that differ" in capsys.readouterr().out
    # the same script twice: a pivot elsewhere names no API difference
    c = write_run(tmp_path, Loop(bugs={"in_place_edit"}), name="c")
    assert main(["compare", str(a), str(c), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["first_divergence"]["api_differences"]["differences"] == []


def test_lists_are_shown_as_values_unless_told_apart_by_their_items():
    """Helper 48's MONAI reads: a read's shape [2, 1] against [2, 2, 1] was worded "the same items, in
    another order" (the lists compared as sets). Numbers, and items repeated a different number of
    times, are shown as they are; names by what one run has and the other lacks."""
    def line(field, a, b):
        (text,) = api_diff.lines({"differences": [{"step": 1, "kind": "read", "target": "numpy", "call": 0,
                                                    "field": field, "a": a, "b": b, "at": "t.py:7"}]}, header=False)
        return text.strip()

    assert line("shape", [2, 1], [2, 2, 1]) == "step 1: read (numpy) at t.py:7: shape [2, 1] (A) vs [2, 2, 1] (B)"
    assert line("training", ["a", "b"], ["a"]) == "step 1: read (numpy) at t.py:7: training: only in A [b]"
    assert line("training", ["a", "b"], ["b", "a"]) == "step 1: read (numpy) at t.py:7: training: the same items, in another order"
    assert line("training", ["a", "a"], ["a"]) == 'step 1: read (numpy) at t.py:7: training [a, a] (A) vs [a] (B)'


def test_a_comparison_reads_the_api_rows_with_the_events_opening_each_rank_file_once(tmp_path, monkeypatch):
    """A DuckDB connection costs 12 to 40 ms here, a tiny comparison 0.2 s: the API rows the result
    reads (its api_differences) come from the connection that read the rank's events, not another one,
    and that is the connection open_run checked the file through (ingest.py `held`)."""
    from pathlib import Path

    from bitguard import db
    from bitguard.backend.compare import compare

    a = write_run(tmp_path, Loop(), name="a")
    b = write_run(tmp_path, Loop(bugs={"no_zero_grad", "no_scheduler_step"}), name="b")
    opened, real = [], db.connect
    monkeypatch.setattr(db, "connect", lambda path, *args, **kw: opened.append(Path(path).parent.name)
                        or real(path, *args, **kw))
    fd = compare(a, b).to_dict()["first_divergence"]
    assert sorted(opened) == ["a", "b"], opened  # (open_run's check, held open for load_rank's read)
    rows = {(d["step"], d["kind"], d["field"]): (d["a"], d["b"]) for d in fd["api_differences"]["differences"]}
    assert rows[(0, "zero_grad", None)] == ("called", "not called"), rows


def test_reads_pair_by_the_line_that_read_them_not_by_their_order_in_the_step():
    """Helper 72: run B alone read a temperature with `.item()` one line before the loss both runs read:
    numbered in the step's order, A's loss was compared with B's temperature. B's reads pair with A's by
    line now, and the one B alone made is numbered after A's."""
    a = {5: {("read", "item", 0): {"value": 2.6}}}
    places_a = {(5, "read", "item", 0): "x.py:67", (5, "read", "item", 0, "value"): 2.6}
    b = {5: {("read", "item", 0): {"value": -0.7}, ("read", "item", 1): {"value": 2.6}}}
    places_b = {(5, "read", "item", 0): "x.py:66", (5, "read", "item", 0, "value"): -0.7,
                (5, "read", "item", 1): "x.py:67", (5, "read", "item", 1, "value"): 2.6}
    api_diff._reads_by_place(a, b, places_a, places_b)
    assert b == {5: {("read", "item", 0): {"value": 2.6}, ("read", "item", 1): {"value": -0.7}}}, b
    assert places_b[(5, "read", "item", 1)] == "x.py:66" and places_b[(5, "read", "item", 1, "value")] == -0.7
    assert places_b[(5, "read", "item", 0)] == "x.py:67"
    # the script edited above its reads: every line moved, the reads still pair, in order
    b = {5: {("read", "item", 0): {"value": 3.0}}}
    places_b = {(5, "read", "item", 0): "x.py:70", (5, "read", "item", 0, "value"): 3.0}
    api_diff._reads_by_place(a, b, places_a, places_b)
    assert b == {5: {("read", "item", 0): {"value": 3.0}}} and places_b[(5, "read", "item", 0)] == "x.py:70"


def test_the_calls_one_run_alone_makes_of_a_root_or_at_one_read_s_line_are_one_entry():
    """Helper 79 (torchsde, a smaller dt: the solver calls its networks more often): a line for each extra
    call of each root filled the list, and the rest was cut. Helper 81 (pytorch-forecasting, its dataset's
    `np.asarray` reads moved into DataLoader workers): about 130 lines of reads, one a call, led the list."""
    extra = [{"step": 2, "kind": "modes", "target": net, "call": call, "field": None, "a": "not called",
              "b": "called"} for net in ("f_net", "g_net") for call in range(21, 26)]
    reads = [{"step": 2, "kind": "read", "target": "array", "call": call, "field": None, "a": "called",
              "b": "not called", "at": at, "value": f"{call:016x}:0000000000000001", "steps": [2, 3]}
             for at, calls in (("ds.py:8", range(40)), ("ds.py:9", range(40, 42))) for call in calls]
    folded = api_diff._folded(extra + reads)
    assert [d.get("calls") for d in folded] == [5, 5, 40, 2], folded
    assert ApiDifferences(available=True, differences=folded, more=0).differences[2].calls == 40  # (the JSON's)
    text = api_diff.lines({"available": True, "differences": folded, "more": 0, "missing": []})
    assert text[1:] == [f"    step 2: root module {net}: run B calls it 5 times more in the step (its calls 21-25, "
                        f"counted from 0, are made in B only)" for net in ("f_net", "g_net")] + [
        '    steps 2-3: read (array) calls 0-39 at ds.py:8: called in A, not called in B (the first read '
        '"0000000000000000:0000000000000001" at step 2)',
        '    steps 2-3: read (array) calls 40-41 at ds.py:9: called in A, not called in B (the first read '
        '"0000000000000028:0000000000000001" at step 2)'], text
    assert api_diff._folded(reads[:1] + reads[2:3])[1].get("calls") is None  # (not one after another: apart)


def test_a_module_one_model_alone_has_is_not_read_as_a_mode_change():
    """Helper 82 (SpeechBrain, a LayerNorm in place of a BatchNorm whose module is `norm.norm`): "training: only
    in A [norm.norm]" read as if run B's were in eval mode; B's model has no such module."""
    rows_a = [{"step": 0, "rank": 0, "ord": 0, "kind": "modes", "target": "Model",
               "value": json.dumps({"training": ["norm", "norm.norm", "out"], "eval": []}), "t_ns": 0}]
    rows_b = [{**rows_a[0], "value": json.dumps({"training": ["norm", "out"], "eval": []})}]
    got = api_diff.differences(None, None, 0, 0, rows=(rows_a, rows_b))
    text = "\n".join(api_diff.lines(got))
    assert "training: only in A [norm.norm] (A's model alone has [norm.norm], in neither mode in the other)" in text, text
    assert ApiDifferences(**got).differences[0].only_a == ["norm.norm"]  # (a field of the compare JSON)


def test_a_kind_an_older_build_did_not_record_is_no_difference():
    """Helper 86 (a run recorded before `scheduler_settings` rows were): "scheduler_settings (ReduceLROnPlateau#0):
    not called in A, called in B" was listed among the API calls that differ."""
    row = {"step": 3, "rank": 0, "ord": 0, "kind": "scheduler_settings", "target": "ReduceLROnPlateau#0",
           "value": json.dumps({"class": "ReduceLROnPlateau", "state": {"patience": 4}}), "t_ns": 0}
    step = {**row, "kind": "optimizer_step", "target": "SGD#0", "value": json.dumps({"groups": [{"lr": 0.1}]})}
    older, newer = api_diff.recorded_by_both([step], [step, row])
    assert older == newer == [step]
    assert not api_diff.differences(None, None, 0, api_diff.EVERY_STEP, rows=(older, newer))["differences"]
    both = api_diff.recorded_by_both([step, row], [step, {**row, "value": row["value"].replace("4", "9")}])
    found = api_diff.differences(None, None, 0, api_diff.EVERY_STEP, rows=both)["differences"]
    assert [(d["kind"], d["field"], d["a"], d["b"]) for d in found] == [("scheduler_settings", "state.patience", 4, 9)]


def test_differences_of_a_step_are_listed_in_the_order_the_calls_were_made():
    """Helper 86 (torchmetrics, a metric's reset skipped): the first computed value that differs was said to be
    MeanSquaredError's, read after MulticlassAccuracy's, whose name sorts later; a call run B alone made is
    listed where B made it."""
    def read(target, value, ord_):
        return {"step": 4, "rank": 0, "ord": ord_, "kind": "read", "target": target,
                "value": json.dumps({"value": value, "at": f"m.py:{len(target)}"}), "t_ns": 0}

    rows_a = [read("MulticlassAccuracy.compute", 0.5, 62), read("MeanSquaredError.compute", 1.0, 63)]
    rows_b = [read("MulticlassAccuracy.compute", 0.6, 62), read("item", 3.0, 63), read("MeanSquaredError.compute", 2.0, 64)]
    found = api_diff.differences(None, None, 0, api_diff.EVERY_STEP, computed=True, rows=(rows_a, rows_b))
    assert [d["target"] for d in found["differences"]] == ["MulticlassAccuracy.compute", "MeanSquaredError.compute"]
    found = api_diff.differences(None, None, 0, api_diff.EVERY_STEP, rows=(rows_a, rows_b))
    assert [(d["target"], d["a"]) for d in found["differences"]] == [("item", "not called")], found
    assert api_diff._in_call_order({"a": 0, "c": 0}, {"b": 0, "a": 0, "d": 0, "c": 0, "e": 0}) == \
        ["b", "a", "d", "c", "e"]


def test_a_step_s_reads_come_after_its_calls_to_the_training_api():
    """Helpers 84 and 88 (MONAI's type conversions, torchaudio's masking: values read inside the library, after
    the cause changed them): a step's reads led the list of "the likely cause", before the lr that differed."""
    rows_a = [{"step": 3, "rank": 0, "ord": 0, "kind": "read", "target": "item",
               "value": json.dumps({"value": 1.0, "at": "lib.py:9"}), "t_ns": 0},
              {"step": 3, "rank": 0, "ord": 1, "kind": "optimizer_step", "target": "SGD#0",
               "value": json.dumps({"groups": [{"lr": 0.1}]}), "t_ns": 0}]
    rows_b = [rows_a[0], {**rows_a[0], "ord": 1, "value": json.dumps({"value": 2.0, "at": "lib.py:9"})},
              {**rows_a[1], "ord": 2, "value": json.dumps({"groups": [{"lr": 0.05}]})}]
    found = api_diff.differences(None, None, 0, api_diff.EVERY_STEP, rows=(rows_a, rows_b))["differences"]
    assert [(d["kind"], d["field"]) for d in found] == [("optimizer_step", "groups[0].lr"), ("read", None)], found
