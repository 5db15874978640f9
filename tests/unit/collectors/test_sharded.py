"""collectors/sharded.py and the step hook around it: FSDP names and flat layouts, a DTensor's shard
description, a subclass bitguard does not know, and a step hook that fails without losing the
step or the other parameters' events."""

from __future__ import annotations

from types import SimpleNamespace

import polars as pl
import pytest
import torch
from torch.distributed.fsdp._flat_param import ParamInfo, _ShardParamInfo
from torch.testing._internal.two_tensor import TwoTensor

import bitguard
from bitguard.backend.ingest import load_rank, open_run
from bitguard.collectors import sharded
from bitguard.collectors.hooks import Collector
from bitguard.collectors.observation import observe
from bitguard.cuda.fingerprint import digest_async, resolve


@pytest.mark.parametrize("name, clean", [
    ("_fsdp_wrapped_module.0._fsdp_wrapped_module.weight", "0.weight"),
    ("_fsdp_wrapped_module", ""),
    ("layers.1._checkpoint_wrapped_module.mlp", "layers.1.mlp"),
    ("model.my_fsdp_wrapped_module_x.w", "model.my_fsdp_wrapped_module_x.w"),  # only whole levels go
    ("head.bias", "head.bias"),
])
def test_clean_name_takes_out_whole_wrapper_levels(name, clean):
    assert sharded.clean_name(name) == clean


def _rank1_of_two():
    """What FSDP1 builds on rank 1 of 2 for a Linear(8, 16): a flat [weight (128), bias (16)] of 144
    elements, rank 1 holding elements 72..143: weight's 72..127 then all of bias."""
    linear = torch.nn.Linear(8, 16)
    return SimpleNamespace(
        _fqns=("weight", "bias"), _shapes=(torch.Size([16, 8]), torch.Size([16])), _numels=(128, 16),
        _numels_with_padding=(128, 16), _is_padding_mask=[False, False],
        _param_infos=(ParamInfo("weight", linear, ""), ParamInfo("bias", linear, "")),
        _shard_param_infos=(_ShardParamInfo(True, 0, 56, 72, 127), _ShardParamInfo(True, 56, 16, 0, 15)))


def _layout(flat) -> sharded.FlatLayout:
    tids = iter(range(-1, -100, -1))
    pieces = sharded._pieces(flat, "body.0", lambda: next(tids))
    return sharded.FlatLayout(lambda: None, "body.0._flat_param", "Linear", pieces, 144, 72, ())


def test_a_flat_gradient_and_a_flat_shard_split_into_the_original_parameters():
    layout = _layout(_rank1_of_two())
    assert [(p.name, p.owner, p.shape) for p in layout.pieces] == [("body.0.weight", "Linear", (16, 8)),
                                                                    ("body.0.bias", "Linear", (16,))]
    grad = torch.arange(144.0)
    (w, gw), (b, gb) = sharded.unsharded_parts(layout, grad)
    assert torch.equal(gw, torch.arange(128.0).view(16, 8)) and torch.equal(gb, torch.arange(128.0, 144.0))
    shard = torch.arange(72.0, 144.0)  # this rank's part of the same flat tensor
    sw, sb = sharded.sharded_parts(layout, shard)
    assert torch.equal(sw, gw.flatten()[72:]) and torch.equal(sb, gb)
    assert w.shard == "FSDP FlatParameter shard: elements [72, 128) of the flattened 128" and b.shard is None
    assert w.tid != b.tid and w.tid < 0
    # a tensor of another size is not attributed (the collector records it whole, marked)
    assert sharded.unsharded_parts(layout, torch.zeros(143)) is None
    assert sharded.sharded_parts(layout, torch.zeros(144)) is None


def test_a_step_event_per_original_parameter_this_rank_holds_a_part_of():
    flat = _rank1_of_two()
    flat._shard_param_infos = (_ShardParamInfo(True, 0, 72, 0, 71), _ShardParamInfo(False, None, None, None, None))
    param, state = torch.nn.Parameter(torch.arange(72.0)), torch.zeros(72)
    layout = _layout(flat)
    layout.ref = lambda: param
    params = sharded.ShardedParams(SimpleNamespace())
    params.flats[id(param)] = layout
    parts = params.step_parts(param, [("param", 0, "", param), ("state", 0, "['step']", torch.tensor(1.0)),
                                      ("state", 1, "['exp_avg']", state)])
    assert [name for name, *_ in parts] == ["body.0.weight"]  # no element of the bias on this rank: no event
    (_, tensors, marks), = parts
    assert [tuple(t.shape) for *_, t in tensors] == [(72,), (), (72,)]
    shard = "FSDP FlatParameter shard: elements [0, 72) of the flattened 128"
    assert marks == [((16, 8), shard, layout.pieces[0].tid), None, ((16, 8), shard, None)]
    assert params.step_parts(torch.nn.Parameter(torch.zeros(72)), []) is None  # another parameter: as it is


def test_a_dtensor_row_says_which_shard_it_holds():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        d = distribute_tensor(torch.randn(4, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
        shape, _, nbytes, _, unobserved, values, shard = observe(torch.nn.Parameter(d))
        assert shape == [4, 3] and nbytes == 48 and unobserved is None and torch.equal(values, d.to_local())
        assert shard == "DTensor Shard(dim=0) on mesh (1,) at (0,): local [4, 3] from [0, 0]"
        assert sharded.shard_of(d.to_local()) is None
    finally:
        dist.destroy_process_group()


def test_a_collective_result_in_flight_is_digested_as_its_values():
    """Tensor parallelism's outputs are AsyncCollectiveTensors (a functional collective not yet
    waited for): they were unobserved, so a TP run could never be certified identical."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        y = funcol.all_reduce(torch.arange(6.0), "sum", dist.group.WORLD)
        assert isinstance(y, funcol.AsyncCollectiveTensor)
        *_, digest, unobserved, values, shard = observe(y)
        assert unobserved is None and shard is None and torch.equal(values, torch.arange(6.0))
        assert digest == digest_async(torch.arange(6.0))
    finally:
        dist.destroy_process_group()


def test_a_subclass_that_says_what_it_is_made_of_is_digested_by_its_inner_tensors():
    """Helper 53 (torchao's quantized weights): a subclass with its own __torch_dispatch__ was never
    digested, and every run holding one inconclusive. One with `__tensor_flatten__` is digested by
    its inner tensors and flatten context; another stays unobserved, its type named."""
    t = TwoTensor(torch.zeros(3), torch.ones(3))
    shape, strides, nbytes, digest, unobserved, values, shard = observe(t)
    assert unobserved is None and shard is None and shape == [3] and nbytes == values.numel()
    header = repr([("a", [3], "torch.float32"), ("b", [3], "torch.float32")]) + "None"
    assert bytes(values[:len(header)].tolist()) == header.encode()
    assert torch.equal(values[len(header):], torch.cat([torch.zeros(3), torch.ones(3)]).view(torch.uint8))
    swapped = observe(TwoTensor(torch.ones(3), torch.zeros(3)))[3]
    assert resolve([digest]) != resolve([swapped])

    class Opaque(TwoTensor):  # (its own dispatch, and nothing said of what it holds)
        __tensor_flatten__ = None

    *_, unobserved, values, shard = observe(Opaque(torch.zeros(3), torch.ones(3)))
    assert unobserved.startswith("Opaque is a tensor subclass with its own __torch_dispatch__")
    assert values is None and shard is None


# -- the step hook ---------------------------------------------------------------------------------
def _train(path, steps: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(path, determinism=False):
        for _ in range(steps):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    return open_run(path).manifest, load_rank(open_run(path), 0)[0]


def test_a_failing_step_hook_still_advances_the_step(tmp_path, monkeypatch):
    def broken(self, optimizer):
        raise RuntimeError("boom")

    monkeypatch.setattr(Collector, "_emit_steps", broken)
    manifest, events = _train(tmp_path / "run")
    assert manifest["steps_completed"] == 3
    assert any("boom" in e for e in manifest["collector_errors"])
    forward = events.filter(pl.col("phase") == "forward")
    assert sorted(forward["step"].unique().to_list()) == [0, 1, 2]


def test_one_parameter_failing_loses_no_other_parameters_event(tmp_path, monkeypatch):
    emit = Collector._emit_step

    def fails_for_one(self, tensors, name, *args):
        if tuple(tensors[0][3].shape) == (4, 3):  # (the param row) the first parameter the step meets
            raise RuntimeError("boom")
        return emit(self, tensors, name, *args)

    monkeypatch.setattr(Collector, "_emit_step", fails_for_one)
    manifest, events = _train(tmp_path / "run")
    steps = events.filter(pl.col("kind") == "step").group_by("step").agg(pl.col("boundary"))
    assert {r["step"]: sorted(r["boundary"]) for r in steps.iter_rows(named=True)} == \
        {s: ["0.bias", "1.bias", "1.weight"] for s in range(3)}
    assert manifest["steps_completed"] == 3 and any("boom" in e for e in manifest["collector_errors"])


class _FakeCollector:
    """What ShardedParams uses of a Collector: rows and events kept in lists."""

    def __init__(self):
        self.events = []

    def _in_window(self):
        return True

    def _backward_stack(self):
        return 0

    def _row(self, t, role, idx, path):
        return [0, role, idx, path, tuple(t.shape), "float32", [], t.nbytes, int(t.sum()), 0, 0, 0, None, None]

    def _emit(self, phase, kind, name, owner, depth, t0, rows, stack):
        self.events.append((name, owner, rows))


def _flat_grad_events(numel: int, grad_there: bool):
    flat = torch.nn.Parameter(torch.zeros(72))
    if grad_there:  # a .grad already there (its size is not what the hook looks at)
        flat.grad = torch.zeros(72)
    layout = _layout(_rank1_of_two())
    layout.ref = lambda: flat
    collector = _FakeCollector()
    sharded.ShardedParams(collector)._on_flat_grad(layout, torch.ones(numel))
    return collector.events


def test_a_flat_gradient_gives_one_gradient_event_per_original_parameter():
    events = _flat_grad_events(144, grad_there=False)
    assert [(name, owner) for name, owner, _ in events] == [("body.0.weight", "Linear"), ("body.0.bias", "Linear")]
    (_, _, (w_in, w)), (_, _, (b_in, b)) = events
    assert (w_in[1], w_in[4], w_in[8]) == ("grad_input", (16, 8), 128) and (w[1], w[8], w[12]) == ("grad", 128, None)
    assert (b_in[4], b_in[8], b_in[13]) == ((16,), 16, None)


def test_a_flat_gradient_of_another_size_is_one_marked_event_and_an_accumulation_is_not_guessed():
    (name, owner, rows), = _flat_grad_events(100, grad_there=False)
    assert (name, owner) == ("body.0._flat_param", "Linear")
    assert all(r[13] == f"{sharded.NOT_ATTRIBUTED}: a gradient of 100 elements, not 144" for r in rows)
    events = _flat_grad_events(144, grad_there=True)  # autograd adds it to .grad after the hook
    assert all(rows[1][12] == sharded.ACCUMULATED and rows[1][8] == 0 and rows[0][12] is None
               for _, _, rows in events)


def test_the_final_event_holds_the_original_parameters_of_a_flat_one():
    flat = _rank1_of_two()
    param, other = torch.nn.Parameter(torch.arange(72.0)), torch.nn.Parameter(torch.zeros(3))
    layout = _layout(flat)
    layout.ref = lambda: param
    params = sharded.ShardedParams(SimpleNamespace())
    params.flats[id(param)] = layout
    pairs, marks = params.final_params([(".body.0._flat_param", param), (".other", other)])
    assert [path for path, _ in pairs] == [".body.0.weight", ".body.0.bias", ".other"]
    assert [t.numel() for _, t in pairs] == [56, 16, 3] and marks[2] is None
    assert marks[0][:2] == ((16, 8), "FSDP FlatParameter shard: elements [72, 128) of the flattened 128")
