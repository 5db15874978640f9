"""Collectives paired by content (backend/content_pairs.py): a run that issues the same all-gathers
in another order, or one step earlier (FSDP2's explicit prefetching), computed the same; a gather
that moved other bytes is still found."""

from __future__ import annotations

import os

import pytest

from bitguard.backend.compare import compare
from bitguard.schema import EVENTS, META, RANK_FILE, SCHEMA_VERSION, STACKS, TENSORS
from fixtures_runs import _digest, _table, write_manifest, write_rank_file

GATHER = "comm.all_gather_into_tensor#0"
LAYERS, STEPS = 3, 3


def _run(path: str, order: str, bad: tuple | None = None) -> str:
    """One rank, STEPS steps of LAYERS layers, each layer's weights gathered before its forward.
    order "each": gather, forward, gather, forward...; "ahead": all of a step's gathers first;
    "next": as "ahead", but the first gather of the next step is issued at the end of this one
    (after the optimizer step). `bad` (step, layer): that gather moved other bytes."""
    events, tensors = [], []

    def add(step, phase, boundary, module_type, kind, rows):
        seq = len(events)
        events.append((seq, 0, 1, step, phase, boundary, module_type, kind, 0, 0 if phase == "comm" else 1,
                       "MainThread", "cpu", None, 1_000 * seq, 1_000 * seq + 500, 1))
        for role, shape, x in rows:
            tensors.append((seq, role, 0, "@0" if phase == "comm" else "[0]", shape, "float32", [1] * len(shape),
                            4 * shape[0], x, _digest("pos", x), seq, 0, None, None))

    def gather(step, layer):
        x = _digest("w", step, layer, bad == (step, layer))
        add(step, "comm", GATHER, "gather", "collective", [("input", [8], x), ("output", [16], _digest("g", x))])

    def forward(step, layer):
        add(step, "forward", f"layers.{layer}", "Linear", "module",
            [("input", [4], _digest("a", step, layer)), ("output", [4], _digest("a", step, layer + 1))])

    for step in range(STEPS):
        first = 1 if order == "next" and step else 0  # its first gather was issued at the end of the step before
        if order == "each":
            for layer in range(LAYERS):
                gather(step, layer)
                forward(step, layer)
        else:
            for layer in range(first, LAYERS):
                gather(step, layer)
            for layer in range(LAYERS):
                forward(step, layer)
        add(step, "optimizer", "SGD", "SGD", "step", [("state", [4], _digest("opt", step))])
        if order == "next" and step + 1 < STEPS:
            gather(step + 1, 0)  # counted in this step
    os.makedirs(path)
    write_manifest(path, 1)
    meta = [("schema_version", str(SCHEMA_VERSION)), ("status", '"complete"'), ("mode", '"full"'), ("rank", "0")]
    write_rank_file(os.path.join(path, RANK_FILE.format(rank=0)), [{
        EVENTS.name: _table(EVENTS, events), TENSORS.name: _table(TENSORS, tensors),
        STACKS.name: _table(STACKS, [(1, '["train.py:10 in main"]')]), META.name: _table(META, meta)}])
    return path


@pytest.mark.parametrize("order", ["ahead", "next"])
def test_gathers_issued_in_another_order_or_a_step_early_compare_identical(tmp_path, order):
    c = compare(_run(str(tmp_path / "a"), "each"), _run(str(tmp_path / "b"), order))
    assert c.verdict == "identical", c.to_dict()["first_divergence"]
    assert c.ranks[0].summary.alignment["gaps_a"] == 0 and c.ranks[0].summary.alignment["gaps_b"] == 0


@pytest.mark.parametrize("order", ["each", "ahead", "next"])
def test_a_gather_that_moved_other_bytes_is_the_first_divergence(tmp_path, order):
    c = compare(_run(str(tmp_path / "a"), "each"), _run(str(tmp_path / "b"), order, bad=(1, 2)))
    fd = c.to_dict()["first_divergence"]
    assert c.verdict == "diverged"
    assert (fd["step"], fd["boundary"]) == (1, GATHER), fd
    # the gather paired with it is layer 2's of step 1, the one that carried those weights in run A
    first = c.ranks[0].pivot
    ta = c.ranks[0].tensors_a
    tensors = ta.filter((ta["seq"] == first["seq"]) & (ta["role"] == "input"))
    assert tensors["xor"][0] == _digest("w", 1, 2, False)


def _two_models(path, order, scale=1.0) -> None:
    """An encoder and a decoder whose parts have the same paths (`fc.weight`, `fc.bias`), each parameter with
    an optimizer of its own, stepped in `order` (Pyro steps them in the order of a set); `scale` multiplies
    the decoder's input at step 1."""
    import torch
    import torch.nn as nn

    import bitguard

    torch.manual_seed(0)
    enc, dec = nn.Sequential(), nn.Sequential()
    enc.fc, dec.fc = nn.Linear(4, 4), nn.Linear(4, 4)  # (the same shapes: nothing but the order tells them apart)
    params = [*enc.parameters(), *dec.parameters()]
    opts = [torch.optim.SGD([p], lr=0.1) for p in params]
    with bitguard.record(path, determinism=False):
        for step in range(3):
            h = enc(torch.randn(5, 4))
            dec(h * (scale if step == 1 else 1.0)).pow(2).mean().backward()
            for i in order:
                opts[i].step()
                opts[i].zero_grad()


def test_parameters_of_two_models_with_the_same_names_stepped_in_another_order_pair_by_their_gradients(tmp_path):
    """Helper 78 (Pyro: an encoder and a decoder with an `fc` each, each parameter's optimizer stepped in a set's
    order): the k-th `fc.bias` step of run A was compared with the other model's in run B, and two recordings of
    one script diverged at step 0. A difference is still found at its step."""
    _two_models(tmp_path / "a", [0, 1, 2, 3])
    _two_models(tmp_path / "b", [2, 3, 0, 1])
    _two_models(tmp_path / "c", [3, 1, 2, 0], scale=2.0)
    same = compare(tmp_path / "a", tmp_path / "b")
    assert same.verdict == "identical", same.first_divergence
    fd = compare(tmp_path / "a", tmp_path / "c").first_divergence
    assert fd is not None and fd["step"] == 1, fd
