"""Numba's kernels compiled once, into their on-disk caches, before the suite's processes fan out.

A clean clone has no cache for the digest kernels (cuda/cpu_kernel.py) nor for the alignment's and
the comparison's (backend/): each process that needs one compiles it until one of them has written
it, 12 s of CPU each here, and the suite starts three workers, two warm recorders and the stacks
tier's recordings at once. `tests/conftest.py` runs this once, in a process of its own, when the
caches are missing: a tiny recording, compared with itself and with one that differs.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# an index file each of the two folders gets on a first recording and comparison (their names: `module.function-line`)
MARKS = ((ROOT / "cuda" / "__pycache__", "cpu_kernel.digest_words-"), (ROOT / "backend" / "__pycache__", "alignment."))


def cold() -> bool:
    """Is a kernel cache missing (a clean clone)?"""
    return not all(folder.is_dir() and any(n.startswith(prefix) and n.endswith(".nbi") for n in os.listdir(folder))
                   for folder, prefix in MARKS)


def main() -> int:
    import torch

    import bitguard
    from bitguard.cuda.fingerprint import warmup

    warmup()
    with tempfile.TemporaryDirectory(prefix="bitguard-precompile-") as tmp:
        for name, lr in (("a", 0.1), ("b", 0.2)):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            with bitguard.record(os.path.join(tmp, name), determinism=False):
                for _ in range(2):
                    opt.zero_grad()
                    model(torch.randn(3, 4)).pow(2).mean().backward()
                    opt.step()
        for other in ("a", "b"):
            bitguard.compare(os.path.join(tmp, "a"), os.path.join(tmp, other)).to_dict()
    return 0


if __name__ == "__main__":
    sys.exit(main())
