"""torch.compile under the collectors, in process: nothing of bitguard is traced, compiled regions are
named as their eager modules and observed at their boundary, with a marker row saying so.

Dynamo's `eager` backend traces exactly as inductor's would but runs the captured graphs as they
are (seconds, not a C++ compile); the inductor runs, and the numbers, are in tests/stacks.
"""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch
import torch.nn as nn

import bitguard
from bitguard.backend.ingest import load_rank, open_run
from bitguard.collectors.compiled import REGION_PATH, eager_name

dynamo = pytest.importorskip("torch._dynamo")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return x + self.norm(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _train(run, params, steps=2):
    opt = torch.optim.SGD(params, lr=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = run(torch.randn(4, 8, generator=data)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _compiled(model: Net, how: str):
    if how == "model":
        return torch.compile(model, backend="eager")
    if how == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="eager")
    elif how == "inplace":
        model.compile(backend="eager")
    return model


def _dynamo_counts() -> dict:
    counters = dynamo.utils.counters
    return {"graph_break": dict(counters["graph_break"]), "stats": dict(counters["stats"]),
            "frames": dict(counters["frames"]), "recompiles": dict(counters["recompiles"])}


def _train_plain(how: str) -> tuple[dict, dict]:
    """Dynamo's counters and the final parameters of a run without bitguard."""
    dynamo.reset()
    dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Net()
    _train(_compiled(model, how), model.parameters())
    return _dynamo_counts(), {n: p.detach().clone() for n, p in model.named_parameters()}


def _record(tmp_path, how: str):
    dynamo.reset()
    dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = Net()
    with bitguard.record(tmp_path / how, determinism=False):
        _train(_compiled(model, how), model.parameters())
    events, tensors, _ = load_rank(open_run(tmp_path / how), 0)
    return events, tensors, _dynamo_counts(), model


def _modules(events, phase="forward", step=0):
    rows = events.filter((pl.col("phase") == phase) & (pl.col("kind") == "module") & (pl.col("step") == step))
    return list(zip(rows["boundary"].to_list(), rows["module_type"].to_list()))


def _regions(events, tensors):
    seqs = tensors.filter((pl.col("path") == REGION_PATH) & pl.col("unobserved").is_not_null())["seq"]
    return events.filter(pl.col("seq").is_in(seqs.implode()))["boundary"].to_list()


def test_eager_names():
    assert eager_name("_orig_mod") == ""
    assert eager_name("_orig_mod.blocks.0.fc.weight") == "blocks.0.fc.weight"
    assert eager_name("blocks.0._orig_mod.fc") == "blocks.0.fc"
    assert eager_name("blocks.0._orig_mod") == "blocks.0"
    assert eager_name("my_orig_mod.x") == "my_orig_mod.x"


@pytest.mark.parametrize("how", ["model", "blocks", "inplace"])
def test_compiled_region_observed_at_its_boundary_under_eager_names(tmp_path, how):
    plain_counts, plain_params = _train_plain(how)
    events, tensors, counts, model = _record(tmp_path, how)
    eager_events, _, _, _ = _record(tmp_path, "none")
    # the graphs a plain run compiles, no graph break, no recompile: nothing of ours was traced
    assert counts == plain_counts and not counts["graph_break"] and not counts["recompiles"], (counts, plain_counts)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.uint8), plain_params[name].view(torch.uint8)), name
    names = set(events["boundary"].to_list())
    assert not any("_orig_mod" in n for n in names), sorted(names)
    assert "OptimizedModule" not in set(events["module_type"].to_list())
    expected = {"model": ["Net"], "inplace": ["Net"], "blocks": ["blocks.0", "blocks.1"]}[how]
    assert _regions(events, tensors) == expected * 2  # one forward event per region per step
    forward = _modules(events)
    if how == "blocks":  # the eager root and head, the compiled blocks at their boundary only
        assert forward == [("blocks.0", "Block"), ("blocks.1", "Block"), ("head", "Linear"), ("Net", "Net")]
    else:
        assert forward == [("Net", "Net")]
    # gradients and optimizer steps of every parameter, under the eager model's names
    params = {eager_name(n) for n, _ in model.named_parameters()}
    grads = events.filter((pl.col("kind") == "grad") & (pl.col("step") == 0))["boundary"].to_list()
    steps = events.filter((pl.col("kind") == "step") & (pl.col("step") == 0))["boundary"].to_list()
    assert set(grads) == params and sorted(steps) == sorted(params)
    eager_params = set(eager_events.filter(pl.col("kind") == "grad")["boundary"].to_list())
    assert eager_params == params
    assert events["step"].max() == 2  # two optimizer steps, then the final state


def test_module_compile_after_recording_removed_is_left_as_torch_made_it(tmp_path):
    model = Net()
    with bitguard.record(tmp_path / "r", determinism=False):
        pass
    assert torch.nn.Module.compile.__module__ == "torch.nn.modules.module"
    model.compile(backend="eager")
    assert not getattr(model._compiled_call_impl, "_bitguard_observed", False)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Runs of the same training, eager and compiled (dynamo's eager backend computes as eager does)."""
    tmp = tmp_path_factory.mktemp("granularity")
    for how in ("none", "model", "blocks"):
        _record(tmp, how)
    _record(tmp / "again", "model")
    return {how: tmp / how for how in ("none", "model", "blocks")} | {"model again": tmp / "again" / "model"}


def test_eager_against_compiled_with_equal_numbers_is_not_identical(recorded):
    for a, b in (("none", "model"), ("model", "none"), ("none", "blocks"), ("blocks", "model")):
        c = bitguard.compare(recorded[a], recorded[b])
        codes = {r["code"]: r["message"] for r in c.certification_reasons()}
        # every boundary both observed matched; what one run saw inside the other's region is unobserved
        assert c.verdict == "inconclusive", (a, b, c.verdict, c.first_divergence)
        assert "unobserved" in codes and "inside compiled regions" in codes["unobserved"], (a, b, codes)
        assert "granularity" in codes, codes
        statuses = set(c.events()["status"].unique().to_list())
        assert statuses == {"identical", "unobserved"}, (a, b, statuses)


def test_compiled_rerun_is_identical_and_says_what_that_certifies(recorded):
    c = bitguard.compare(recorded["model"], recorded["model again"])
    assert c.verdict == "identical", c.certification_reasons()
    (reason,) = [r for r in c.certification_reasons() if r["code"] == "granularity"]
    assert "Net" in reason["message"] and "not the computation inside it" in reason["message"]


_BREAKING = """
class Breaking{i}(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x = self.fc(x)
        dynamo.graph_break()  # as a print, a .item() or unsupported code would
        return torch.relu(x)
"""


def _breaking_net() -> nn.Module:
    """Ten module classes (ten forward code objects, more than dynamo's recompile limit of 8), each
    with a graph break: dynamo runs their calls between graphs and compiles each forward on its own."""
    blocks = []
    for i in range(10):
        scope = {"nn": nn, "torch": torch, "dynamo": dynamo}
        exec(compile(_BREAKING.format(i=i), f"<breaking {i}>", "exec"), scope)  # noqa: S102 - distinct code objects
        blocks.append(scope[f"Breaking{i}"]())
    return nn.Sequential(*blocks)


def test_graph_breaks_inside_a_region_compile_as_in_a_plain_run(tmp_path, capfd):
    def run(recorded: bool):
        dynamo.reset()
        dynamo.utils.counters.clear()
        torch.manual_seed(0)
        model = _breaking_net()
        if recorded:
            with bitguard.record(tmp_path / "breaks", determinism=False):
                _train(torch.compile(model, backend="eager"), model.parameters())
        else:
            _train(torch.compile(model, backend="eager"), model.parameters())
        return _dynamo_counts()

    plain = run(False)
    capfd.readouterr()
    recorded = run(True)
    assert recorded == plain and sum(plain["graph_break"].values()) >= 10, (recorded, plain)
    err = capfd.readouterr().err
    assert "collectors/" not in err and "recompile_limit" not in err, err[-2000:]
    events, tensors, _ = load_rank(open_run(tmp_path / "breaks"), 0)
    forward = _modules(events)
    # the calls dynamo ran between its graphs are observed inside the region, once; the region once
    assert forward == [(str(i), f"Breaking{i}") for i in range(10)] + [("Sequential", "Sequential")], forward
    assert _regions(events, tensors) == ["Sequential"] * 2


def test_a_compiled_function_is_reported_not_silently_unobserved(tmp_path):
    dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "fn", determinism=False):
        @torch.compile(backend="eager")  # the decorator form
        def opt_step():
            opt.step()

        forward = torch.compile(lambda x: model(x), backend="eager")
        @torch.compile(disable=True)  # (compiles nothing: not reported, helper 92)
        def skipped(x):
            return x

        for _ in range(2):
            loss = forward(skipped(torch.randn(4, 8))).square().mean()
            opt.zero_grad()
            loss.backward()
            opt_step()
        torch.compile(model, backend="eager")  # a model: observed at its boundary, not reported
    errors = json.loads((tmp_path / "fn" / "manifest.json").read_text())["collector_errors"]
    assert len(errors) == 2 and all("not observed" in e for e in errors), errors
    assert "<lambda>" in errors[0] and "opt_step" in errors[1], errors  # (in the order they first ran)
    assert torch.compile.__module__.startswith("torch")  # given back when the recording ends


def test_a_function_compiled_and_run_inside_a_module_call_is_observed_there(tmp_path):
    """Helper 45: torchvision compiles its Python roi_align when deterministic algorithms are on (as
    bitguard's controls set them) on a GPU, and runs it inside MultiScaleRoIAlign's forward: every
    identical rerun was inconclusive ("not observed"), though what it computes is that call's."""
    def helper(x, w):
        return (x * w).relu() + 1

    compiled = {}  # (compiled at its first call, as torchvision's lazy compile does: while recording)

    class Scaled(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.fc, self.w = torch.nn.Linear(8, 8), torch.nn.Parameter(torch.full((8,), w))

        def forward(self, x):
            if "helper" not in compiled:
                compiled["helper"] = torch.compile(helper, backend="eager")
            return compiled["helper"](self.fc(x), self.w)

    for name, w in (("a", 1.0), ("b", 1.0), ("c", 1.5)):
        dynamo.reset()
        compiled.clear()
        torch.manual_seed(0)
        model = Scaled(w)
        with bitguard.record(tmp_path / name, determinism=False):
            model(torch.randn(4, 8)).sum().backward()
        assert json.loads((tmp_path / name / "manifest.json").read_text())["collector_errors"] == []
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    assert bitguard.compare(tmp_path / "a", tmp_path / "c").verdict == "diverged"


@pytest.mark.parametrize("determinism", [True, False])
def test_compiling_under_the_determinism_controls_is_said_once(tmp_path, capfd, determinism):
    """Helper 90: a compiled run recorded under the determinism controls ends with other weights than a plain run
    (inductor's deterministic kernels), documented in docs/STACKS.md and said nowhere while recording."""
    dynamo.reset()
    with bitguard.record(tmp_path / "run", determinism=determinism):
        for _ in range(2):
            torch.compile(Net(), backend="eager")
    said = capfd.readouterr().err.count("torch.compile then generates deterministic kernels")
    assert said == (1 if determinism else 0), said
