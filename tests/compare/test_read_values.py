"""A value the training read out of a tensor that differs while every recorded tensor is equal makes
a comparison inconclusive (a metric computed outside the recorded boundaries), but a time since 1970
read back in both runs, or a value read on a line that names it a time (`batch_time = ...`), is a time,
not a difference (helper 59: mmengine's Runner broadcasts its start
time as a tensor and reads it back), and a rule of phase `read` accepts another (helper 60: composer
reads each batch's wall-clock time back from a tensor: no rule could accept it, and every two runs
were inconclusive)."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch

import bitguard
from bitguard.backend.rules import RuleSet
from bitguard.errors import RulesError


def _run(path, read: str):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(path, determinism=False):
        for _ in range(2):
            t0 = time.perf_counter()
            model(torch.ones(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if read == "stamp":
                torch.tensor(time.time(), dtype=torch.float64).item()
            elif read == "named":  # (the reader's line says it reads a time: composer's `batch_time = ...`)
                time.sleep(0.002)
                step_time = torch.tensor([time.perf_counter() - t0]).item()
                batch_time = timedelta(seconds=torch.tensor([time.perf_counter() - t0]).item())
                assert step_time > 0 and batch_time.total_seconds() > 0
            else:
                time.sleep(0.002)
                torch.tensor([time.perf_counter() - t0]).item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reads")
    for name in ("stamp_a", "stamp_b", "dur_a", "dur_b", "named_a", "named_b"):
        _run(tmp / name, name.split("_")[0])
    return tmp


def test_a_time_read_back_in_both_runs_is_no_difference(runs):
    for name in ("stamp", "named"):
        c = bitguard.compare(runs / f"{name}_a", runs / f"{name}_b")
        assert c.verdict == "identical", (name, c.certification_reasons())


def test_a_duration_read_is_inconclusive_until_a_read_rule_accepts_it(runs, tmp_path):
    c = bitguard.compare(runs / "dur_a", runs / "dur_b")
    reasons = {r["code"]: r["message"] for r in c.certification_reasons()}
    assert c.verdict == "inconclusive" and "computed" in reasons, reasons
    assert '"match": {"phase": "read", "path": "*test_read_values.py:' in reasons["computed"], reasons["computed"]
    line = reasons["computed"].split('"path": "')[1].split('"')[0]
    for path, verdict in ((line, "identical"), ("*other.py:1", "inconclusive")):
        rules = tmp_path / "rules.json"
        rules.write_text(json.dumps({"schema": "bitguard.rules/1", "rules": [
            {"id": "wall", "action": "ignore", "match": {"phase": "read", "path": path}},
            {"id": "any", "action": "ignore", "match": {"path": "*"}}]}))  # (no phase read: never a read's)
        c = bitguard.compare(runs / "dur_a", runs / "dur_b", rules=str(rules))
        assert c.verdict == verdict, (path, c.certification_reasons())
        if verdict == "identical":
            assert c.to_dict()["rules_fired"] == [{"id": "wall", "count": 2}]


@pytest.mark.parametrize("rule, message", [
    ({"action": "allow-gap", "match": {"phase": "read"}}, "applies to 'ignore' rules only"),
    ({"action": "ignore", "match": {"phase": "read", "role": "output"}}, "remove role"),
    ({"action": "ignore", "match": {"phase": "reads"}}, "must be one of forward"),
])
def test_read_rules_are_checked(rule, message):
    with pytest.raises(RulesError, match=message):
        RuleSet.from_dict({"schema": "bitguard.rules/1", "rules": [{"id": "r", **rule}]})
