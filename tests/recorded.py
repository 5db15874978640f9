"""Real recorded run pairs: tiny GPT trained under `bitguard record`, reference and suspect.

Each scenario records its two runs concurrently, forked from a warm recorder (tests/warm.py: the
CLI's in-process recording, without the 4-s start of a fresh Python), into
`root/<scenario>/reference` and `root/<scenario>/suspect`, and returns the two paths. Session-scoped fixtures call these once (see tests/unit/backend/conftest.py); the
synthetic pairs in fixtures_runs.py are the fast alternative when a test needs no real model.
"""

from __future__ import annotations

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
