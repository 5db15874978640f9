"""torch.compile (inductor): the stacks tier's four claims (see harness.py), plus eager vs compiled.

A compiled model is observed at its compiled regions' boundaries (collectors/compiled.py,
backend/granularity.py): the recorded run compiles the graphs a plain run compiles (dynamo's
counters are the same, no graph break, no warning from bitguard's code), a rerun compares
identical, a bit flip inside the region is localized to its step and the region, and an eager run
against a compiled one is never identical: what only the eager run observed inside the region is
`unobserved`. Each compile costs tens of seconds here: the runs are recorded once per module.
"""

import json

import pytest

from . import harness as h

FAULT = {"STACK_FAULT": "module:step=2"}
REGION = "TinyLM"  # the compiled model's root, named as the eager model's


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compiled")
    # the plain run under the determinism controls `record` applies by default: with deterministic algorithms
    # inductor compiles another embedding backward than without (other float sums: emb.weight's bits differ
    # after one step), so a plain run without them is not the reference of a default recording (docs/STACKS.md)
    # one run compiles first (beside the eager one, which compiles nothing): the others then find its graphs in
    # inductor's FX graph and AOT autograd caches (the session's, tests/conftest.py) instead of each compiling
    # them from scratch at once (a cache hit needs the same graph, configuration and inputs: what they compare)
    got = h.together({"a": lambda: h.recorded("compiled.py", tmp / "a", "--counters", str(tmp / "a.counters")),
                      "eager": lambda: h.recorded("compiled.py", tmp / "eager", "--compile", "none")})
    got |= h.together({"plain": lambda: h.plain("compiled.py", tmp, "--deterministic", "--counters",
                                                str(tmp / "plain.counters")),
                       "b": lambda: h.recorded("compiled.py", tmp / "b"),
                       "fault": lambda: h.recorded("compiled.py", tmp / "fault", env=FAULT)})
    plain, (a, ra), (b, _), (fault, _), (eager, _) = (got[k] for k in ("plain", "a", "b", "fault", "eager"))
    counters = {k: json.loads((tmp / f"{k}.counters").read_text()) for k in ("plain", "a")}
    return {"plain": plain, "a": a, "ra": ra, "b": b, "fault": fault, "eager": eager, "counters": counters}


def test_records_unedited_and_numbers_unchanged(runs):
    h.assert_unchanged(runs["plain"], runs["ra"])
    m = h.manifest(runs["a"])
    assert m["status"] == "complete" and not m["collector_errors"] and m["steps_completed"] == 4


def test_compiles_the_graphs_a_plain_run_compiles(runs):
    plain, recorded = runs["counters"]["plain"], runs["counters"]["a"]
    # inductor's on-disk caches (FX graph, AOT autograd) are shared by the runs: which of two runs
    # started together misses and which hits is timing, not recording (an empty group is never created)
    uncached = lambda group: {k: v for k, v in group.items() if "cache" not in k}  # noqa: E731
    for group in ("stats", "frames", "graph_break", "recompiles", "aot_autograd"):
        got, want = uncached(recorded.get(group) or {}), uncached(plain.get(group) or {})
        assert got == want, (group, recorded.get(group), plain.get(group))
    assert not recorded.get("graph_break") and recorded["stats"]["unique_graphs"] == 1


def test_no_dynamo_warning_from_bitguard(runs):
    stderr = h.stderr_of(runs["a"]).read_text()
    lines = [line for line in stderr.splitlines() if "_dynamo" in line or "collectors/" in line or "Cannot call" in line]
    assert not lines, "\n".join(lines[:10])


def test_rerun_identical(runs):
    code, doc = h.compare(runs["a"], runs["b"])
    assert (code, doc["verdict"]) == (0, "identical"), doc.get("inconclusive") or doc.get("first_divergence")
    reasons = [r for r in doc["certification"]["reasons"] if r["code"] == "granularity"]
    assert reasons and REGION in reasons[0]["message"], doc["certification"]["reasons"]


def test_fault_localized_to_the_region(runs):
    code, doc = h.compare(runs["a"], runs["fault"])
    assert code == 1
    fd = h.assert_localized(doc, step=2, rank=0, boundary=REGION, blame="source", fault_class="forward")
    assert any("compiled region" in n for n in fd["notes"]), fd["notes"]


@pytest.mark.parametrize("order", ["eager-first", "compiled-first"])
def test_eager_vs_compiled_names_the_region_and_is_never_identical(runs, order):
    a, b = (runs["eager"], runs["a"]) if order == "eager-first" else (runs["a"], runs["eager"])
    code, doc = h.compare(a, b)
    assert doc["verdict"] != "identical" and code in (1, 3), doc.get("error") or doc["verdict"]
    reasons = {r["code"]: r for r in doc["certification"]["reasons"]}
    assert "unobserved" in reasons and "compiled regions" in reasons["unobserved"]["message"], reasons
    assert doc["alignment"]["matched"] > doc["alignment"]["events_a"] // 3, doc["alignment"]
    fd = doc["first_divergence"]
    if fd is not None:  # where eager and inductor part: the region, or a boundary both runs observe
        assert fd["cause"] == "digest", fd
        observed_by_both = fd["boundary"] == REGION or fd["kind"] in ("grad", "step", "final", "batch")
        assert observed_by_both, fd
