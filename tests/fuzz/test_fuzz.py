"""The fuzz tier (`pytest -m fuzz`): every family of harness.py, a bounded number of cases, fixed seed.

Asserts, per family, that no case ended in a traceback, a hang, an HTTP 500, an unsafe effect
(pwned.csv, a leaked file or server path, a bad upload committed), a false "identical" or silently
lost events; and, separately, that every case got the answer its input calls for (harness.py's
docstring defines each outcome). The base runs are recorded once for the module (set
BITGUARD_FUZZ_BASES to a folder with complete/ and killed/ to reuse earlier ones). The whole
tier takes one to two minutes on 2 shared cores; a hang costs its timeout (10 s) per case.
"""

from __future__ import annotations

import os

import pytest

from .harness import FAMILIES, Context, run_family

pytestmark = pytest.mark.fuzz

SEED = 20261201
CASES = {"mutated": 3, "sigkill": 1, "api": 2, "names": 1}  # random cases (per file, kills, uploads), names
# recorded into (the SQL injection first); fixed lists run whole
NEVER = ("traceback", "hang", "http_500", "unsafe", "false_verdict", "data_lost")


@pytest.fixture(scope="module")
def ctx():
    context = Context(timeout=10.0)
    try:
        context.record_bases(os.environ.get("BITGUARD_FUZZ_BASES") or None)
        yield context
    finally:
        context.close()


@pytest.fixture(scope="module")
def outcomes(ctx):
    return {}


def _results(ctx, outcomes, family):
    if family not in outcomes:
        outcomes[family] = run_family(family, ctx, CASES.get(family, 0), SEED)
    return outcomes[family]


def _listing(results) -> str:
    return "\n".join(f"  {r.case}: {r.outcome}: {r.detail}" for r in results)


@pytest.mark.parametrize("family", FAMILIES)
def test_no_crash_hang_500_false_identical_or_lost_events(ctx, outcomes, family):
    results = _results(ctx, outcomes, family)
    assert results, f"the {family} family ran no case"
    bad = [r for r in results if r.outcome in NEVER]
    assert not bad, (f"{len(bad)} of {len(results)} {family} cases failed (rerun one with "
                     f"python -m tests.fuzz.harness --family {family} --seed {SEED} --cases {CASES.get(family, 0)} "
                     f"--only CASE):\n"
                     + _listing(bad))
    assert not ctx.pwned()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_case_gets_the_answer_its_input_calls_for(ctx, outcomes, family):
    results = _results(ctx, outcomes, family)
    wrong = [r for r in results if r.outcome == "wrong_answer"]
    assert not wrong, f"{len(wrong)} of {len(results)} {family} cases answered wrongly:\n" + _listing(wrong)
