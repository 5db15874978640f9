"""A difference a rule accepts in what the training saved (a row of a checkpoint that differs from run
to run: a host's id, a time bitguard does not recognise as one) does not flow into the computation:
helper 59 (mmengine) found a wrong branch after such a save said "follows an accepted difference" and
the comparison inconclusive with no pivot, and a metric read out of a tensor that differs said
identical once any rule had fired."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

import bitguard

RULES = {"schema": "bitguard.rules/1", "rules": [{"id": "host", "action": "ignore", "match": {"path": "*hostid*"}}]}


class Net(torch.nn.Module):
    def __init__(self, branch_at: int | None):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
        self.calls, self.branch_at = 0, branch_at

    def forward(self, x):
        self.calls += 1
        h = self.fc1(x)
        return self.fc2(F.leaky_relu(h, 0.01) if self.calls == self.branch_at else F.relu(h))


def _run(path, tmp, branch_at=None, threshold=0.1):
    torch.manual_seed(0)
    model = Net(branch_at)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    with bitguard.record(path, determinism=False):
        for step in range(5):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 1:  # (a checkpoint with a row that differs between any two runs: a rule accepts it)
                torch.save({"model": model.state_dict(), "hostid": torch.tensor(list(os.urandom(8)))}, tmp / "ck.pt")
        with torch.no_grad():
            (model(x)[:, 0] * threshold).sum().item()  # an evaluation's metric, read out of a tensor


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accepted")
    (tmp / "rules.json").write_text(json.dumps(RULES))
    _run(tmp / "a", tmp)
    _run(tmp / "b", tmp)
    _run(tmp / "branch", tmp, branch_at=4)
    _run(tmp / "metric", tmp, threshold=0.2)
    return tmp


def test_the_accepted_save_alone_is_identical(runs):
    c = bitguard.compare(runs / "a", runs / "b", rules=str(runs / "rules.json"))
    assert c.verdict == "identical", c.certification_reasons()
    assert bitguard.compare(runs / "a", runs / "b").verdict == "diverged"  # (without the rule: the save differs)


def test_a_wrong_branch_after_an_accepted_save_is_the_pivot(runs):
    c = bitguard.compare(runs / "a", runs / "branch", rules=str(runs / "rules.json"))
    fd = c.first_divergence
    assert c.verdict == "diverged", c.certification_reasons()
    assert (fd["step"], fd["phase"], fd["boundary"]) == (3, "forward", "fc2"), fd
    assert not (c.events()["status"] == "follows").any()


def test_a_metric_that_differs_after_an_accepted_save_is_not_identical(runs):
    c = bitguard.compare(runs / "a", runs / "metric", rules=str(runs / "rules.json"))
    assert c.verdict == "inconclusive", c.first_divergence
    assert "computed" in {r["code"] for r in c.certification_reasons()}
