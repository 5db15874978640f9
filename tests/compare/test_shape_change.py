"""A tensor whose shape differs between the runs shows both shapes, and a signature pivot its
twin's tensors beside its own (helper 14: a LoRA rank change
showed A's shape only, with equal zero digests, marked as differing)."""

from __future__ import annotations

import torch
import torch.nn as nn

import bitguard
from bitguard.backend.report import render_text

from .recorded_sgd import record_sgd


def _run(path, width: int):
    record_sgd(path, lambda: nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1)), steps=1)


def test_a_shape_change_names_both_shapes(tmp_path):
    _run(tmp_path / "a", 3)
    _run(tmp_path / "b", 5)
    comparison = bitguard.compare(tmp_path / "a", tmp_path / "b")
    fd = comparison.first_divergence
    shapes = {t["path"]: (t["shape"], t["shape_b"]) for t in fd["tensors"]}
    assert shapes[".0.weight"] == ([3, 4], [5, 4]) and shapes[".2.bias"] == ([1], None), shapes
    text = render_text(comparison)
    assert "float32[3, 4]→[5, 4]" in text, text


def _save(path, extra: bool):
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    with bitguard.record(path, determinism=False):
        model(torch.randn(3, 2)).sum().backward()
        state = {"model": model.state_dict(), **({"extra": torch.ones(3)} if extra else {})}
        torch.save(state, path.parent / f"{path.name}.pt")


def test_a_save_with_one_more_tensor_compares_the_tensors_both_hold(tmp_path):
    """helper 13 (a Lightning checkpoint with one more tensor): every tensor was listed as differing."""
    _save(tmp_path / "a", False)
    _save(tmp_path / "b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["kind"], fd["fault_class"]) == ("saved", "signature"), fd
    differing = {t["path"]: (t["differs"], t["a"]["xor"] is None) for t in fd["tensors"]}
    assert differing == {"['model']['weight']": (False, False), "['model']['bias']": (False, False),
                         "['extra']": (True, True), " (python keys)": (True, False),  # (its keys: one more)
                         "['model'] (python keys)": (False, False)}, differing


def test_tensors_one_run_alone_passes_show_their_own_shapes(tmp_path):
    """Helper 51 (TRL's packing on and off): a model given other keyword tensors in each run showed
    B's shapes beside A's by place, not by partner: `mask float32[4, 3]→[2]` where B has no mask and
    `[2]` was B's `pos`."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x, mask=None, pos=None, seq=None):
            return self.fc(x).sum()

    for name, batch in (("a", lambda x: {"x": x, "mask": torch.ones(4, 3)}),
                        ("b", lambda x: {"x": x * 2, "pos": torch.arange(2), "seq": torch.arange(5)})):
        torch.manual_seed(0)
        model = M()
        with bitguard.record(tmp_path / name, determinism=False):
            model(**batch(torch.randn(4, 3))).backward()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    shapes = {t["path"]: (t["shape"], t["shape_b"]) for t in fd["tensors"] if t["role"] == "input"}
    assert shapes == {"['x']": ([4, 3], None), "['mask']": ([4, 3], None), "['pos']": ([2], None),
                      "['seq']": ([5], None)}, shapes
