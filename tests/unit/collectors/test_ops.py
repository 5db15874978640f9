"""collectors/ops.py and collectors/drill.py: the op trace of a drill window, recorded in-process.

A drill replay is an ordinary recording with env BITGUARD_DRILL naming a spec; here the spec is
set with monkeypatch and the tiny GPT (or a small module) trains inside `bitguard.record`. The
subprocess test at the end (slow) runs `bitguard record` with `stop_after_step`.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

import bitguard
from bitguard.backend.ingest import load_rank, open_run
from bitguard.collectors import drill as drill_mod
from bitguard.cuda.fingerprint import digest
from bitguard.errors import BadInput
from bitguard.sample_traces import tinygpt

ROOT = Path(__file__).resolve().parents[3]
TINYGPT = ROOT / "sample_traces" / "tinygpt.py"

# The torch functions Block.forward of the tiny GPT calls (layer norm, attention, residual add,
# MLP, second residual add), in order: nothing of bitguard's own digesting is among them.
BLOCK_OPS = [
    "torch.nn.functional.layer_norm", "torch.nn.functional.linear", "torch.Tensor.split",
    "torch.Tensor.view", "torch.Tensor.transpose", "torch.Tensor.view", "torch.Tensor.transpose",
    "torch.Tensor.view", "torch.Tensor.transpose", "torch.Tensor.transpose", "torch.Tensor.matmul",
    "torch.Tensor.div", "torch.ones", "torch.Tensor.tril", "torch.Tensor.__invert__", "torch.Tensor.masked_fill",
    "torch.Tensor.softmax", "torch.nn.functional.dropout", "torch.Tensor.matmul", "torch.Tensor.transpose",
    "torch.Tensor.reshape", "torch.nn.functional.linear", "torch.Tensor.add", "torch.nn.functional.layer_norm",
    "torch.nn.functional.linear", "torch.nn.functional.gelu", "torch.nn.functional.linear", "torch.Tensor.add"]


def _spec(out: Path, **over) -> dict:
    spec = {"schema": drill_mod.SPEC_SCHEMA, "step": 1, "rank": 0,
            "window": {"boundary": "blocks.0", "phase": "forward", "call": 0},
            "keep": [{"boundary": "blocks.0.ln_2", "phase": "forward", "call": 0},
                     {"boundary": "blocks.0", "phase": "forward", "call": 0}],
            "out": str(out), "max_tensor_bytes": 1 << 20, "max_total_bytes": 1 << 24, "stop_after_step": False}
    spec.update(over)
    return spec


def _set_spec(tmp: Path, monkeypatch, spec: dict) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    monkeypatch.setenv(drill_mod.ENV, str(path))


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    """The tiny GPT recorded twice for steps 1:2, once plain, once with the drill on blocks.0."""
    tmp = tmp_path_factory.mktemp("ops")
    mp = pytest.MonkeyPatch()
    try:
        with bitguard.record(tmp / "plain", steps="1:2"):
            tinygpt.main(["--steps", "3", "--results", str(tmp / "plain.pt")])
        _set_spec(tmp, mp, _spec(tmp / "drill"))
        with bitguard.record(tmp / "drill", steps="1:2"):
            tinygpt.main(["--steps", "3", "--results", str(tmp / "drill.pt")])
    finally:
        mp.undo()
    trace = json.loads((tmp / "drill" / "ops-rank-0.json").read_text())
    return tmp, trace


def _hex(value: int) -> str:
    return f"{value & (2 ** 64 - 1):016x}"


def _recorded(run: Path, boundary: str, role: str, step: int = 1) -> list[tuple[str, str]]:
    events, tensors, _ = load_rank(open_run(run), 0)
    ev = events.filter((pl.col("boundary") == boundary) & (pl.col("step") == step) & (pl.col("phase") == "forward"))
    rows = tensors.filter((pl.col("seq") == ev["seq"][0]) & (pl.col("role") == role)).sort("idx")
    return [(_hex(x), _hex(p)) for x, p in zip(rows["xor"], rows["pos"])]


def test_the_trace_is_every_op_of_the_window_and_nothing_of_bitguard(gpt_runs):
    _, trace = gpt_runs
    assert trace["schema"] == "bitguard.ops/1" and trace["found"] and trace["complete"] and not trace["errors"]
    assert trace["window"] == {"boundary": "blocks.0", "phase": "forward", "call": 0, "module_type": "Block"}
    assert [op["op"] for op in trace["ops"]] == BLOCK_OPS
    assert [op["i"] for op in trace["ops"]] == list(range(len(BLOCK_OPS)))
    for op in trace["ops"]:
        assert op["file"] == str(TINYGPT) and op["modules"][0] == "blocks.0", op


def test_the_residual_add_is_named_with_its_line_function_and_stack(gpt_runs):
    _, trace = gpt_runs
    add = next(op for op in trace["ops"] if op["function"] == "residual_add")
    assert add["op"] == "torch.Tensor.add" and add["modules"] == ["blocks.0"]
    assert add["line"] == _line_of(tinygpt.residual_add, "return x + y")
    call_line = _line_of(tinygpt.Block.forward, "residual_add(")
    assert add["stack"] == [f"{TINYGPT}:{call_line} in forward", f"{TINYGPT}:{add['line']} in residual_add"]
    assert add["args"] == "(<t0>, <t1>)"
    assert [t["path"] for t in add["inputs"]] == ["[0]", "[1]"] and not add["inplace"]


def test_nested_module_calls_give_the_modules_chain_and_the_recorders_digests(gpt_runs):
    tmp, trace = gpt_runs
    linears = [op for op in trace["ops"] if op["op"] == "torch.nn.functional.linear"]
    assert [op["modules"] for op in linears] == [
        ["blocks.0", "blocks.0.attn", "blocks.0.attn.qkv"], ["blocks.0", "blocks.0.attn", "blocks.0.attn.proj"],
        ["blocks.0", "blocks.0.mlp", "blocks.0.mlp.fc"], ["blocks.0", "blocks.0.mlp", "blocks.0.mlp.proj"]]
    assert linears[0]["line"] == _line_of(tinygpt.CausalSelfAttention.forward, "self.qkv(x)")
    assert linears[0]["function"] == "forward"
    for op in linears:  # an op's output digest is the boundary event's (the same tensor, the same digest)
        boundary = op["modules"][-1]
        assert [(o["xor"], o["pos"]) for o in op["outputs"]] == _recorded(tmp / "drill", boundary, "output")
        assert [(i["xor"], i["pos"]) for i in op["inputs"][:1]] == _recorded(tmp / "drill", boundary, "input")


def test_kept_bytes_are_the_tensors_values(gpt_runs):
    tmp, trace = gpt_runs
    out = tmp / "drill"
    ops = trace["ops"]
    add = next(op for op in ops if op["function"] == "residual_add")
    (o,) = add["outputs"]
    assert o["kept"] == "full" and o["bytes"] == f"ops-rank-0/op{add['i']:05d}-out0.bin"
    value = torch.from_numpy(np.fromfile(out / o["bytes"], dtype=np.float32).reshape(o["shape"]))
    assert _hex(digest(value)[0]) == o["xor"]
    # the add's inputs are the outputs of ops before it: their kept bytes add up to its output
    producers = {(op["outputs"][0]["xor"], op["outputs"][0]["pos"]): op for op in ops[:add["i"]] if op["outputs"]}
    x_op = producers[(add["inputs"][1]["xor"], add["inputs"][1]["pos"])]  # attn.proj's output
    y = torch.from_numpy(np.fromfile(out / x_op["outputs"][0]["bytes"], dtype=np.float32).reshape(o["shape"]))
    block_in = next(b for b in trace["boundaries"] if b["boundary"] == "blocks.0" and b["role"] == "input")
    x = torch.from_numpy(np.fromfile(out / block_in["bytes"], dtype=np.float32).reshape(block_in["shape"]))
    assert torch.equal(x + y, value)  # the kept bytes are the values torch computed
    ln2 = [b for b in trace["boundaries"] if b["boundary"] == "blocks.0.ln_2"]
    assert [(b["role"], b["idx"], b["path"]) for b in ln2] == [("input", 0, "[0]"), ("output", 0, "")]
    assert (ln2[0]["xor"], ln2[0]["pos"]) == (o["xor"], o["pos"])  # ln_2 reads the residual add's result
    assert [(b["xor"], b["pos"]) for b in ln2] == _recorded(out, "blocks.0.ln_2", "input") + _recorded(
        out, "blocks.0.ln_2", "output")
    ln2_in = np.fromfile(out / ln2[0]["bytes"], dtype=np.float32)
    assert np.array_equal(ln2_in, value.numpy().reshape(-1))
    assert ln2[1]["bytes"] == "ops-rank-0/b-blocks.0.ln_2-0-output0.bin"


def test_training_is_bitwise_unchanged_by_the_drill(gpt_runs):
    tmp, _ = gpt_runs
    plain, drilled = torch.load(tmp / "plain.pt"), torch.load(tmp / "drill.pt")
    assert plain["losses"] == drilled["losses"]
    assert plain["params"].keys() == drilled["params"].keys()
    for k, v in plain["params"].items():
        assert torch.equal(v.view(torch.uint8) if v.dtype != torch.uint8 else v, drilled["params"][k].view(torch.uint8))
    assert _recorded(tmp / "plain", "blocks.0", "output") == _recorded(tmp / "drill", "blocks.0", "output")


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        y = self.lin(x)
        y.mul_(2)  # in place
        return self.bn(y).relu()


def _train_net(tmp: Path, monkeypatch, steps: int = 2, **over) -> tuple[dict, list, _Net]:
    _set_spec(tmp, monkeypatch, _spec(tmp / "run", step=0, rank=None, keep=[],
                                      window={"boundary": "_Net", "phase": "forward", "call": 0}, **over))
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs = [torch.randn(8, 4) for _ in range(steps)]
    outs = []
    with bitguard.record(tmp / "run", steps="0:1"):
        for x in xs:
            out = net(x)
            outs.append(out.detach().clone())
            out.sum().backward()
            opt.step()
    return json.loads((tmp / "run" / "ops-rank-0.json").read_text()), xs, net


def test_an_in_place_op_is_marked_and_its_output_digested_after_it(tmp_path, monkeypatch):
    trace, xs, net = _train_net(tmp_path, monkeypatch)
    assert trace["complete"]
    ops = trace["ops"]
    assert [op["op"] for op in ops] == ["torch.nn.functional.linear", "torch.Tensor.mul_", "torch.Tensor.add_",
                                        "torch.nn.functional.batch_norm", "torch.Tensor.relu"]
    lin, mul = ops[0], ops[1]
    assert mul["inplace"] and not lin["inplace"] and mul["args"] == "(<t0>, 2)"
    assert mul["inputs"][0]["xor"] == lin["outputs"][0]["xor"]  # digested before the op wrote it
    doubled = np.fromfile(tmp_path / "run" / mul["outputs"][0]["bytes"], dtype=np.float32)
    linear = np.fromfile(tmp_path / "run" / lin["outputs"][0]["bytes"], dtype=np.float32)
    assert np.array_equal(doubled, linear * 2) and mul["outputs"][0]["xor"] != mul["inputs"][0]["xor"]
    # BatchNorm's num_batches_tracked += 1 (in place, inside torch's code: the user's call line)
    assert ops[2]["inplace"] and ops[2]["modules"] == ["_Net", "bn"]
    assert ops[2]["line"] == _line_of(_Net.forward, "self.bn(y)")
    # batch_norm writes its running statistics without returning them: outputs too, after the op
    bn = ops[3]
    assert bn["inplace"] and [o["path"] for o in bn["outputs"]] == ["", "input[1]", "input[2]"]
    assert bn["outputs"][1]["xor"] != bn["inputs"][1]["xor"]


def test_caps_keep_chunk_digests_instead_of_bytes(tmp_path, monkeypatch):
    trace, _, _ = _train_net(tmp_path, monkeypatch, max_tensor_bytes=64, max_total_bytes=30)
    outs = [o for op in trace["ops"] for o in op["outputs"]]
    big = [o for o in outs if o["shape"] == [8, 4]]  # 128 bytes: over max_tensor_bytes
    assert big and all(o["kept"] == "none" and o["bytes"] is None and len(o["chunks"]) == 1 for o in big)
    assert big[0]["chunks"][0] == [big[0]["xor"], big[0]["pos"]]  # one chunk: the whole tensor's digests
    small = [o for o in outs if o["kept"] == "full"]
    assert small and trace["bytes_kept"] <= 30
    assert any(o["shape"] == [4] and o["kept"] == "none" for o in outs)


def test_a_window_that_never_runs_is_not_found(tmp_path, monkeypatch):
    _set_spec(tmp_path, monkeypatch, _spec(tmp_path / "run", window={"boundary": "blocks.9", "phase": "forward",
                                                                      "call": 0}, keep=[]))
    with bitguard.record(tmp_path / "run", steps="1:2"):
        tinygpt.main(["--steps", "2"])
    trace = json.loads((tmp_path / "run" / "ops-rank-0.json").read_text())
    assert trace["found"] is False and trace["complete"] is False and trace["ops"] == []
    assert torch.nn.Module._call_impl is torch.nn.Module.__dict__["_call_impl"]  # every wrapper taken out


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.lin(x).tanh())


def test_the_window_is_the_calls_index_th_call_of_its_boundary(tmp_path, monkeypatch):
    _set_spec(tmp_path, monkeypatch, _spec(tmp_path / "run", step=0, keep=[],
                                           window={"boundary": "lin", "phase": "forward", "call": 1}))
    net = _Twice()
    x = torch.randn(2, 4)
    with torch.no_grad():
        second = torch.nn.functional.linear(x, net.lin.weight, net.lin.bias).tanh()
    with bitguard.record(tmp_path / "run"):
        net(x)
    trace = json.loads((tmp_path / "run" / "ops-rank-0.json").read_text())
    (op,) = trace["ops"]
    assert op["op"] == "torch.nn.functional.linear" and op["modules"] == ["lin"]
    assert op["inputs"][0]["xor"] == _hex(digest(second)[0])  # the tanh's output: the second call's input
    # a window without user code (torch's Linear): the user's call of it, then torch's frame
    assert op["function"] == "forward" and op["line"] == _line_of(_Twice.forward, "self.lin(self.lin")
    assert op["file"] == __file__ and len(op["stack"]) == 2 and op["stack"][0] == f"{__file__}:{op['line']} in forward"
    assert op["stack"][1].startswith(os.path.dirname(torch.__file__)) and op["stack"][1].endswith("in forward")


def test_a_rank_not_traced_writes_no_trace(tmp_path, monkeypatch):
    _set_spec(tmp_path, monkeypatch, _spec(tmp_path / "r1", rank=1))
    with bitguard.record(tmp_path / "r1", steps="1:2"):
        tinygpt.main(["--steps", "2"])
    assert not (tmp_path / "r1" / "ops-rank-0.json").exists()  # rank 0 records; only rank 1 would trace
    assert (tmp_path / "r1" / "rank-0.duckdb").exists()


@pytest.mark.parametrize("spec, message", [
    ({"schema": "bitguard.drill-spec/0"}, "is not a bitguard.drill-spec/1"),
    ({"schema": drill_mod.SPEC_SCHEMA, "step": -1}, "step must be"),
    ({"schema": drill_mod.SPEC_SCHEMA, "step": 1, "window": {"boundary": "a", "phase": "optimizer"}},
     "traced in its forward or its backward"),
])
def test_a_bad_spec_is_bad_input_before_the_recording_starts(tmp_path, monkeypatch, spec, message):
    _set_spec(tmp_path, monkeypatch, spec)
    with pytest.raises(BadInput, match=message):
        with bitguard.record(tmp_path / "run"):
            pass
    assert not (tmp_path / "run" / "manifest.json").exists()


@pytest.mark.slow
def test_stop_after_step_ends_the_replay_complete_after_step_k(tmp_path):
    spec = _spec(tmp_path / "run", stop_after_step=True)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, BITGUARD_DRILL=str(tmp_path / "spec.json"))
    proc = subprocess.run([sys.executable, "-m", "bitguard", "record", "--out", str(tmp_path / "run"), "--steps", "1:2",
                           "--", sys.executable, str(TINYGPT), "--steps", "6", "--progress"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1 done" in proc.stdout and "step 2 done" not in proc.stdout  # stopped in step 2's forward
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["complete"] and manifest["exit_status"] == 0
    trace = json.loads((tmp_path / "run" / "ops-rank-0.json").read_text())
    assert trace["complete"] and [op["op"] for op in trace["ops"]] == BLOCK_OPS
    events, _, _ = load_rank(open_run(tmp_path / "run"), 0)
    assert set(events.filter(pl.col("phase") != "optimizer")["step"]) == {1}


class _WithCompiled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()), backend="eager")

    def forward(self, x):
        return self.inner(x * 2) + 1


def test_a_compiled_region_inside_the_window_is_one_op_and_the_trace_says_it_is_not_complete(tmp_path, monkeypatch):
    _set_spec(tmp_path, monkeypatch, _spec(tmp_path / "run", step=0, keep=[],
                                           window={"boundary": "_WithCompiled", "phase": "forward", "call": 0}))
    torch.manual_seed(0)
    net = _WithCompiled()
    x = torch.randn(2, 4)
    with bitguard.record(tmp_path / "run"):
        out = net(x)
    trace = json.loads((tmp_path / "run" / "ops-rank-0.json").read_text())
    assert [op["op"] for op in trace["ops"]] == ["torch.Tensor.mul", "compiled region Sequential", "torch.Tensor.add"]
    region = trace["ops"][1]
    assert region["modules"] == ["_WithCompiled", "inner"] and region["line"] == _line_of(_WithCompiled.forward, "inner")
    assert region["inputs"][0]["xor"] == trace["ops"][0]["outputs"][0]["xor"]
    assert trace["ops"][2]["outputs"][0]["xor"] == _hex(digest(out)[0])
    assert trace["found"] and not trace["complete"] and "compiled region" in trace["errors"][0]


def test_a_failing_tracer_steps_aside_and_the_training_goes_on_unchanged(tmp_path, monkeypatch, capsys):
    from bitguard.collectors import ops

    plain, _, plain_net = _train_net(tmp_path / "plain", monkeypatch)

    def broken(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(ops, "call_text", broken)
    trace, _, net = _train_net(tmp_path / "broken", monkeypatch)
    assert trace["found"] and not trace["complete"] and trace["ops"] == []
    assert trace["errors"] == ["op tracer at torch.nn.functional.linear: RuntimeError: boom"]
    assert "bitguard drill: op tracer at torch.nn.functional.linear: RuntimeError: boom" in capsys.readouterr().err
    for p, q in zip(plain_net.state_dict().values(), net.state_dict().values()):
        assert torch.equal(p, q)


class _CompiledInPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        self.inner.compile(backend="eager")

    def forward(self, x):
        return self.inner(x * 2) + 1


def test_compiled_code_run_with_the_tracer_on_is_said_and_the_trace_not_complete(tmp_path, monkeypatch):
    """A module compiled in place runs with the mode on (the drill cannot take it off there):
    dynamo's own work is not traced, the graphs' ops are, and the trace says they may differ."""
    _set_spec(tmp_path, monkeypatch, _spec(tmp_path / "run", step=0, keep=[],
                                           window={"boundary": "_CompiledInPlace", "phase": "forward", "call": 0}))
    torch.manual_seed(0)
    net = _CompiledInPlace()
    with bitguard.record(tmp_path / "run"):
        net(torch.randn(2, 4))
    trace = json.loads((tmp_path / "run" / "ops-rank-0.json").read_text())
    assert [op["op"] for op in trace["ops"]] == ["torch.Tensor.mul", "torch.nn.functional.linear", "torch.tanh",
                                                 "torch.Tensor.add"]
    assert not trace["complete"] and len(trace["errors"]) == 1 and "compiled code" in trace["errors"][0]


class _Checkpointed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x * 2, use_reentrant=False) + 1


def test_gradient_checkpointing_in_the_window_is_no_compiled_code(tmp_path, monkeypatch):
    """Helper 24: torch.utils.checkpoint runs through `torch._dynamo.disable`'s wrapper, a frame of
    dynamo's files: the trace was said incomplete, "compiled code ran inside the window", and a
    drill of TRL's default (gradient checkpointing on) could not reproduce anything."""
    _set_spec(tmp_path, monkeypatch, _spec(tmp_path / "run", step=0, keep=[],
                                           window={"boundary": "_Checkpointed", "phase": "forward", "call": 0}))
    torch.manual_seed(0)
    net = _Checkpointed()
    with bitguard.record(tmp_path / "run"):
        net(torch.randn(2, 4, requires_grad=True)).sum().backward()
    trace = json.loads((tmp_path / "run" / "ops-rank-0.json").read_text())
    assert trace["found"] and trace["complete"] and not trace["errors"], trace["errors"]
    assert [op["op"] for op in trace["ops"]][:1] == ["torch.Tensor.mul"]
    assert "torch.nn.functional.linear" in [op["op"] for op in trace["ops"]]


def test_dynamo_s_helpers_a_model_calls_are_torch_s_code_not_compiled_code():
    """Helper 87 (torchvision's roi_align calls torch._dynamo.utils.is_compile_supported as it runs): the drill's
    tracer took the call for compiled code running in the window, stopped, and the drill said the replay did not
    reproduce the recording. Dynamo's frame evaluation is still what it is."""
    import torch._dynamo.eval_frame
    import torch._dynamo.utils

    from bitguard.collectors import ops

    assert ops._kind(torch._dynamo.utils.is_compile_supported.__code__) == ops.TORCH
    assert ops._kind(torch._dynamo.eval_frame.OptimizedModule.__call__.__code__) == ops.DYNAMO
