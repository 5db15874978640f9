"""A module call that draws random numbers in one run alone (composer's StochasticDepth, whose coin kept
every block: helper 60) is the pivot, its own draw blamed: its RNG state row, which only the run that drew
records, was said to be a signature change ("could not be observed"), and the pivot came a step later,
at the data event whose RNG state differed."""

from __future__ import annotations

import torch
import torch.nn as nn

import bitguard


class Block(nn.Module):
    def __init__(self, draw: bool):
        super().__init__()
        self.lin, self.draw = nn.Linear(4, 4), draw

    def forward(self, x):
        if self.draw:
            torch.bernoulli(torch.tensor(1.0))  # (p = 1: the block is kept, but the generator moved)
        return x + self.lin(x)


def _run(path, draw: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(draw), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(path, determinism=False):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()


def test_a_call_that_draws_in_one_run_alone_is_the_pivot_and_its_own_draw_is_blamed(tmp_path):
    _run(tmp_path / "a", False)
    _run(tmp_path / "b", True)
    for first, second, alone in (("a", "b", "B"), ("b", "a", "A")):
        c = bitguard.compare(tmp_path / first, tmp_path / second)
        fd = c.first_divergence
        assert (c.verdict, fd["step"], fd["phase"], fd["boundary"], fd["blame"]) == \
            ("diverged", 0, "forward", "0", "source"), fd
        assert fd["blame_window"]["detail"].startswith(f"this call drew random numbers in run {alone} alone"), fd
        assert [t["role"] for t in fd["tensors"] if t["differs"]] == ["rng"], fd["tensors"]
        assert not any("could not be observed" in r["message"] for r in c.certification_reasons())


class _Noise(nn.Module):  # (a standalone augmentation, called before the model, as SpecAugment's masks are)
    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


def test_an_rng_pivot_before_a_model_whose_weights_differ_names_them(tmp_path):
    """Helper 88 (torchaudio): one weight re-initialised after construction (xavier_uniform_ draws from the global
    generator) in run B; a standalone augmentation runs before the model's first call, so the pivot is its RNG
    state ("random numbers were drawn a different number of times"), and the model's initial weights, which
    differ and are the cause, were named nowhere."""
    for name, reinit in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        if reinit:
            nn.init.xavier_uniform_(model[2].weight)
        noise, opt = _Noise(), torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(tmp_path / name, determinism=False):
            for _ in range(2):
                opt.zero_grad()
                model(noise(torch.ones(3, 4))).pow(2).mean().backward()
                opt.step()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["boundary"], fd["fault_class"]) == (0, "_Noise", "rng"), fd
    assert any(n.startswith("the parameters of Sequential differ too") for n in fd["notes"]), fd["notes"]
