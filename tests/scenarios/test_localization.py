"""The localisation regression suite: every scenario's first divergence, exactly, and reruns.

Each scenario (sample_traces/scenarios.py) is a reference/suspect pair of real training runs
with one injected fault whose place is known. bitguard must report that place: step, phase,
boundary, event kind, blame, fault class and (where it gives one) the blame window. A rerun of
the suspect must give the same verdict; two recordings of one deterministic script must compare
identical, and two of the nondeterministic suspect must not.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest

from bitguard.sample_traces.evaluation import score
from bitguard.sample_traces.scenarios import SCENARIOS
from scenarios.conftest import RERUN_SUSPECTS

pytestmark = pytest.mark.slow

NAMES = list(SCENARIOS)
FAULTS = [n for n in NAMES if SCENARIOS[n].expected is not None]
BENIGN = [n for n in NAMES if SCENARIOS[n].expected is None]
# a suspect's rerun is recorded in the default tiers for conftest.RERUN_SUSPECTS only
RERUNS = [n if n in RERUN_SUSPECTS else pytest.param(n, marks=pytest.mark.extended) for n in NAMES]


def _expected(name: str) -> dict:
    e = asdict(SCENARIOS[name].expected)
    return {k: e[k] for k in ("step", "phase", "kind", "boundary", "blame", "fault_class", "window")}


@pytest.mark.parametrize("name", FAULTS)
def test_first_divergence_is_the_injected_fault(localisation, name):
    got = localisation[name]["main"]
    assert got["verdict"] == "diverged", f"{name}: the fault went unseen ({got})"
    assert got["pivot"] == _expected(name), (
        f"{name}: pivot {got['pivot']}\n  expected {_expected(name)}\n"
        f"  reproduce: {localisation['_pairs'][name].reference.shell()}\n"
        f"             {localisation['_pairs'][name].suspect.shell()}")
    assert got["unallowed_gaps"] == 0, f"{name}: the two runs' structures differ ({got['unallowed_gaps']} gaps)"
    assert score(SCENARIOS[name], got) == SCENARIOS[name].located


@pytest.mark.parametrize("name", BENIGN)
def test_benign_pair_is_accepted_by_its_rules(localisation, name):
    got = localisation[name]["main"]
    assert got["verdict"] == "identical", f"{name}: the rules did not accept the pair: {got['pivot']}"
    assert got["unallowed_gaps"] == 0, f"{name}: {got['unallowed_gaps']} gaps not allowed by the rules"
    assert score(SCENARIOS[name], got) == "accepted"


@pytest.mark.parametrize("name", BENIGN)
def test_benign_pair_is_flagged_without_its_rules(localisation, name):
    got = localisation[name]["without_rules"]
    assert score(SCENARIOS[name], got) == "false alarm", f"{name}: without rules the difference should show ({got})"


@pytest.mark.parametrize("name", RERUNS)
def test_rerun_of_the_suspect_gives_the_same_verdict(localisation, name):
    first, again = localisation[name]["main"], localisation[name]["again"]
    assert (again["verdict"], again["pivot"]) == (first["verdict"], first["pivot"])


@pytest.mark.parametrize("name", NAMES)
def test_reference_reruns_compare_identical(localisation, name):
    got = localisation[name]["references"]
    assert got["verdict"] == "identical" and got["unallowed_gaps"] == 0, f"{name}: reference is not reproducible: {got}"


@pytest.mark.parametrize("name", RERUNS)
def test_suspect_reruns_differ_only_when_nondeterministic(localisation, name):
    got = localisation[name]["suspects"]
    if not SCENARIOS[name].reruns_differ:
        assert got["verdict"] == "identical", f"{name}: two recordings of the suspect differ: {got['pivot']}"
        return
    # the racy kernel, not anything before it, is where two runs of the suspect part ways
    e = SCENARIOS[name].expected
    assert got["verdict"] == "diverged"
    assert (got["pivot"]["step"], got["pivot"]["phase"], got["pivot"]["boundary"], got["pivot"]["blame"]) == (
        e.step, e.phase, e.boundary, "source")


def test_pool_recording_equals_a_command_line_recording(localisation, tmp_path):
    """The suite records on a fork-server pool; a plain `bitguard record` of the same run is identical."""
    import os
    import subprocess
    import sys

    from bitguard.sample_traces.evaluation import compare_summary
    from bitguard.sample_traces.recordings import HERE

    pooled = localisation["_pairs"]["forward-bitflip"].reference
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "bitguard", "record", "--out", str(out), "--", sys.executable,
           str(HERE / pooled.script), *pooled.args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    got = compare_summary(pooled.out, str(out))
    assert got["verdict"] == "identical" and got["unallowed_gaps"] == 0, got
