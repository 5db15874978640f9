"""A forward blamed as a source after a backward inside its step says that weights edited since the
step's params event through .data are not observed (helper 14: peft's merge_adapter/unmerge_adapter
between two micro-batches left round-off in a frozen weight, blamed on the Conv1D alone)."""

from __future__ import annotations

import torch.nn as nn

import bitguard

from .recorded_sgd import record_sgd


def _run(path, edit: float):
    def between(model, step, micro):
        if micro == 0 and step == 1:  # (in step 0 every call has its params event)
            model[2].weight.data[0, 1] += edit  # (no version counter moves)

    record_sgd(path, lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), micro=2,
               after_backward=between)


def test_a_source_after_a_backward_in_its_step_says_what_is_not_observed_there(tmp_path):
    _run(tmp_path / "a", 0.0)
    _run(tmp_path / "b", 1e-3)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["boundary"], fd["call"], fd["blame"]) == (1, "forward", "2", 1, "source"), fd
    assert any("after its parameters were last recorded" in n for n in fd["notes"]), fd["notes"]


def _rollout(path, edit: float, data: bool = True):
    """SB3's shape: each step, the policy is called several times without gradients (a rollout, eval
    mode), a callback between two calls, then trained once (`data`: its edit through .data)."""
    import torch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(path, determinism=False):
        for step in range(2):
            model.eval()
            with torch.no_grad():
                for call in range(3):
                    model(torch.randn(3, 4))
                    if step == 1 and call == 0:  # (a callback's edit, under no_grad)
                        (model[2].weight.data if data else model[2].weight)[0, 1] += edit
            model.train()
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()


def test_a_source_after_other_calls_in_its_step_says_what_is_not_observed_there(tmp_path):
    """Helper 28: a weight edited by a callback between two rollout calls of a step (no backward, no
    change of mode between them) was blamed on the Linear as a source, reading as a faulty kernel. Edited
    through .data (no version counter moves) it still is, with the note; edited in place, the call after
    the edit has a params event of its own (helper 77), where the edit is found."""
    _rollout(tmp_path / "a", 0.0)
    _rollout(tmp_path / "b", 1e-3)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["boundary"], fd["call"], fd["blame"]) == (1, "forward", "2", 1, "source"), fd
    assert any("earlier call(s) of the model ran in step 1 after its parameters were last recorded" in n
               for n in fd["notes"]), fd["notes"]
    _rollout(tmp_path / "c", 0.0, data=False)
    _rollout(tmp_path / "d", 1e-3, data=False)
    fd = bitguard.compare(tmp_path / "c", tmp_path / "d").first_divergence
    assert (fd["step"], fd["kind"], fd["call"], fd["blame"], fd["fault_class"]) == (1, "params", 1, "source", "params"), fd


def test_a_module_without_parameters_is_not_said_to_have_had_its_weights_edited(tmp_path):
    """Helper 33 (a torchmetrics metric called as a module after the model): the note on weights
    edited between two calls was attached to a module that holds none."""
    import torch

    class Scaled(nn.Module):  # (no parameters: its own code alone makes its output)
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, x):
            return x * self.scale

    def run(path, changed):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), Scaled(1.0), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(path, determinism=False):
            for step in range(2):
                with torch.no_grad():
                    model(torch.randn(3, 4))
                    if step == 1 and changed:
                        model[1].scale = 2.0  # (not a weight: an attribute its forward reads)
                    model(torch.randn(3, 4))
                opt.zero_grad()
                model(torch.randn(3, 4)).pow(2).mean().backward()
                opt.step()

    run(tmp_path / "a", False)
    run(tmp_path / "b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["boundary"], fd["call"], fd["blame"]) == (1, "forward", "1", 1, "source"), fd
    assert not any("weights edited between two calls" in n for n in fd["notes"]), fd["notes"]


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: a params event names it once, `.emb.weight`

    def forward(self, idx):
        return self.head(self.mid(self.emb(idx)))


def _tied(path, edit: float):
    import torch

    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.tensor([[1, 2, 4]])  # (row 3 of the embedding is not looked up: only the head reads it)
    with bitguard.record(path, determinism=False):
        for step in range(2):
            with torch.no_grad():
                model(idx)
                if step == 1:
                    model.head.weight.data[3] += edit  # the tied weight, between the two calls (no version moves)
            opt.zero_grad()
            model(idx).pow(2).mean().backward()
            opt.step()


def test_a_tied_weight_edited_between_two_calls_gets_the_note(tmp_path):
    """Helper 36: the output layer tied to the embedding held no parameter by the params event's paths,
    so an edit of the tied weight between two calls was blamed on the head without the note."""
    _tied(tmp_path / "a", 0.0)
    _tied(tmp_path / "b", 1e-3)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["step"], fd["phase"], fd["boundary"], fd["blame"]) == (1, "forward", "head", "source"), fd
    assert any("after its parameters were last recorded" in n for n in fd["notes"]), fd["notes"]
