"""benchmarks/bench_digest.py still runs and reports what docs/PERFORMANCE.md quotes."""

import json
import subprocess
import sys
from pathlib import Path

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
