"""collectors/backward_ops.py with collectors/drill.py: a backward window's op trace, recorded in-process.

A drill spec with `window.phase: "backward"` (set with monkeypatch, as in test_ops.py) traces what
autograd runs in step K's backward for the nodes the window module's forward made: the aten ops of
C++ nodes (placed at the forward line that made the node), the torch functions of Python code in a
node (a gradient hook, a custom Function's backward: their own lines), and keeps the pivot's
gradients. The tiny GPT trains with the sample faults `embedding-race` (a hook on the token
embedding's weight) and `backward` (a custom autograd.Function flipping a bit of a gradient).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

import bitguard
from bitguard.backend.ingest import load_rank, open_run
from bitguard.collectors import backward_ops
from bitguard.collectors import drill as drill_mod
from bitguard.cuda.fingerprint import digest
from bitguard.errors import BadInput
from bitguard.sample_traces import tinygpt

TINYGPT = str(Path(tinygpt.__file__).resolve())
EMBEDDING_BACKWARD = "aten.embedding_dense_backward.default"
# the torch functions of tinygpt's `corrupt` hook, in order (`g[i] = ...` is the __setitem__ that writes g)
CORRUPT_OPS = ["torch.Tensor.clone", "torch.Tensor.abs", "torch.Tensor.sum", "torch.Tensor.nonzero",
               "torch.Tensor.flatten", "torch.Tensor.__getitem__", "torch.Tensor.__getitem__",
               "torch.Tensor.__getitem__", "torch.Tensor.__getitem__", "torch.Tensor.mul", "torch.Tensor.add",
               "torch.Tensor.__setitem__"]


def _spec(out: Path, window: str, keep: list, step: int = 1) -> dict:
    return {"schema": drill_mod.SPEC_SCHEMA, "step": step, "rank": 0,
            "window": {"boundary": window, "phase": "backward", "call": 0}, "keep": keep, "out": str(out),
            "max_tensor_bytes": 1 << 20, "max_total_bytes": 1 << 24, "stop_after_step": False}


def _set_spec(tmp: Path, monkeypatch, spec: dict) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "spec.json").write_text(json.dumps(spec))
    monkeypatch.setenv(drill_mod.ENV, str(tmp / "spec.json"))


def _line(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _hex(value: int) -> str:
    return f"{value & (2 ** 64 - 1):016x}"


def _recorded(run: Path, kind: str, boundary: str, step: int = 1) -> dict[tuple[str, int], tuple[str, str]]:
    """(role, idx) -> digests of the recorded backward event of `boundary` in `step`."""
    events, tensors, _ = load_rank(open_run(run), 0)
    ev = events.filter((pl.col("boundary") == boundary) & (pl.col("step") == step) & (pl.col("phase") == "backward")
                       & (pl.col("kind") == kind))
    rows = tensors.filter(pl.col("seq") == ev["seq"][0])
    return {(r, i): (_hex(x), _hex(p)) for r, i, x, p in zip(rows["role"], rows["idx"], rows["xor"], rows["pos"])}


def _gpt(tmp: Path, mp, name: str, window: str | None, keep: list, *args: str) -> dict | None:
    """The tiny GPT trained 3 steps under `bitguard.record` (steps 1:2), drilled on `window`'s backward."""
    if window is None:
        mp.delenv(drill_mod.ENV, raising=False)
    else:
        _set_spec(tmp / f"{name}-spec", mp, _spec(tmp / name, window, keep))
    with bitguard.record(tmp / name, steps="1:2"):
        tinygpt.main(["--steps", "3", "--results", str(tmp / f"{name}.pt"), *args])
    mp.delenv(drill_mod.ENV, raising=False)
    return None if window is None else json.loads((tmp / name / "ops-rank-0.json").read_text())


GRAD_KEEP = [{"boundary": "wte.weight", "phase": "backward", "call": 0, "kind": "grad"}]
PROJ_KEEP = [{"boundary": "blocks.1.attn.proj", "phase": "backward", "call": 0}]


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """Plain runs and drilled runs of the tiny GPT: the embedding race (and its reference) on wte,
    the wrong custom backward on blocks.1.attn.proj."""
    tmp = tmp_path_factory.mktemp("backward_ops")
    mp = pytest.MonkeyPatch()
    race, bad_backward = ("--fault", "embedding-race"), ("--fault", "backward", "--fault-layer", "1")
    try:
        traces = {"race": _gpt(tmp, mp, "race", "wte", GRAD_KEEP, *race),
                  "reference": _gpt(tmp, mp, "reference", "wte", GRAD_KEEP),
                  "backward": _gpt(tmp, mp, "backward", "blocks.1.attn.proj", PROJ_KEEP, *bad_backward)}
        _gpt(tmp, mp, "race-plain", None, [], *race)
        _gpt(tmp, mp, "backward-plain", None, [], *bad_backward)
    finally:
        mp.undo()
    return tmp, traces


def test_a_hook_on_a_parameter_is_traced_with_its_own_lines_inside_the_accumulate_grad_node(gpt):
    _, traces = gpt
    trace = traces["race"]
    assert trace["found"] and trace["complete"] and not trace["errors"] and trace["backward_passes"] == 1
    assert trace["window"] == {"boundary": "wte", "phase": "backward", "call": 0, "module_type": "Embedding"}
    assert [op["op"] for op in trace["forward_ops"]] == ["torch.nn.functional.embedding"]
    assert trace["forward_ops"][0]["phase"] == "forward"
    ops = trace["ops"]
    assert [op["op"] for op in ops] == [EMBEDDING_BACKWARD, *CORRUPT_OPS, "aten.detach.default"]
    assert all(op["phase"] == "backward" and op["modules"] == ["wte"] for op in ops)
    embedding_line = _line(tinygpt.GPT.forward, "self.wte(idx)")
    created = {"i": 0, "op": "torch.nn.functional.embedding", "file": TINYGPT, "line": embedding_line,
               "function": "forward"}
    for op in ops:
        assert {k: op["created_at"][k] for k in created} == created, op
    first, hook, last = ops[0], ops[1:-1], ops[-1]
    # a C++ node's aten op: placed at the forward line that made its node
    assert (first["node"], first["source"], first["file"], first["line"]) == (
        "EmbeddingBackward0", "created_at", TINYGPT, embedding_line)
    # the hook's torch functions: in the AccumulateGrad node of wte.weight, at their own lines in `corrupt`
    clone_line = _line(tinygpt.install_fault, "g = g.clone()")
    for op in hook + [last]:
        assert op["node"] == "torch::autograd::AccumulateGrad" and op["param"] == "wte.weight"
    assert all(op["source"] == "frame" and op["function"] == "corrupt" and op["file"] == TINYGPT for op in hook)
    assert hook[0]["line"] == clone_line and hook[0]["stack"] == [f"{TINYGPT}:{clone_line} in corrupt"]
    setitem = hook[-1]
    assert setitem["inplace"] and [o["path"] for o in setitem["outputs"]] == ["input[0]"]
    assert last["source"] == "created_at" and not last["inplace"]  # .grad was empty: the gradient taken as it is


def test_backward_ops_carry_the_gradients_digests_and_kept_bytes(gpt):
    tmp, traces = gpt
    for name in ("race", "reference"):
        ops = traces[name]["ops"]
        recorded = _recorded(tmp / name, "grad", "wte.weight")
        detach = ops[-1]
        # what AccumulateGrad takes in is the gradient the collector recorded (after the hook, when there is one)
        assert (detach["inputs"][0]["xor"], detach["inputs"][0]["pos"]) == recorded[("grad_input", 0)]
        kept = {(b["role"], b["idx"]): b for b in traces[name]["boundaries"]}
        assert {k: (b["xor"], b["pos"]) for k, b in kept.items()} == recorded
        assert all(b["boundary"] == "wte.weight" and b["phase"] == "backward" and b["call"] == 0 and
                   b["kept"] == "full" for b in kept.values())
        grad = np.fromfile(tmp / name / kept[("grad", 0)]["bytes"], dtype=np.float32)
        assert _hex(digest(torch.from_numpy(grad))[0]) == recorded[("grad", 0)][0]
    reference = traces["reference"]["ops"]
    assert [op["op"] for op in reference] == [EMBEDDING_BACKWARD, "aten.detach.default"]
    # both runs compute the same embedding gradient; the race's hook changes it afterwards
    race = traces["race"]["ops"]
    assert race[0]["outputs"][0]["xor"] == reference[0]["outputs"][0]["xor"]
    assert race[-1]["inputs"][0]["xor"] != reference[-1]["inputs"][0]["xor"]
    out = race[0]["outputs"][0]
    assert out["kept"] == "full" and out["bytes"] == "ops-rank-0/op00000-out0.bin"


def test_a_custom_functions_backward_is_traced_in_its_node(gpt):
    tmp, traces = gpt
    trace = traces["backward"]
    assert trace["complete"] and not trace["errors"]
    assert [op["op"] for op in trace["forward_ops"]] == ["torch.Tensor.view_as", "torch.nn.functional.linear"]
    ops = trace["ops"]
    scale = [op for op in ops if op["node"] == "ScaleBackward"]
    linear = [op for op in ops if op["node"] != "ScaleBackward"]
    assert ops == linear + scale  # autograd runs the linear's nodes, then the Function's
    # the linear's C++ nodes: aten ops placed at the line that calls F.linear (the patched forward)
    assert {op["node"] for op in linear} == {"ViewBackward0", "AddmmBackward0", "TBackward0",
                                             "torch::autograd::AccumulateGrad"}
    assert {op["param"] for op in linear if "param" in op} == {"blocks.1.attn.proj.weight", "blocks.1.attn.proj.bias"}
    assert all(op["source"] == "created_at" and op["created_at"]["op"] == "torch.nn.functional.linear"
               for op in linear)
    assert [op["op"] for op in scale] == ["torch.Tensor.clone", "torch.Tensor.view", "torch.Tensor.view",
                                          "torch.Tensor.__getitem__", "torch.Tensor.__ixor__",
                                          "torch.Tensor.__setitem__"]
    backward_line = _line(tinygpt.install_fault, "return flip_bit(g, 2, 9)")
    clone = scale[0]
    assert (clone["function"], clone["line"]) == ("flip_bit", _line(tinygpt.flip_bit, "out = t.clone()"))
    assert clone["stack"] == [f"{TINYGPT}:{backward_line} in backward", f"{TINYGPT}:{clone['line']} in flip_bit"]
    # the Function's node was made by Scale.apply, which no torch function traces: its forward's place
    assert clone["created_at"]["op"].endswith("Scale.apply") and clone["created_at"]["function"] == "forward"
    forward_line = _line(tinygpt.install_fault, "def forward(ctx, x)")  # (its code starts at its decorator)
    assert clone["created_at"]["line"] in (forward_line - 1, forward_line)
    assert scale[4]["inplace"]  # the flip itself
    # the module's backward event's gradients, kept as the collector recorded them
    recorded = _recorded(tmp / "backward", "module", "blocks.1.attn.proj")
    kept = {(b["role"], b["idx"]): (b["xor"], b["pos"]) for b in trace["boundaries"]}
    assert kept == recorded and set(recorded) == {("grad_output", 0), ("grad_input", 0)}
    # the gradient flip_bit is given, and the one it writes (the same bytes as the grad_input the collector saw)
    assert clone["inputs"][0]["xor"] != recorded[("grad_input", 0)][0]
    assert (scale[-1]["outputs"][0]["xor"], scale[-1]["outputs"][0]["pos"]) == recorded[("grad_input", 0)]


def test_training_is_bitwise_unchanged_by_the_backward_drill(gpt):
    tmp, _ = gpt
    for drilled, plain in (("race", "race-plain"), ("backward", "backward-plain")):
        a, b = torch.load(tmp / f"{plain}.pt"), torch.load(tmp / f"{drilled}.pt")
        assert a["losses"] == b["losses"]
        for k, v in a["params"].items():
            assert torch.equal(v, b["params"][k]), k
    assert torch.autograd._engine_run_backward is torch.autograd.graph._engine_run_backward  # taken out


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        h.register_hook(lambda g: g * 2)  # a user's hook on the window's output
        return self.b(h.tanh())


def _train_two(tmp: Path, monkeypatch, steps: int = 3, zero_grad: bool = True, drill: bool = True):
    if drill:
        _set_spec(tmp, monkeypatch, _spec(tmp / "run", "a", [], step=1))
    else:
        monkeypatch.delenv(drill_mod.ENV, raising=False)
    torch.manual_seed(0)
    net = _Two()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs = [torch.randn(3, 4) for _ in range(steps)]
    with bitguard.record(tmp / "run", steps="1:2"):
        for x in xs:
            if zero_grad:
                opt.zero_grad()
            net(x).sum().backward()
            opt.step()
    trace = json.loads((tmp / "run" / "ops-rank-0.json").read_text()) if drill else None
    return trace, net


def test_only_the_windows_nodes_are_traced_with_a_users_hook_on_its_output(tmp_path, monkeypatch):
    trace, net = _train_two(tmp_path, monkeypatch)
    assert trace["complete"] and not trace["errors"]
    ops = trace["ops"]
    hook = [op for op in ops if op["source"] == "frame"]
    assert [op["op"] for op in hook] == ["torch.Tensor.mul"] and hook[0]["node"] == "AddmmBackward0"
    assert hook[0]["function"] == "<lambda>" and hook[0]["line"] == _line(_Two.forward, "register_hook")
    # nothing of self.b (outside the window), of the loss's sum, or of bitguard's own hooks
    assert all(op["modules"] == ["a"] for op in ops)
    assert {op["node"] for op in ops} == {"AddmmBackward0", "TBackward0", "torch::autograd::AccumulateGrad"}
    assert {op.get("param") for op in ops if op.get("param")} == {"a.weight", "a.bias"}
    plain, plain_net = _train_two(tmp_path / "plain", monkeypatch, drill=False)
    for p, q in zip(plain_net.parameters(), net.parameters()):
        assert torch.equal(p, q)


def test_an_accumulated_gradient_is_an_in_place_add_in_accumulate_grad(tmp_path, monkeypatch):
    trace, _ = _train_two(tmp_path, monkeypatch, zero_grad=False)
    accumulate = [op for op in trace["ops"] if op.get("param") == "a.weight"]
    assert [op["op"] for op in accumulate] == ["aten.add_.Tensor"] and accumulate[0]["inplace"]
    emptied, _ = _train_two(tmp_path / "zeroed", monkeypatch, zero_grad=True)
    # zero_grad() sets .grad to None: the new gradient is taken over (a detach), nothing added
    assert [op["op"] for op in emptied["ops"] if op.get("param") == "a.weight"] == ["aten.detach.default"]


def test_a_failing_backward_tracer_steps_aside_and_the_training_goes_on_unchanged(tmp_path, monkeypatch, capsys):
    _, plain_net = _train_two(tmp_path / "plain", monkeypatch, drill=False)

    def broken(*_):
        raise RuntimeError("boom")

    monkeypatch.setattr(backward_ops.BackwardAten, "_where", broken)
    trace, net = _train_two(tmp_path / "broken", monkeypatch)
    assert trace["found"] and not trace["complete"]
    assert any(e.startswith("op tracer at aten.") and e.endswith("RuntimeError: boom") for e in trace["errors"])
    assert "(training continues)" in capsys.readouterr().err
    for p, q in zip(plain_net.parameters(), net.parameters()):
        assert torch.equal(p, q)


def test_a_window_without_a_backward_pass_says_so(tmp_path, monkeypatch):
    _set_spec(tmp_path, monkeypatch, _spec(tmp_path / "run", "a", [], step=0))
    net = _Two()
    with bitguard.record(tmp_path / "run"):
        net(torch.randn(2, 4))
    trace = json.loads((tmp_path / "run" / "ops-rank-0.json").read_text())
    assert trace["found"] and not trace["complete"] and trace["ops"] == []
    assert trace["errors"] == ["no backward pass ran in the step after the window's forward"]


@pytest.mark.parametrize("keep, message", [
    ([{"boundary": "w", "phase": "forward", "kind": "grad"}], "kind must be module, or grad"),
    ([{"boundary": "w", "phase": "backward", "kind": "param"}], "kind must be module, or grad"),
])
def test_a_bad_backward_keep_is_bad_input(tmp_path, monkeypatch, keep, message):
    _set_spec(tmp_path, monkeypatch, {**_spec(tmp_path / "run", "a", keep)})
    with pytest.raises(BadInput, match=message):
        with bitguard.record(tmp_path / "run"):
            pass


class _Probe(torch.autograd.Function):
    """Identity whose backward notes the dispatch mode on while it runs."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        mode = _get_current_dispatch_mode()
        _Probe.seen.append(type(mode).__name__ if mode is not None else None)
        return g


class _Probed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _Probe.apply(self.b(_Probe.apply(self.a(x))))


def test_the_dispatch_mode_is_on_only_while_a_window_node_runs(tmp_path, monkeypatch):
    """Outside the window's nodes autograd computes as untraced (a dispatch mode would make its
    formulas take their tensor-subclass paths)."""
    _set_spec(tmp_path, monkeypatch, _spec(tmp_path / "run", "_Probed", [], step=1))
    _Probe.seen = []
    torch.manual_seed(0)
    net = _Probed()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run", steps="1:2"):
        for _ in range(3):
            y = net(torch.randn(2, 4))  # the window's forward: both probes' nodes are its
            _Probe.apply(y).sum().backward()  # this probe's node is not
            opt.step()
    trace = json.loads((tmp_path / "run" / "ops-rank-0.json").read_text())
    assert trace["complete"] and "AddmmBackward0" in {op["node"] for op in trace["ops"]}
    # per step: the probe outside the window, then the two inside it (backward order)
    assert _Probe.seen == [None, None, None, None, "BackwardAten", "BackwardAten", None, None, None]
