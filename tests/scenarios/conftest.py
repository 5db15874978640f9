"""Recordings of the localisation scenarios, made once per test session.

Every run is recorded on the scenario pool (sample_traces/recordings.py: two processes, each
job forked from a server with torch and the recorder already imported) into the folder the
session's xdist workers share (recorded.shared_root: tests/drill reads four of these pairs, and
records those it finds missing, once, under the same locks), then every comparison the tests
need runs on two processes too. Tests read the summaries; none records or compares on its own.

A rerun of the suspect is recorded for RERUN_SUSPECTS only (the nondeterministic scenario, whose
two suspect runs must differ, a bit flip, and a Hugging Face model); the other fourteen suspects'
reruns are the `extended` tier's
(BITGUARD_EXTENDED=1 records all seventeen), which keeps `make test` in its budget. Every
reference is rerun in both tiers (five distinct recordings).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import recorded

from bitguard.sample_traces import evaluation
from bitguard.sample_traces.scenarios import SCENARIOS

WORKERS = 2
RERUN_SUSPECTS = ("nondeterministic", "forward-bitflip", "hf-gpt2-bitflip")


def suspect_rerun_recorded(name: str) -> bool:
    return name in RERUN_SUSPECTS or os.environ.get("BITGUARD_EXTENDED", "") not in ("", "0")


def record(jobs) -> None:
    recorded.record_jobs(jobs, workers=WORKERS)


def rules_of(scenario) -> str | None:
    return str(scenario.rules_path) if scenario.rules else None


@pytest.fixture(scope="session")
def localisation(tmp_path_factory) -> dict[str, dict]:
    """{scenario: {main, again, suspects, references, without_rules}}: compare summaries of the
    pair, of reference vs the suspect's rerun, of the two suspect runs, of the two reference runs,
    and (benign scenarios) of the pair without its rules."""
    runs = recorded.scenario_runs(tmp_path_factory)
    pairs = evaluation.pairs(list(SCENARIOS.values()), "plain", runs, reruns=True)
    pairs = [p if suspect_rerun_recorded(p.scenario.name) else replace(p, suspect_rerun=None) for p in pairs]
    record(j for p in pairs for j in (p.reference, p.suspect, p.suspect_rerun, p.reference_rerun) if j)
    requests, keys = [], []
    for p in pairs:
        rules = rules_of(p.scenario)
        compared = [("main", p.reference, p.suspect), ("references", p.reference, p.reference_rerun)]
        if p.suspect_rerun is not None:
            compared += [("again", p.reference, p.suspect_rerun), ("suspects", p.suspect, p.suspect_rerun)]
        for key, a, b in compared:
            requests.append({"a": a.out, "b": b.out, "rules": rules})
            keys.append((p.scenario.name, key))
        if p.scenario.rules:
            requests.append({"a": p.reference.out, "b": p.suspect.out})
            keys.append((p.scenario.name, "without_rules"))
    out: dict[str, dict] = {name: {} for name in SCENARIOS}
    for (name, key), summary in zip(keys, evaluation.compare_many(requests, WORKERS)):
        out[name][key] = summary
    out["_pairs"] = {p.scenario.name: p for p in pairs}
    return out
