"""What a manifest keeps for a replay (bitguard/manifest.py): the environment variables that can
change a training (never secrets or a launcher's per-process ones) and the hashes of the user's
own source files the training imported."""

from __future__ import annotations

import importlib
import sys

from bitguard import manifest


def test_recorded_env_keeps_what_changes_a_training_and_never_secrets():
    env = {"CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "4", "PYTHONHASHSEED": "1", "HF_TOKEN": "hf_xyz",
           "NCCL_SOCKET_IFNAME": "eth0", "AWS_SECRET_ACCESS_KEY": "k", "RANK": "1", "MASTER_PORT": "29500",
           "HOME": "/root", "MY_SWITCH": "on", "TORCH_API_KEY": "k", "BITGUARD_DRILL": "/x.json"}
    assert manifest.recorded_env(env) == {"CUDA_VISIBLE_DEVICES": "0", "NCCL_SOCKET_IFNAME": "eth0",
                                          "OMP_NUM_THREADS": "4", "PYTHONHASHSEED": "1"}
    more = manifest.recorded_env({**env, "BITGUARD_RECORD_ENV": "MY_SWITCH, HOME"})
    assert more["MY_SWITCH"] == "on" and more["HOME"] == "/root" and "HF_TOKEN" not in more


def test_sources_are_the_users_own_imported_files(tmp_path, monkeypatch):
    (tmp_path / "mymodel.py").write_text("WIDTH = 4\n")
    (tmp_path / "train.py").write_text("import mymodel\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("mymodel")
    try:
        got = manifest.sources(str(tmp_path), ["python", "train.py"])
    finally:
        sys.modules.pop("mymodel", None)
    assert got == {str((tmp_path / "mymodel.py").resolve()): manifest.file_sha256(tmp_path / "mymodel.py")}
    elsewhere = manifest.sources(str(tmp_path / "nowhere"), ["python", "train.py"])
    assert not any("site-packages" in f or "/bitguard/" in f for f in elsewhere)
