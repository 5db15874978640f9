"""The terminal report's reason lines name their rank when the runs hold several."""

from bitguard.backend.report import _said
from bitguard.backend.result import Reason


def test_a_reason_of_one_rank_of_several_is_led_by_its_rank():
    incomplete = Reason(code="incomplete", message="run B is incomplete: steps before 6 are compared", side="b", rank=1)
    assert _said(incomplete, [0, 1]) == "rank 1: run B is incomplete: steps before 6 are compared"
    assert _said(incomplete, [1]) == incomplete.message  # one rank: nothing to tell apart
    whole = Reason(code="collector_errors", message="run A's recording reported 1 collector error(s)", side="a")
    assert _said(whole, [0, 1]) == whole.message  # a reason of the whole run
    named = Reason(code="missing_ranks", message="rank 1 of run B is missing", side="b", rank=1)
    assert _said(named, [0, 1]) == named.message  # already says it


def test_propagation_hops_name_their_rank_when_the_runs_hold_several(tmp_path):
    """Two ranks diverging alike printed each hop twice, with nothing to tell them apart."""
    import bitguard
    from bitguard.backend.report import render_text
    from fixtures_runs import RunSpec, Taint, write_pair

    a, b = write_pair(str(tmp_path), "pair", RunSpec(world_size=2, taints=(Taint(1, "model.layers.1"),)),
                      RunSpec(world_size=2))
    hops = [line.strip() for line in render_text(bitguard.compare(a, b)).splitlines() if " via " in line]
    assert hops and all(h.startswith(("rank 0: ", "rank 1: ")) for h in hops), hops
    assert len(set(hops)) == len(hops)


def test_a_blame_window_without_a_module_keeps_its_heading():
    """Its detail followed the API-difference lines at their indent and read as one of them."""
    from types import SimpleNamespace

    from bitguard.backend.report import _divergence

    fd = SimpleNamespace(
        cause="digest", fault_class="backward", rank=0, step=0, phase="backward", kind="module", boundary="MSELoss",
        module_type="MSELoss", call=0, blame="consumer", retyped=False, notes=[], tensors=[], stack=[], stack_b=None,
        api_differences=SimpleNamespace(model_dump=lambda: {"differences": [
            {"step": 0, "kind": "backward", "target": "loss", "call": 0, "field": "scaled_by", "a": None,
             "b": 65536.0}]}),
        blame_window=SimpleNamespace(module=None, excluding_children=[], detail="no enclosing module had identical "
                                                                               "inputs"))
    lines = _divergence(fd)
    at = lines.index("  blame window: none")
    assert lines[at + 1] == "    no enclosing module had identical inputs", lines


def test_a_value_difference_fed_by_a_structural_one_is_not_read_as_hardware():
    """Helper 44: after an edge dropped in one run (a structural difference), the first op both call
    whose output differs (a neighbour count) was read "multi_bit_flip: ... a hardware fault is likely"."""
    from bitguard.backend.report import render_drill

    then = {"op": "index_add_", "file": "/x/train.py", "line": 12, "function": "forward", "inputs_differ": True,
            "args_differ": False, "signature": {"kind": "multi_bit_flip", "reading": "2 elements differ: memory "
                                                "corruption or a hardware fault in a few words is likely"}}
    doc = {"verdict": "op_found", "window": {"boundary": "c1", "module_type": "Conv", "call": 0, "why": "w"},
           "boundary_pivot": {"step": 0, "rank": 0, "phase": "forward", "boundary": "c1", "blame": "source"},
           "replay": {"detail": "reproduced"}, "records": {"a": "ra", "b": "rb"},
           "op_pivot": {"op": "getitem", "file": "/x/train.py", "line": 19, "function": "forward", "chain": ["Net"],
                        "cause": "structure", "side_only": "b", "other_side": [], "then": then}}
    text = render_drill(doc)
    line = next(x for x in text.splitlines() if x.startswith("  then"))
    assert "hardware" not in line and "follows from the structural difference above" in line, line
    then["inputs_differ"] = False  # (its inputs equal: the pattern is the reading)
    assert "hardware fault" in render_drill(doc)


def test_the_same_function_at_the_same_line_through_another_module_is_said_so():
    """Helper 76 (peft's set_adapter at a step): the drill said "run A alone calls torch.nn.functional.linear (run B
    calls torch.nn.functional.linear (layer.py:1102) ... there)": the same op at the same line, reached through
    lora_A.default in one run and lora_A.b in the other."""
    from bitguard.backend.report import render_drill

    where = {"op": "torch.nn.functional.linear", "file": "/x/layer.py", "line": 1102, "function": "forward"}
    doc = {"verdict": "op_found", "window": {"boundary": "q", "module_type": "Linear", "call": 0, "why": "w"},
           "boundary_pivot": {"step": 2, "rank": 0, "phase": "forward", "boundary": "q", "blame": "structure"},
           "replay": {"detail": "reproduced"}, "records": {"a": "ra", "b": "rb"},
           "op_pivot": {**where, "chain": ["q"], "cause": "structure", "side_only": "a", "modules": ["q", "q.lora_A.default"],
                        "other_side": [{**where, "modules": ["q", "q.lora_A.b"]}]}}
    line = next(x for x in render_drill(doc).splitlines() if x.startswith("  cause"))
    assert line == ("  cause    structure: run A calls it through q.lora_A.default, run B calls the same function at "
                    "the same line through q.lora_A.b there: the same code reached through another module (an adapter "
                    "or a branch switched)"), line

def test_a_pair_of_equal_keys_the_loose_pass_made_is_not_said_to_be_retyped():
    """Helper 57 (PPO with a minibatch dropped): after the pivot, an event paired by the loose pass although its
    full key was the same in both runs was said to be paired across "tensors of another dtype"; those tensors had
    the same types. Only a pair whose keys differ is a change of type."""
    from types import SimpleNamespace

    import polars as pl

    from bitguard.backend.rank_summary import _reasons

    events = pl.DataFrame({"seq": [0, 1], "key": [11, 22], "phase": ["forward"] * 2, "kind": ["module"] * 2,
                           "boundary": ["m", "n"], "module_type": ["Linear"] * 2, "step": [3, 3]},
                          schema_overrides={"key": pl.UInt64})
    other = events.with_columns(pl.Series("key", [11, 23], dtype=pl.UInt64))
    for b_events, retyped in ((events, []), (other, ["retyped"])):
        pairs = pl.DataFrame({"a_pos": [0, 1], "b_pos": [0, 1], "retyped": [True, True], "resigned": [False, False],
                              "status": ["identical"] * 2, "rule_id": [None, None]},
                             schema_overrides={"rule_id": pl.String})
        rc = SimpleNamespace(rank=0, pairs=pairs, events_a=events, events_b=b_events, diffs=pl.DataFrame())
        got = [r["code"] for r in _reasons(rc)]
        assert got == retyped, got
