"""The first differing op of two op traces (backend/opdiff.py), on made-up traces."""

import pytest

from bitguard.backend.opdiff import differences, first_difference, first_value_difference


def op(name, out, function="forward", inputs=("i",), args="(<t0>)"):
    tensor = lambda d: {"shape": [2], "dtype": "float32", "xor": d, "pos": d}  # noqa: E731
    return {"op": name, "function": function, "modules": ["m"], "file": "/x/model.py", "line": len(name),
            "inputs": [tensor(d) for d in inputs], "outputs": [tensor(out)], "args": args}


A = [op("linear", "1"), op("gelu", "2", inputs=("1",)), op("add", "3", inputs=("2",))]


def test_equal_traces_have_no_difference():
    assert first_difference(A, [dict(o) for o in A]) is None


def test_an_op_whose_inputs_are_equal_and_output_differs():
    b = [A[0], op("gelu", "9", inputs=("1",)), op("add", "8", inputs=("9",))]
    d = first_difference(A, b)
    assert (d.cause, d.op["op"], d.index_a, d.index_b, d.inputs_differ, d.args_differ) == \
        ("digest", "gelu", 1, 1, False, False)
    assert d.first_output == 0 and d.paired_before == 1


def test_other_arguments_are_part_of_the_inputs():
    b = [A[0], op("gelu", "9", inputs=("1",), args="(<t0>, approximate='tanh')"), A[2]]
    d = first_difference(A, b)
    assert d.args_differ and not d.inputs_differ


def test_an_op_run_a_alone_has_names_what_run_b_runs_there():
    b = [A[0], op("matmul", "5", inputs=("1",)), op("softmax", "6", inputs=("5",)), A[2]]
    a = [A[0], op("sdpa", "4", inputs=("1",)), A[2]]
    d = first_difference(a, b)
    assert (d.cause, d.side_only, d.op["op"]) == ("structure", "a", "sdpa")
    assert [o["op"] for o in d.other_side] == ["matmul", "softmax"]
    assert d.outputs[0]["a"]["xor"] == "4" and d.outputs[0]["b"] is None
    assert d.inputs[0]["a"]["xor"] == "1"


def test_an_op_run_b_alone_has_before_a_paired_op_comes_first():
    b = [A[0], op("clone", "7", inputs=("1",)), A[1], A[2]]
    d = first_difference(A, b)
    assert (d.cause, d.side_only, d.op["op"], d.index_b) == ("structure", "b", "clone", 1)


def test_an_op_called_in_another_order_with_another_output_is_where_the_orders_part():
    """Helper 71: B's norm_first layer norm runs before the attention, A's after it: the alignment's
    reorder pass paired the two layer norms, and the first difference named was the attention's first
    op, its inputs differing with no op before said to differ. An op moved whose output differs is a
    structural difference where it runs first, saying where the other run calls it."""
    attn = [op("transpose", "2", inputs=("1",)), op("mha", "3", inputs=("2",)), op("add", "4", inputs=("3",))]
    a = [A[0], *attn, op("layer_norm", "5", inputs=("4",))]
    b = [A[0], op("layer_norm", "6", inputs=("1",)), op("transpose", "7", inputs=("6",)),
         op("mha", "8", inputs=("7",)), op("add", "9", inputs=("8",))]
    d = first_difference(a, b)
    assert (d.cause, d.side_only, d.op["op"], d.index_b) == ("structure", "b", "layer_norm", 1), d
    assert (d.moved["index"], d.moved["op"]) == (4, "layer_norm")
    # moved with the same output (independent ops swapped): paired as before, no difference
    c = [A[0], op("layer_norm", "5", inputs=("4",)), *attn]
    assert first_difference(a, c) is None


def test_after_a_structural_difference_the_first_value_difference_is_where_the_streams_join():
    b = [A[0], op("clone", "7", inputs=("1",)), A[1], op("add", "8", inputs=("2",))]
    kinds = [(d.cause, d.op["op"]) for d in differences(A, b)]
    assert kinds == [("structure", "clone"), ("digest", "add")]
    v = first_value_difference(A, b)
    assert (v.op["op"], v.index_a, v.index_b) == ("add", 2, 3)


def test_the_same_op_called_from_another_function_pairs():
    """A forward monkeypatched by another function calls the same ops: they pair by op, module and
    shapes, and their digests say whether they compute the same (a trial on Llama's MLP)."""
    b = [op("linear", "1", function="_patched_forward"), op("gelu", "2", inputs=("1",), function="_patched_forward"),
         op("sigmoid", "5", inputs=("2",), function="_patched_forward")]
    d = first_difference(A, b)
    assert (d.cause, d.op["op"], d.side_only) == ("structure", "add", "a")
    assert [o["op"] for o in d.other_side] == ["sigmoid"]


def test_an_accumulate_grad_that_adds_on_one_side_reads_as_a_missed_zero_grad():
    from bitguard.backend.drill import _accumulation

    node = "torch::autograd::AccumulateGrad"
    a = [dict(op("aten.detach.default", "1"), node=node)]
    b = [dict(op("aten.add_.Tensor", "2", inputs=("i", "g")), node=node)]
    d = first_difference(a, b)
    assert d.cause == "structure" and "run B adds the new gradient into an existing .grad" in _accumulation(d)
    assert _accumulation(first_difference(A, [A[0], op("gelu", "9", inputs=("1",)), A[2]])) is None


def test_a_command_without_a_script_cannot_be_replayed_and_says_so():
    """A `python -c` (notebook-like) recording's manifest command has no .py file."""
    import pytest

    from bitguard.backend.replay import _script_and_args
    from bitguard.errors import NotSupported

    with pytest.raises(NotSupported, match="not supported yet: replaying '-c'"):
        _script_and_args(["-c"])
    assert _script_and_args(["python", "-u", "train.py", "--lr", "1"]) == (["-u"], "train.py", ["--lr", "1"])
    assert _script_and_args(["train.py"]) == ([], "train.py", [])


def test_a_replay_directory_is_emptied_of_an_earlier_drill_and_anything_else_is_refused(tmp_path):
    """An earlier drill's replay of the same step left its rank file and op trace: a replay stopped
    early must not be read as having written them (backend/drill.py `_clear`)."""
    from bitguard.backend.drill import _clear
    from bitguard.errors import BadInput

    replay = tmp_path / "step-1-rank-0"
    (replay / "ops-rank-0").mkdir(parents=True)
    for name in ("manifest.json", "rank-0.duckdb", "ops-rank-0.json", "ops-rank-0/t0.bin"):
        (replay / name).write_text("earlier")
    _clear(replay)
    assert replay.is_dir() and not list(replay.iterdir())
    (replay / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match="holds files a drill did not write"):
        _clear(replay)
    assert (replay / "notes.txt").read_text() == "mine"
    _clear(tmp_path / "new")
    assert (tmp_path / "new").is_dir()


def test_ops_run_b_alone_before_the_same_op_at_the_same_line_come_first():
    """Helper 44: an extra `ei[:, :-1]` in B made B's next op read other shapes: the two did not pair,
    and "run A alone calls __getitem__" was said of A's op, B's extra line only in parentheses."""
    def at(name, out, line, shape, modules=("m", "conv")):
        o = op(name, out)
        o["line"], o["modules"], o["inputs"] = line, list(modules), [dict(t, shape=shape) for t in o["inputs"]]
        return o

    a = [A[0], at("getitem", "5", 11, [2, 90]), A[2]]
    b = [A[0], at("getitem", "6", 19, [2, 90], modules=("m",)), at("getitem", "7", 11, [2, 89]), A[2]]
    d = first_difference(a, b)
    assert (d.cause, d.side_only, d.op["op"], d.op["line"], d.index_b) == ("structure", "b", "getitem", 19, 1), d
    # (A's op at that line, with its other shapes, is the next difference; where B has no op at A's line, A's is first)
    assert [(x.side_only, x.op["line"]) for x in differences(a, b)][:2] == [("b", 19), ("a", 11)]
    c = [A[0], at("getitem", "6", 19, [2, 90], modules=("m",)), at("mul", "7", 12, [2, 89]), A[2]]
    assert (first_difference(a, c).side_only, first_difference(a, c).op["line"]) == ("a", 11)
