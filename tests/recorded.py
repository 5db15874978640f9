"""Real recorded run pairs: tiny GPT trained under `bitguard record`, reference and suspect.

Each scenario records its two runs concurrently, forked from a warm recorder (tests/warm.py: the
CLI's in-process recording, without the 4-s start of a fresh Python), into
`root/<scenario>/reference` and `root/<scenario>/suspect`, and returns the two paths. `shared`
records a scenario once for the whole pytest session, its xdist workers included (the pair is
only read: the readers open rank files read-only, an upload copies them); session fixtures
(tests/unit/backend/conftest.py) and tests of other folders that need the same pair call it. The
synthetic pairs in fixtures_runs.py are the fast alternative when a test needs no real model.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import warm

ROOT = Path(__file__).resolve().parents[1]
TINYGPT = ROOT / "sample_traces" / "tinygpt.py"
STEPS = ("--steps", "3")  # three steps: a clean step 0, the fault at step 1, its spread at step 2


def record_pair(root, name: str, suspect_args: list[str], reference_args: list[str] = ()) -> tuple[Path, Path]:
    """Record `root/name/reference` and `root/name/suspect` at once; return their paths."""
    base = Path(root) / name
    runs = {"reference": [*STEPS, *reference_args], "suspect": [*STEPS, *suspect_args]}
    warm.record_all(*(dict(out=base / side, script=TINYGPT, args=args) for side, args in runs.items()))
    return base / "reference", base / "suspect"


def forward_bitflip(root) -> tuple[Path, Path]:
    """One bit of blocks.0.mlp.fc's output flips at step 1: the pivot is that forward (blame: source)."""
    return record_pair(root, "forward_bitflip", ["--fault", "forward-bitflip", "--fault-step", "1"])


def identical(root) -> tuple[Path, Path]:
    """The same training twice: no pivot."""
    return record_pair(root, "identical", [])


def shared(tmp_path_factory, scenario) -> tuple[Path, Path]:
    """`scenario(root)` (forward_bitflip, identical) recorded once per pytest session: the first
    worker to ask records it under a lock, in a folder its sibling workers share (the parent of each
    worker's basetemp, which is the session's), the others wait for it and read the same pair."""
    basetemp = tmp_path_factory.getbasetemp()
    root = (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "bitguard-shared-pairs"
    root.mkdir(exist_ok=True)
    name = scenario.__name__
    done = root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(root / name, ignore_errors=True)  # a recording that failed on another worker
            scenario(root)
            done.touch()
    return root / name / "reference", root / name / "suspect"
