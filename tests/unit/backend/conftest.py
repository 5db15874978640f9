"""Run pairs for the backend's tests: real recorded tiny GPT pairs and synthetic scenario pairs.

Both builders live in tests/ (recorded.py, fixtures_runs.py); this folder has no __init__.py,
so pytest puts only this folder on sys.path and tests/ is added here to import them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fixtures_runs  # noqa: E402
import recorded  # noqa: E402

import bitguard  # noqa: E402


@pytest.fixture(scope="session")
def forward_bitflip(tmp_path_factory):
    """Comparison of a real pair: one bit of blocks.0.mlp.fc's output flips at step 1."""
    a, b = recorded.shared(tmp_path_factory, recorded.forward_bitflip)  # recorded once for all workers
    return bitguard.compare(a, b)


@pytest.fixture(scope="session")
def gap_then_divergence(tmp_path_factory):
    """Comparison of a synthetic two-rank pair: a gap at step 0, block 1 diverges on rank 1 at step 1.
    The gap (the suspect skips the probe) is allowed by a rule: unallowed, it would be the pivot."""
    rules = {"rules": [{"id": "no-probe", "action": "allow-gap", "match": {"boundary": "model.probe"}}]}
    return bitguard.compare(*fixtures_runs.gap_then_divergence(str(tmp_path_factory.mktemp("synthetic"))), rules=rules)


@pytest.fixture(scope="session")
def identical_runs(tmp_path_factory):
    """Comparison of a synthetic pair that computes the same thing."""
    return bitguard.compare(*fixtures_runs.identical(str(tmp_path_factory.mktemp("synthetic"))))
