"""Python's hash seed orders sets of strings: peft saved its target_modules, a set, in another order
in every run recorded through the Python API without PYTHONHASHSEED (helper 44). `bitguard record`
sets it for the script it runs; a recording that starts without it says so, and compare lists two
runs whose seeds differ before the bits."""

from __future__ import annotations

import bitguard
from bitguard.backend.compare import manifest_differences
from bitguard.recording import HASH_SEED_UNSET


def test_a_recording_without_a_hash_seed_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with bitguard.record(tmp_path / "a"):
        pass
    assert HASH_SEED_UNSET in capsys.readouterr().err
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    with bitguard.record(tmp_path / "b"):
        pass
    with bitguard.record(tmp_path / "c", determinism=False):  # (the user turned bitguard's controls off)
        pass
    assert "PYTHONHASHSEED" not in capsys.readouterr().err


def test_compare_lists_hash_seeds_that_differ_before_the_bits():
    (diff,) = manifest_differences({"env": {"PYTHONHASHSEED": "1"}}, {"env": {}})
    assert (diff["field"], diff["a"], diff["b"]) == ("env.PYTHONHASHSEED", "1", None) and "sets of strings" in diff["why"]
    assert manifest_differences({"env": {"PYTHONHASHSEED": "0"}}, {"env": {"PYTHONHASHSEED": "0"}}) == []
    assert manifest_differences({}, {"env": {"PYTHONHASHSEED": "0"}}) == []  # (recorded before the field)
