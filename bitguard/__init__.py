"""bitguard: where two PyTorch training runs first stop computing the same thing.

    with bitguard.record("runs/a"):       # or: bitguard record --out runs/a -- python train.py
        train()
    c = bitguard.compare("runs/a", "runs/b")
"""

from bitguard.errors import BitguardError
from bitguard.recording import record


def compare(a, b, rules=None, rank=None, **options):
    """Compare two run directories; returns a `Comparison` (see bitguard.backend.compare for the
    analysis options `fingerprint`, `probes` and `band`)."""
    from bitguard.backend.compare import compare as _compare

    return _compare(a, b, rules=rules, rank=rank, **options)


__all__ = ["BitguardError", "compare", "record"]
