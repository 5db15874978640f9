"""`bitguard drill` on backward pivots: from a gradient that differs down to the operation and its line.

Each case is a reference/suspect scenario pair of real recordings whose pivot is in step 1's
backward; the drill replays both, traces what autograd runs for the window module's nodes
(collectors/backward_ops.py) and must name the operation the fault is in:
- `backward`: a custom autograd.Function's backward flips a bit of the gradient blocks.1.attn.proj
  sends back (a source pivot: the Function's ops, in `flip_bit`, run in the suspect alone);
- `embedding-race`: a tensor hook `corrupt` on the token embedding's weight mixes two rows of its
  gradient (a parameter's gradient: the window is its module, wte; the hook's ops run inside the
  weight's AccumulateGrad node).
A missed zero_grad() (`grad-accum`: AccumulateGrad adds into the old `.grad`) is shown in-process
by tests/unit/collectors/test_backward_ops.py, to keep this module under a minute.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import recorded

from bitguard.backend.drill import drill, plan
from bitguard.errors import NotSupported
from bitguard.sample_traces import evaluation
from bitguard.sample_traces.recordings import HERE
from bitguard.sample_traces.scenarios import SCENARIOS

pytestmark = pytest.mark.slow

TINYGPT = HERE / "tinygpt.py"
NAMES = ("backward", "embedding-race")


def _line(text: str) -> int:
    return next(i for i, line in enumerate(TINYGPT.read_text().splitlines(), 1) if text in line)


@pytest.fixture(scope="module")
def drilled(tmp_path_factory):
    root = tmp_path_factory.mktemp("drill_backward")
    # the scenarios tier's own plain recordings (recorded.scenario_runs: once a session, whichever
    # worker comes first), drilled on copies: a drill replays into folders beside the runs
    pairs = evaluation.pairs([SCENARIOS[name] for name in NAMES], "plain", recorded.scenario_runs(tmp_path_factory),
                             reruns=False)
    recorded.record_jobs([j for p in pairs for j in (p.reference, p.suspect)], workers=2)
    return {p.scenario.name: drill(recorded.copy_run(p.reference.out, root / p.scenario.name / "a"),
                                   recorded.copy_run(p.suspect.out, root / p.scenario.name / "b")).to_dict()
            for p in pairs}


def _planted(tmp_path, train) -> dict:
    """The first divergence of run a, `train(path, False)`, against run b, `train(path, True)`."""
    import bitguard

    train("a", False)
    train("b", True)
    return bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]


def _assert_reproduced(doc: dict) -> None:
    assert doc["replay"]["reproduced"], doc["replay"]["detail"]
    assert doc["replay"]["a"]["compared"] > 0 and doc["replay"]["b"]["compared"] > 0


def test_a_custom_functions_wrong_backward_is_named_at_its_line(drilled):
    doc = drilled["backward"]
    _assert_reproduced(doc)
    assert doc["verdict"] == "op_pivot"
    assert (doc["boundary_pivot"]["phase"], doc["boundary_pivot"]["boundary"]) == ("backward", "blocks.1.attn.proj")
    assert doc["window"]["boundary"] == "blocks.1.attn.proj" and doc["window"]["phase"] == "backward"
    op = doc["op_pivot"]
    # the suspect's Scale.backward runs flip_bit: its first op, in the suspect alone
    assert (op["cause"], op["side_only"]) == ("structure", "b")
    assert (Path(op["file"]).name, op["function"], op["line"]) == ("tinygpt.py", "flip_bit", _line("out = t.clone()"))
    assert f"tinygpt.py:{_line('return flip_bit(g, 2, 9)')} in backward" in op["chain"]
    assert "ScaleBackward (backward)" in op["chain"], op["chain"]
    assert op["ops_equal_before"] > 0  # the linear's own backward ops pair and are equal first
    # the gradient the module sends back differs in one bit (the boundary pivot's kept tensors)
    sig = doc["boundary_signature"]
    assert sig["kind"] == "bit_flip" and sig["elements_differing"] == 1 and sig["bits"] == {"9": 1}, sig
    assert sig["tensor"]["role"] == "grad_input"


def test_a_racy_hook_on_the_embedding_gradient_is_named_in_corrupt(drilled):
    doc = drilled["embedding-race"]
    _assert_reproduced(doc)
    assert doc["verdict"] == "op_pivot"
    assert (doc["boundary_pivot"]["kind"], doc["boundary_pivot"]["boundary"]) == ("grad", "wte.weight")
    assert doc["window"]["boundary"] == "wte" and doc["window"]["module_type"] == "Embedding"
    op = doc["op_pivot"]
    assert (op["cause"], op["side_only"], op["op"]) == ("structure", "b", "torch.Tensor.clone")
    assert (Path(op["file"]).name, op["function"], op["line"]) == ("tinygpt.py", "corrupt", _line("g = g.clone()"))
    assert "AccumulateGrad of wte.weight (backward)" in op["chain"]
    assert op["ops_equal_before"] == 1  # aten.embedding_dense_backward: the same gradient on both sides
    # after the hook the two streams join again at AccumulateGrad, taking in a different gradient
    then = op["then"]
    assert then["op"] == "aten.detach.default" and then["signature"]["elements_differing"] > 0
    assert doc["boundary_signature"]["elements_differing"] > 0


def test_an_optimizer_pivot_is_not_supported_yet():
    fd = {"phase": "optimizer", "kind": "step", "boundary": "lm_head.weight", "step": 1, "blame": "source"}
    with pytest.raises(NotSupported, match="not supported yet: drilling into a pivot that is the optimizer step of "
                                           "lm_head.weight"):
        plan(None, None, fd)
    fd = {"phase": "optimizer", "kind": "params", "boundary": "Sequential", "step": 1, "blame": "source"}
    with pytest.raises(NotSupported, match="pivot that is the parameters at the start of Sequential .step 1., no module "
                                           "call"):  # (helper 50: "of kind optimizer params")
        plan(None, None, fd)


def test_a_forward_pivot_blamed_on_its_inputs_is_not_called_the_batch():
    """Helper 48: a loss module given its inputs swapped (data blame on its forward) was refused as
    "the pivot is the input batch ... before the model runs", though the model had run."""
    fd = {"phase": "forward", "kind": "module", "boundary": "Loss", "step": 0, "blame": "data"}
    with pytest.raises(NotSupported, match="differs by its inputs, which no observed call before it made differently"):
        plan(None, None, fd)
    # (helper 84: a reseeded augmentation's call, its tensors matching, was said to differ by its inputs)
    with pytest.raises(NotSupported, match="differs by the RNG state its call began from, its tensors matching"):
        plan(None, None, {**fd, "fault_class": "rng"})
    with pytest.raises(NotSupported, match="is the input batch"):
        plan(None, None, {**fd, "phase": "data", "kind": "batch"})
    # (helper 68: the weights of a flow trained through its .inverse(), never called, differ: not "the batch")
    with pytest.raises(NotSupported, match="made from weights that already differ"):
        plan(None, None, {**fd, "phase": "data", "kind": "batch", "blame": "consumer", "fault_class": "params"})
    with pytest.raises(NotSupported, match="made from weights that already differ"):  # (helper 70: a gradient of them)
        plan(None, None, {**fd, "phase": "backward", "kind": "grad", "blame": "consumer", "fault_class": "params"})
    # (helper 53: torchdiffeq's solver calls the model again in the step, with inputs its code made between the calls)
    with pytest.raises(NotSupported, match="is the inputs of the model's call 1 in the step, which differ although "
                                           "its earlier calls matched"):
        plan(None, None, {**fd, "phase": "data", "kind": "batch", "call": 1})


def test_a_structure_pivot_traces_the_call_that_makes_the_extra_call(tmp_path):
    """Helper 44 (PEFT): a layer called twice a step, first as a reference pass with its adapter off,
    then with the adapter, which run B switches at step 1: the drill traced the layer's call 0 in
    run A (the reference pass, the same in both: "no difference") where the call making the extra
    module call is call 1."""
    import torch

    import bitguard
    from bitguard.backend.ingest import open_run

    class Adapted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Linear(4, 4)
            self.da, self.db = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
            self.active = "a"

        def forward(self, x):
            y = self.base(x)
            return y if self.active is None else y + (self.da if self.active == "a" else self.db)(x)

    def train(name, switch):
        torch.manual_seed(0)
        layer, x = Adapted(), torch.randn(2, 4)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(3):
                with torch.no_grad():
                    layer.active = None
                    ref = layer(x)
                layer.active = "b" if switch and step == 1 else "a"
                opt.zero_grad()
                (layer(x) - ref).pow(2).mean().backward()
                opt.step()

    fd = _planted(tmp_path, train)
    assert (fd["cause"], fd["step"]) == ("structure", 1), fd
    w = plan(open_run(tmp_path / "a"), open_run(tmp_path / "b"), fd)
    assert (w.boundary, w.step, w.call) == ("Adapted", 1, 1), w
    assert w.seq_a is not None and w.seq_b is not None


def test_a_backward_one_run_alone_runs_is_refused_as_that_not_as_nondeterminism(tmp_path):
    """Helper 72: BYOL's target network given a gradient in run B alone: the pivot is the target's
    backward, which run A never runs; the replay of A traced no backward and the drill said "not
    reproduced: nondeterminism". It refuses at once, saying what differs instead."""
    import torch

    import bitguard
    from bitguard.backend.ingest import open_run

    def train(name, target_grad):
        torch.manual_seed(0)
        online, target = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(online.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                x = torch.randn(2, 4)
                with torch.set_grad_enabled(target_grad):
                    t = target(x)
                opt.zero_grad()
                (online(x) - t).pow(2).mean().backward()
                opt.step()

    fd = _planted(tmp_path, train)
    assert (fd["cause"], fd["phase"], fd["a_seq"]) == ("structure", "backward", None), fd
    with pytest.raises(NotSupported, match="is a backward run B alone runs, and run A runs no backward of"):
        plan(open_run(tmp_path / "a"), open_run(tmp_path / "b"), fd)


def test_a_parameter_gradient_received_differing_traces_the_blame_window(tmp_path):
    """Helper 44 (PEFT's LoRA): `B(A(x)) * scaling` with another scaling, B at zero; compare blames the layer's
    own code (the mul), but the drill traced the backward of B, the parameter's owner, whose ops only
    pass on what reached them already differing."""
    import torch

    import bitguard
    from bitguard.backend.ingest import open_run

    class Lora(torch.nn.Module):
        def __init__(self, scaling):
            super().__init__()
            self.A, self.B, self.scaling = torch.nn.Linear(4, 2, bias=False), torch.nn.Linear(2, 4, bias=False), scaling
            torch.nn.init.zeros_(self.B.weight)  # (as LoRA starts: the forwards are equal, the gradients not)

        def forward(self, x):
            return x + self.B(self.A(x)) * self.scaling

    for name, scaling in (("a", 4.0), ("b", 8.0)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Lora(scaling), torch.nn.Linear(4, 1))
        with bitguard.record(tmp_path / name, determinism=False):
            model(torch.randn(8, 4)).pow(2).mean().backward()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["kind"], fd["blame"], fd["blame_window"]["module"]) == ("grad", "consumer", "0"), fd
    w = plan(open_run(tmp_path / "a"), open_run(tmp_path / "b"), fd)
    assert (w.boundary, w.module_type, w.phase) == ("0", "Lora", "backward"), w


def test_the_backward_of_the_second_of_two_models_traces_that_model(tmp_path):
    """Helper 57 (CleanRL's PPO: an actor and a critic, each a root): a consumer pivot at the critic's
    backward, its gradient made differently by the loss, traced the actor's backward, the first root,
    and found no difference there."""
    import torch

    import bitguard
    from bitguard.backend.ingest import open_run

    for name, coef in (("a", 0.5), ("b", 0.25)):
        torch.manual_seed(0)
        actor = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        x = torch.randn(8, 4)
        with bitguard.record(tmp_path / name, determinism=False):
            (actor(x).pow(2).mean() + coef * critic(x).pow(2).mean()).backward()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").to_dict()["first_divergence"]
    assert (fd["phase"], fd["boundary"], fd["blame"]) == ("backward", "Sequential#2", "consumer"), fd
    w = plan(open_run(tmp_path / "a"), open_run(tmp_path / "b"), fd)
    assert (w.boundary, w.phase) == ("Sequential#2", "backward"), w


def test_a_torchscript_window_is_said_not_to_be_traceable(tmp_path):
    """Helper 79: a scripted submodule (e3nn's tensor products with jit on) whose constant changed: the
    drill traced 0 operations inside it and said "no difference" (exit 1), as if none differed."""
    import torch

    import bitguard
    from bitguard.backend.ingest import open_run

    class Inner(torch.nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.scale = scale

        def forward(self, x):
            return torch.tanh(self.lin(x)) * self.scale

    def train(name, scale):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.jit.script(Inner(scale)), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            opt.zero_grad()
            net(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()

    train("a", 0.5)
    train("b", 0.7)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["phase"], fd["boundary"], fd["module_type"]) == ("forward", "0", "RecursiveScriptModule"), fd
    with pytest.raises(NotSupported, match="is a TorchScript module .RecursiveScriptModule.: its operations run in"):
        plan(open_run(tmp_path / "a"), open_run(tmp_path / "b"), fd)


def test_a_window_one_run_alone_calls_is_said_to_be_so_not_nondeterminism(tmp_path):
    """Helper 79 (pytorch-metric-learning's miner skipped at a step in run B): the drill replayed both runs
    and said "not reproduced: nondeterminism or a changed environment", though run B's replay was faithful:
    run B never calls the window there."""
    import torch

    import bitguard
    from bitguard.backend.ingest import open_run

    class Miner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.distance = torch.nn.Identity()

        def forward(self, e):
            return (self.distance(e @ e.T) > 0).float()

    def train(name, skip_at):
        torch.manual_seed(0)
        net, miner = torch.nn.Linear(4, 4), Miner()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(2):
                opt.zero_grad()
                e = net(torch.randn(8, 4))
                w = miner(e.detach()) if step != skip_at else torch.ones(8, 8)
                ((e @ e.T) * w).mean().backward()
                opt.step()

    train("a", None)
    train("b", 1)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["cause"], fd["step"], fd["missing_side"]) == ("structure", 1, "b"), fd
    with pytest.raises(NotSupported, match="is called in step 1 of run A only: run B does not call it there"):
        plan(open_run(tmp_path / "a"), open_run(tmp_path / "b"), fd)
