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


PROBE_GIVE_BACK = """
import os, sys, tempfile, torch, bitguard
torch.set_float32_matmul_precision("high")
os.environ.pop("NCCL_ALGO", None)
os.environ["NCCL_PROTO"] = "LL"
net, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
out = tempfile.mkdtemp()
with bitguard.record(os.path.join(out, "a")):
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.get_float32_matmul_precision() == "highest" and os.environ["NCCL_ALGO"] == "Ring"
    net(x).sum().backward()
assert not torch.are_deterministic_algorithms_enabled(), "deterministic algorithms stayed on after the recording"
assert torch.get_float32_matmul_precision() == "high"
assert "NCCL_ALGO" not in os.environ and os.environ["NCCL_PROTO"] == "LL"
assert os.environ.get("TORCHINDUCTOR_DETERMINISTIC") is None
with bitguard.record(os.path.join(out, "b")):
    torch.set_float32_matmul_precision("medium")  # the script's own choice during the recording: it stays
    net(x).sum().backward()
assert torch.get_float32_matmul_precision() == "medium"
assert not torch.are_deterministic_algorithms_enabled()
with bitguard.record(os.path.join(out, "c")):  # (helper 59: mmengine's randomness=dict(deterministic=True))
    torch.use_deterministic_algorithms(True)  # the value the controls gave: the script's all the same
    torch.backends.cudnn.deterministic = True
    net(x).sum().backward()
assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
torch.use_deterministic_algorithms(False)
torch.backends.cudnn.deterministic = False
with bitguard.record(os.path.join(out, "d")):
    net(x).sum().backward()
assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
print("ok")
"""


def test_a_recording_gives_back_the_settings_it_changed_but_not_the_scripts_own():
    """After `with bitguard.record(...)` the user's settings are back (a notebook trains on after a
    recorded stretch: deterministic algorithms left on would fail an op that has none); a setting
    the script itself changed inside the recording stays as the script left it."""
    got = subprocess.run([sys.executable, "-c", PROBE_GIVE_BACK], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip().endswith("ok"), got.stderr[-2000:]


PROBE_NO_RESEED = """
import os, random, sys, tempfile, numpy as np, torch, bitguard
def draws():
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())
def seeded():
    torch.manual_seed(7); random.seed(7); np.random.seed(7)
seeded()
plain = draws()
out = tempfile.mkdtemp()
seeded()
with bitguard.record(os.path.join(out, "a")):
    recorded = draws()
assert recorded == plain, (recorded, plain)
seeded()
with bitguard.record(os.path.join(out, "b"), seed=0):  # asked for: reseeded as the block begins
    reseeded = draws()
torch.manual_seed(0); random.seed(0); np.random.seed(0)
assert reseeded == draws()
print("ok")
"""


def test_a_recording_block_draws_what_the_script_seeded():
    """Helper 23: `with bitguard.record()` reseeded Python's, NumPy's and torch's generators as it
    began, overriding the script's own seeding (fastai's `set_seed` before the block): the recorded
    training differed from the plain one. It reseeds only when given `seed=`."""
    got = subprocess.run([sys.executable, "-c", PROBE_NO_RESEED], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip().endswith("ok"), got.stderr[-2000:]


def test_a_training_refused_an_operator_without_a_deterministic_implementation_is_told_why(tmp_path, capsys):
    """Helper 36: a quantized model's eval failed under `bitguard record` on torch's refusal
    (`quantized_resize_cpu_ does not have a deterministic implementation`) with no word that the
    setting was bitguard's."""
    import pytest
    import torch

    import bitguard

    message = "quantized_resize_cpu_ does not have a deterministic implementation, but you set ..."
    for name, kw in (("on", {}), ("warn", {"warn_only": True}), ("off", {"determinism": False})):
        with pytest.raises(RuntimeError):
            with bitguard.record(tmp_path / name, **kw):
                torch.nn.Linear(2, 2)(torch.ones(1, 2))
                raise RuntimeError(message)
        told = "--warn-only" in capsys.readouterr().err
        assert told == (name == "on"), name


PROBE_FILL = """
import os, sys, tempfile, duckdb, json, torch, bitguard
import torch.utils.deterministic as td
out = tempfile.mkdtemp()
td.fill_uninitialized_memory = False  # (the user's, before the recording)
with bitguard.record(os.path.join(out, "a")):
    assert td.fill_uninitialized_memory, "the fill is on while recording"
    td.fill_uninitialized_memory = False  # the script turns it off (ultralytics' init_seeds)
    assert td.fill_uninitialized_memory and torch.empty(64).isnan().all(), "kept on"
    torch.nn.Linear(2, 2)(torch.ones(1, 2))
assert not td.fill_uninitialized_memory, "the script's wish applied once the recording ends"
con = duckdb.connect(os.path.join(out, "a", "rank-0.duckdb"), read_only=True)
kept = json.loads(dict(con.sql("SELECT key, value FROM meta").fetchall())["fill_kept_on"])
assert kept == ["<string>:8"], kept
con.close()
td.fill_uninitialized_memory = True
with bitguard.record(os.path.join(out, "b")):
    torch.nn.Linear(2, 2)(torch.ones(1, 2))
assert td.fill_uninitialized_memory
td.fill_uninitialized_memory = False
with bitguard.record(os.path.join(out, "c")):  # not turned off inside: the setting before comes back
    torch.nn.Linear(2, 2)(torch.ones(1, 2))
assert not td.fill_uninitialized_memory
with bitguard.record(os.path.join(out, "d"), determinism=False):
    td.fill_uninitialized_memory = False
    assert not td.fill_uninitialized_memory, "--no-determinism leaves it as the script sets it"
print("ok")
"""


def test_the_fill_of_uninitialised_memory_is_kept_on_while_recording():
    """Helper 61 (ultralytics' init_seeds turns it off; a FLOPs profile of the model on `torch.empty` at every
    YOLO training's start read the bytes left in memory, and two identical runs differed there): kept on while
    the controls are applied, said (stderr, the rank file's meta), the script's wish applied at the end."""
    got = subprocess.run([sys.executable, "-c", PROBE_FILL], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip().endswith("ok"), got.stderr[-2000:]
    assert "kept torch's fill of uninitialised memory on while recording (the script turned it off at <string>:8)" \
        in got.stderr, got.stderr[-2000:]
