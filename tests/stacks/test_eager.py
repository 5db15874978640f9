"""Eager training and bf16 autocast: the stacks tier's four claims (see harness.py)."""

import pytest

from . import harness as h

FAULT = {"STACK_FAULT": "module:step=2"}


@pytest.fixture(scope="module", params=[(), ("--autocast",)], ids=["eager", "autocast"])
def runs(request, tmp_path_factory):
    args = request.param
    tmp = tmp_path_factory.mktemp("eager")
    got = h.together({"plain": lambda: h.plain("eager.py", tmp, *args),
                      "a": lambda: h.recorded("eager.py", tmp / "a", *args),
                      "b": lambda: h.recorded("eager.py", tmp / "b", *args),
                      "fault": lambda: h.recorded("eager.py", tmp / "fault", *args, env=FAULT)})
    return {"plain": got["plain"], "a": got["a"][0], "ra": got["a"][1], "b": got["b"][0], "fault": got["fault"][0]}


def test_records_unedited_and_numbers_unchanged(runs):
    h.assert_unchanged(runs["plain"], runs["ra"])
    m = h.manifest(runs["a"])
    assert m["status"] == "complete" and not m["collector_errors"] and m["steps_completed"] == 4


def test_rerun_identical(runs):
    code, doc = h.compare(runs["a"], runs["b"])
    assert (code, doc["verdict"]) == (0, "identical"), doc.get("inconclusive") or doc.get("first_divergence")


def test_fault_localized(runs):
    code, doc = h.compare(runs["a"], runs["fault"])
    assert code == 1
    h.assert_localized(doc, step=2, rank=0, boundary="blocks.1.mlp", blame="source", fault_class="forward")
