"""A module blamed as a source whose input is a tensor an earlier call returned says that the input's
digest was reused (its version counter unchanged), so an edit through `.data` between the two calls
would show there (helper 36: `h = a(x); h.data.mul_(1.001); b(h)` was blamed on b as a source,
its input shown equal); and a module's backward blamed as a source whose input the root returns
says so too (helper 46)."""

from __future__ import annotations

import torch
import torch.nn as nn

import bitguard


class P(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    edit = False  # (an attribute, not an argument: a number given to the call is recorded as its input)

    def forward(self, x):
        h = self.a(x)
        if self.edit:
            h.data.mul_(1.001)  # (no version counter moves)
        return self.c(torch.tanh(self.b(h)))


def _run(path, edit: bool, cache: bool = True) -> None:
    torch.manual_seed(0)
    m = P()
    m.edit = edit
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    with bitguard.record(path, determinism=False, digest_cache=cache):
        for _ in range(2):
            loss = (m(torch.randn(4, 8)) - torch.randn(4, 1)).pow(2).mean()
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


class Returned(nn.Module):
    """h46's data_edit2.py: `h` read by `act`, edited through `.data`, and returned to the loss."""

    def __init__(self):
        super().__init__()
        self.lin, self.act, self.out = nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)

    edit = False

    def forward(self, x):
        h = self.lin(x)
        a = self.act(h)
        if self.edit:
            h.data.mul_(2)
        return self.out(a), h


def test_a_backward_source_whose_input_the_root_returns_says_so(tmp_path):
    """Helper 46: the root's output row reused the digest `act`'s input took (an edit through .data
    moves no version counter), the loss read the edited tensor, and the first difference was the
    gradient of act's input, blamed on act's backward with no word of either."""
    for name, edit in (("a", False), ("b", True)):
        torch.manual_seed(0)
        m = Returned()
        m.edit = edit
        with bitguard.record(tmp_path / name, determinism=False):
            y, h = m(torch.randn(8, 4))
            (h.pow(2).mean() + y.mean()).backward()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["boundary"], fd["phase"], fd["blame"]) == ("act", "backward", "source"), fd
    assert any(n.startswith("its input is also what Returned returns to the training's code (output[1])")
               for n in fd["notes"]), fd["notes"]


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))

    def forward(self, u, v):
        return (u + v) @ self.w


class Two(nn.Module):
    """Two calls' outputs into a third: the note names both producers as two."""

    def __init__(self):
        super().__init__()
        self.a1, self.a2, self.join = nn.Linear(8, 16), nn.Linear(8, 16), Join()

    edit = False

    def forward(self, x):
        h1, h2 = self.a1(x), self.a2(x)
        if self.edit:
            h1.data.mul_(1.001)
        return self.join(h1, h2)


def test_a_note_on_inputs_two_calls_returned_names_both(tmp_path):
    """Helper 47: "its input is the tensor model.0, model.1 returned" read as one module's name."""
    for name, edit in (("a", False), ("b", True)):
        torch.manual_seed(0)
        m = Two()
        m.edit = edit
        with bitguard.record(tmp_path / name, determinism=False):
            m(torch.randn(4, 8)).sum().backward()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["boundary"], fd["phase"], fd["blame"]) == ("join", "forward", "source"), fd
    assert any(n.startswith("its inputs include tensors that a1 and a2 returned") for n in fd["notes"]), fd["notes"]


def test_no_note_where_only_the_buffers_of_the_pivot_differ(tmp_path):
    """Helper 58: a batch norm's running mean set by hand between two steps differs after its call,
    its input (a digest reused from the Linear before it) and its output equal: an input edited
    unseen would have changed what the call returned, so the note on the reused digest is noise."""
    for name, edit in (("a", False), ("b", True)):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
        with bitguard.record(tmp_path / name, determinism=False):
            for step in range(2):
                if edit and step == 1:
                    with torch.no_grad():
                        m[1].running_mean.mul_(0.5)
                m(torch.randn(32, 8)).pow(2).mean().backward()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["boundary"], fd["phase"], fd["blame"]) == ("1", "forward", "source"), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == [".running_mean"], fd["tensors"]
    assert not any("digested there and not again" in n for n in fd["notes"]), fd["notes"]
