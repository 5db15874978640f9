"""What the training saves (collectors/saved.py): the tensors of a saved object are found in a fixed
order and named by where they are; the save functions are wrapped so that each save the user's code
makes is seen once, before it writes, and the save itself is untouched."""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn as nn

from bitguard.collectors import saved
from bitguard.collectors.saved import SaveWatch, tensors_in


def test_a_checkpoint_s_tensors_are_named_by_where_they_are_and_numbers_left_out():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "time": 1.5e9,
                  "note": "x", "extra": [torch.ones(1), (torch.zeros(2),)]}
    checkpoint["again"] = checkpoint  # a container holding itself is walked once
    pairs, truncated = tensors_in(checkpoint)
    paths = [p for p, _ in pairs]
    assert truncated is None
    assert paths[:3] == ["['model']['0.weight']", "['model']['0.bias']", "['model']['1.weight']"]
    assert "['optimizer']['state'][0]['exp_avg']" in paths and "['extra'][1][0]" in paths
    assert not any("epoch" in p or "time" in p or "note" in p or "again" in p for p in paths)
    assert all(isinstance(t, torch.Tensor) for _, t in pairs)
    # a module saved whole: its parameters and buffers; a tensor saved alone
    assert [p for p, _ in tensors_in(model)[0]][:2] == [".0.weight", ".0.bias"]
    assert [p for p, _ in tensors_in(torch.ones(2))[0]] == ["[]"]
    # NumPy arrays of numbers are taken (an object array is not); a long list of numbers is passed over
    pairs, truncated = tensors_in({"rng": ("MT19937", np.arange(4, dtype=np.uint32)), "objects": np.array([None]),
                                   "indices": list(range(2 * saved.MAX_VISITS))})
    assert [(p, t.tolist()) for p, t in pairs] == [("['rng'][1]", [0, 1, 2, 3])] and truncated is None


def test_an_object_too_big_to_walk_is_marked_not_taken_whole(monkeypatch):
    monkeypatch.setattr(saved, "MAX_TENSORS", 3)
    pairs, truncated = tensors_in([torch.ones(1) for _ in range(5)])
    assert len(pairs) == 3 and "not looked at" in truncated


def test_each_save_of_the_user_is_seen_once_before_it_writes():
    seen, original = [], torch.save
    watch = SaveWatch(lambda boundary, obj: seen.append((boundary, type(obj).__name__))).install()
    try:
        buffer = io.BytesIO()
        torch.save({"w": torch.ones(2)}, buffer)
        assert seen == [("torch.save", "dict")]
        assert torch.equal(torch.load(io.BytesIO(buffer.getvalue()))["w"], torch.ones(2))  # written as ever
        import safetensors.torch as st

        st.save_model(nn.Linear(2, 2), str(_tmp_file()))  # (calls save_file itself: one event)
        assert seen[1:] == [("safetensors.save_model", "Linear")]
    finally:
        watch.remove()
    torch.save(torch.ones(1), io.BytesIO())
    assert len(seen) == 2 and torch.save is original  # removed: the original is back


def _tmp_file():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp()) / "m.safetensors"
