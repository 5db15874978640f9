"""Eager training and bf16 autocast: the stacks tier's four claims (see harness.py). Both in the extended
tier: eager training through the launcher is what the default tiers record everywhere else (the scenarios
tier's eager tinygpt: reruns identical, faults localized; tests/record/test_numerics.py: recorded runs
bitwise plain ones; tests/record/test_record.py: the launcher), so this fixture's four fresh Pythons (26 s
of CPU) were a variant of them."""

import pytest

from . import harness as h

FAULT = {"STACK_FAULT": "module:step=2"}


@pytest.fixture(scope="module", params=[pytest.param((), marks=pytest.mark.extended),
                                        pytest.param(("--autocast",), marks=pytest.mark.extended)],
                ids=["eager", "autocast"])
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
    h.assert_identical(runs["a"], runs["b"])


def test_fault_localized(runs):
    h.assert_compare_localizes(runs["a"], runs["fault"], step=2, rank=0, boundary="blocks.1.mlp", blame="source",
                               fault_class="forward")
