"""The benchmarks still run and report what docs/PERFORMANCE.md quotes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_benchmark_reports_digest_and_baselines():
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_digest.py"), "--size-mib", "1", "--reps", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert {"digest (xor+pos)", "np.sum", "np.bitwise_xor.reduce"} <= set(report["cases"])
    assert report["ratio_to_np.sum"] > 0


@pytest.mark.slow  # bench_recording records tiny runs in its subprocess
@pytest.mark.extended  # a benchmark's report, not bitguard itself
def test_team_pairs_benchmark_reports_both_sides():
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_recording.py"), "--team-pairs", "2", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if "does not run on an OpenMP team" in run.stderr:
        pytest.skip("torch without an OpenMP backend: the benchmark says so and stops")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["pairs"] == 2 and report["median_team_s"] > 0 and report["median_alone_s"] > 0
