"""A module blamed as a source whose input is a tensor an earlier call returned says that the input's
digest was reused (its version counter unchanged), so an edit through `.data` between the two calls
would show there (helper 36: `h = a(x); h.data.mul_(1.001); b(h)` was blamed on b as a source,
its input shown equal)."""

from __future__ import annotations

import torch
import torch.nn as nn

import bitguard


class P(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x, edit: bool = False):
        h = self.a(x)
        if edit:
            h.data.mul_(1.001)  # (no version counter moves)
        return self.c(torch.tanh(self.b(h)))


def _run(path, edit: bool, cache: bool = True) -> None:
    torch.manual_seed(0)
    m = P()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with bitguard.record(path, determinism=False, digest_cache=cache):
        for _ in range(2):
            loss = (m(torch.randn(4, 8), edit) - torch.randn(4, 1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_a_source_fed_a_cached_digest_says_so(tmp_path):
    _run(tmp_path / "a", False)
    _run(tmp_path / "b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["boundary"], fd["phase"], fd["blame"]) == ("b", "forward", "source"), fd
    assert any("digested there and not again" in n and "--no-digest-cache" in n for n in fd["notes"]), fd["notes"]


def test_without_the_cache_the_edit_is_seen_and_nothing_is_said(tmp_path):
    _run(tmp_path / "a", False, cache=False)
    _run(tmp_path / "b", True, cache=False)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert fd["blame"] != "source" or fd["boundary"] != "b", fd
    assert not any("digested there and not again" in n for n in fd["notes"]), fd["notes"]
