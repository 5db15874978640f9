"""A pivot whose tensors have another memory layout in one run (composer's ChannelsLast: helper 60) says so:
digests read values in order whatever the layout, so its inputs matched and "its computation differs", with
nothing said of the layout."""

from __future__ import annotations

import torch
import torch.nn as nn

import bitguard


def _run(path, channels_last: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 16, 2))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(path, determinism=False):
        for _ in range(2):
            x = torch.randn(8, 3, 4, 4)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()


def test_a_pivot_whose_tensors_have_another_layout_says_so(tmp_path):
    for name, last in (("a", False), ("b", True), ("c", False)):
        _run(tmp_path / name, last)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    notes = [n for n in fd["notes"] if n.startswith("the memory layout of")]
    assert len(notes) == 1 and "input[0]: strides [48, 16, 4, 1] in A, [48, 1, 12, 3] in B (channels_last in B)" \
        in notes[0], fd["notes"]
    assert [t["path"] for t in fd["tensors"] if t["role"] == "input" and t["differs"]] == [], fd["tensors"]
    assert bitguard.compare(tmp_path / "a", tmp_path / "c").verdict == "identical"
