"""A call one run makes and the other does not (a "sanity" forward under no_grad before training)
shifts the pairing of the calls that follow: the pivot paired B's extra call with A's training call
and showed only A's stack, which named the training line as the place (helper 43, accelerate). The
pivot now shows B's stack where it differs, and says what such a difference means."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import bitguard
from incli import run_cli


def _train(path, extra: bool, lr: float = 0.1) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(6, 4)
    with bitguard.record(path, determinism=False):
        if extra:
            with torch.no_grad():
                model(torch.ones(2, 4))  # EXTRA CALL
        for i in range(3):
            model(x[2 * i:2 * i + 2]).pow(2).mean().backward()  # TRAINING CALL
            opt.step()
            opt.zero_grad()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("call_sites")
    _train(root / "a", extra=False)
    _train(root / "b", extra=True)
    _train(root / "lr", extra=False, lr=0.2)
    return root


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if f"# {marker}" in text)


def test_the_pivot_shows_run_bs_stack_where_it_differs(runs):
    fd = bitguard.compare(runs / "a", runs / "b").first_divergence
    assert (fd["step"], fd["call"]) == (0, 0), fd
    assert fd["stack"][-1].endswith(f"test_call_sites.py:{_line('TRAINING CALL')} in _train"), fd["stack"]
    assert fd["stack_b"][-1].endswith(f"test_call_sites.py:{_line('EXTRA CALL')} in _train"), fd["stack_b"]
    assert any("run B makes a call run A does not" in n and "run B's call 1 is made from that place" in n
               for n in fd["notes"]), fd["notes"]
    done = run_cli("compare", runs / "a", runs / "b")
    assert done.returncode == 1 and "call stack in B, which differs" in done.stdout, done.stdout
    assert "root module Linear: run B calls it more often in the step (its call 1" in done.stdout, done.stdout


def test_a_pivot_whose_stacks_differ_by_the_callers_lines_only_has_no_extra_call_note(runs):
    """The two runs were called from different lines of the fixture (as a script edited between two
    runs moves its lines): both stacks are shown, but no call was made in one run only."""
    fd = bitguard.compare(runs / "a", runs / "lr").first_divergence
    assert fd["phase"] == "optimizer" and fd["stack"] and fd["stack_b"] and fd["stack"] != fd["stack_b"], fd
    assert not any("does not" in n for n in fd["notes"]), fd["notes"]


def test_calls_from_two_places_paired_across_a_signature_change_say_the_pairing_is_off(tmp_path):
    """Helper 91 (TD3's policy_delay 2 -> 1): the rollout's predict in run A, on one observation, was paired with the
    actor update's call in run B, on a batch of 32, and blamed on the data, with no word that the two calls were
    made from different places."""

    def predict(model):
        with torch.no_grad():
            model(torch.ones(1, 4))  # ROLLOUT

    def update(model):
        with torch.no_grad():
            model(torch.ones(3, 4))  # UPDATE

    def train(path, other: bool):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with bitguard.record(path, determinism=False):
            for step in range(3):
                (update if other and step == 1 else predict)(model)
                model(torch.ones(2, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

    train(tmp_path / "a", False)
    train(tmp_path / "b", True)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert fd["step"] == 1, fd
    assert any(n.startswith("the two calls paired here are made from different places") for n in fd["notes"]), \
        fd["notes"]
