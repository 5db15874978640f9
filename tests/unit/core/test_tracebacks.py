"""A recorded script's own error is printed without the frames of bitguard's module-call wrapper
(bitguard/tracebacks.py): a user read `collectors/hooks.py` in the traceback of a shape error in
their model and took bitguard for the cause. An error raised in bitguard's own code keeps them."""

from __future__ import annotations

import io
import traceback

import pytest
import torch
import torch.nn as nn

import bitguard
from bitguard.errors import BitguardError
from bitguard.tracebacks import print_failure


class Bad(nn.Module):
    def forward(self, x):
        return x @ torch.ones(3, 3)


def _printed(exc: BaseException) -> str:
    out = io.StringIO()
    print_failure(exc, exc.__traceback__, file=out)
    return out.getvalue()


def _raised_in_a_recorded_model(tmp_path) -> BaseException:
    model = nn.Sequential(nn.Linear(4, 4), Bad())
    with pytest.raises(RuntimeError) as info, bitguard.record(tmp_path / "run", determinism=False):
        model(torch.randn(2, 4))
    return info.value


def test_the_wrapper_frames_are_left_out_and_counted(tmp_path, monkeypatch):
    """As the CLI prints a recorded script's error (the frames kept while it was raised)."""
    monkeypatch.setenv("BITGUARD_TRACEBACK", "full")
    exc = _raised_in_a_recorded_model(tmp_path)
    text = _printed(exc)
    assert text.count("collectors/hooks.py") == 2 and "left out" not in text, text
    monkeypatch.delenv("BITGUARD_TRACEBACK")
    text = _printed(exc)
    assert "collectors/hooks.py" not in text and "in forward" in text and "x @ torch.ones(3, 3)" in text, text
    assert text.splitlines()[-2].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied"), text
    assert text.splitlines()[-1].startswith("(2 frames of bitguard's recorder left out"), text


def test_an_error_leaving_a_with_block_loses_the_wrapper_frames_with_a_note(tmp_path, monkeypatch):
    """Python prints an error leaving `with bitguard.record()` itself: it showed the wrapper's frames."""
    monkeypatch.delenv("BITGUARD_TRACEBACK", raising=False)
    exc = _raised_in_a_recorded_model(tmp_path)
    text = "".join(traceback.format_exception(exc))
    assert "collectors/hooks.py" not in text and "x @ torch.ones(3, 3)" in text, text
    assert text.splitlines()[-1].startswith("(2 frames of bitguard's recorder left out of this traceback"), text
    assert _printed(exc) == text  # (nothing left for the CLI's printer to take out)


def test_an_error_torch_raises_in_a_read_is_the_readers_lines(tmp_path, monkeypatch):
    """`int(t)` of a tensor of three numbers raises in torch; the read's wrapper (collectors/reads.py)
    was its last frame, so the error was taken for bitguard's and printed with it."""
    monkeypatch.delenv("BITGUARD_TRACEBACK", raising=False)
    with pytest.raises(ValueError) as info, bitguard.record(tmp_path / "run", determinism=False):
        int(torch.ones(3))
    text = _printed(info.value)
    assert "collectors/reads.py" not in text and "bitguard: the read" not in text, text
    assert text.splitlines()[-3].strip() == "int(torch.ones(3))", text
    assert text.splitlines()[-1].startswith("(2 frames of bitguard's recorder left out"), text


def test_an_error_raised_in_bitguards_code_keeps_every_frame(tmp_path):
    with pytest.raises(BitguardError) as info:
        bitguard.compare(tmp_path / "nowhere", tmp_path / "nowhere")
    text = _printed(info.value)
    assert "backend/" in text and "left out" not in text, text


def test_a_dependency_that_fails_to_import_is_said_to_be_the_environment_not_an_internal_error(tmp_path):
    """Helper 74: an empty `scipy` package on PYTHONPATH made numba's import fail (it reads scipy's
    version): every command said "internal error ... please report it", exit 70. It says which package
    failed and that something on PYTHONPATH may stand in for an installed one, exit 2."""
    import os
    import subprocess
    import sys

    (tmp_path / "scipy").mkdir()
    (tmp_path / "scipy" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "bitguard", "compare", str(tmp_path / "a"), str(tmp_path / "b")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "a package bitguard uses failed to import" in lines[0], out.stderr
    assert "scipy" in lines[0] and str(tmp_path) in lines[0], lines[0]
