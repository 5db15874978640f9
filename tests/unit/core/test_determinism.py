"""The determinism controls set what torch.use_deterministic_algorithms(True) sets, without its
seconds-long import of torch's inductor (collectors/determinism.py)."""

import subprocess
import sys

PROBE = """
import sys, torch
from bitguard.collectors.determinism import DeterminismConfig, apply
settings = apply(DeterminismConfig())
assert "torch._inductor.config" not in sys.modules, "apply imported inductor"
assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
assert settings["deterministic_algorithms"] and settings["TORCHINDUCTOR_DETERMINISTIC"] == "1"
import torch._inductor.config as inductor
assert inductor.deterministic, "a torch.compile after the controls would not be deterministic"
print("ok")
"""


def test_deterministic_algorithms_reach_a_later_inductor_without_importing_it():
    got = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr


def test_an_inductor_already_loaded_is_set_directly(monkeypatch):
    import torch
    import torch._inductor.config as inductor

    from bitguard.collectors.determinism import _use_deterministic_algorithms

    monkeypatch.setattr(inductor, "deterministic", False)
    monkeypatch.setenv("TORCHINDUCTOR_DETERMINISTIC", "0")
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        _use_deterministic_algorithms(warn_only=True)
        assert inductor.deterministic and torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
