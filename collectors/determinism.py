"""Determinism controls applied before the user's script runs.

Each control is applied only when asked and reported in a flat dict that goes to the manifest,
so a reader can tell two runs apart by their settings before blaming an operator. This module
does not hide nondeterminism that remains (a racy third-party kernel stays racy: that is what
bitguard should expose).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch


@dataclass
class DeterminismConfig:
    enabled: bool = True  # False: record the settings as found, change nothing
    seed: int = 0  # seed for Python, NumPy and torch CPU/CUDA RNGs
    warn_only: bool = False  # torch.use_deterministic_algorithms(..., warn_only=)
    threads: int | None = None  # intra-op threads; None keeps the value the script would get


def _seed_worker(worker_id: int) -> None:  # DataLoader worker_init_fn
    import numpy as np

    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def _patch_dataloader() -> None:
    from torch.utils.data import DataLoader

    if getattr(DataLoader.__init__, "_bitguard", False):
        return
    original = DataLoader.__init__

    def __init__(self, *args, **kwargs):
        user_fn = kwargs.get("worker_init_fn")

        def worker_init(worker_id: int) -> None:
            _seed_worker(worker_id)
            if user_fn is not None:
                user_fn(worker_id)

        kwargs["worker_init_fn"] = worker_init
        original(self, *args, **kwargs)

    __init__._bitguard = True
    __init__._original = original
    DataLoader.__init__ = __init__


def unpatch_dataloader() -> None:
    from torch.utils.data import DataLoader

    original = getattr(DataLoader.__init__, "_original", None)
    if original is not None:
        DataLoader.__init__ = original


def _use_deterministic_algorithms(warn_only: bool) -> None:
    """`torch.use_deterministic_algorithms(True, warn_only=...)` without its import of torch's
    inductor config (1.6 s here, paid at the start of every recording and every drill replay):
    the one thing it sets there, inductor's `deterministic`, is set directly when inductor is
    already loaded, else through `TORCHINDUCTOR_DETERMINISTIC=1`, which that config reads when it
    is first imported (by a `torch.compile`)."""
    import sys

    native = getattr(torch._C, "_set_deterministic_algorithms", None)
    if native is None:  # another torch: the public call, import and all
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        return
    native(True, warn_only=warn_only)
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = True
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"


# The environment variables apply() may set, for give_back().
_ENV = ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO", "TORCHINDUCTOR_DETERMINISTIC")


def snapshot() -> dict:
    """What apply() may change, as it is now: taken before apply() and after it, for give_back()."""
    import sys

    inductor = sys.modules.get("torch._inductor.config")
    return {"deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "inductor": getattr(inductor, "deterministic", None) if inductor is not None else None,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "torch_threads": torch.get_num_threads(),
            **{f"env {k}": os.environ.get(k) for k in _ENV}}


def give_back(before: dict, applied: dict) -> list[str]:
    """At a recording's end, put back the settings the user had (`before`, a snapshot taken before
    apply()), each one only if it still holds the value apply() gave it (`applied`, the snapshot
    after): a setting the script changed during the recording is the script's and stays. Without
    this a notebook that recorded a few steps would train on with deterministic algorithms (an error
    for an op that has none), TF32 off and the environment changed. The RNGs, once seeded, are the
    training's and are not touched. Returns the names of the settings given back."""
    now = snapshot()
    changed = [k for k in before if k != "inductor" and before[k] != applied[k] and now[k] == applied[k]]
    restore(before, changed, applied)
    return changed


def restore(saved: dict, keys: list[str] | None = None, applied: dict | None = None) -> None:
    """Set the settings named `keys` (all of them by default) to their values in `saved`, a
    snapshot(). Inductor's deterministic flag follows the deterministic algorithms, as torch's public
    call sets it, when it still holds what `applied` (or the moment before) gave it."""
    import sys

    for key in (keys if keys is not None else [k for k in saved if k != "inductor"]):
        value = saved[key]
        if key == "deterministic":
            gave = (applied or snapshot())["deterministic"][0]
            native = getattr(torch._C, "_set_deterministic_algorithms", None)
            if native is None:
                torch.use_deterministic_algorithms(value[0], warn_only=value[1])
            else:
                native(value[0], warn_only=value[1])
            inductor = sys.modules.get("torch._inductor.config")  # loaded before or since
            if inductor is not None and inductor.deterministic == gave:
                inductor.deterministic = saved["inductor"] if saved["inductor"] is not None else value[0]
        elif key == "cudnn_deterministic":
            torch.backends.cudnn.deterministic = value
        elif key == "cudnn_benchmark":
            torch.backends.cudnn.benchmark = value
        elif key == "tf32_matmul":
            torch.backends.cuda.matmul.allow_tf32 = value
        elif key == "tf32_cudnn":
            torch.backends.cudnn.allow_tf32 = value
        elif key == "float32_matmul_precision":
            torch.set_float32_matmul_precision(value)
        elif key == "torch_threads":
            if torch.get_num_threads() != value:
                torch.set_num_threads(value)
        elif value is None:
            os.environ.pop(key.removeprefix("env "), None)
        else:
            os.environ[key.removeprefix("env ")] = value


def current_settings() -> dict:
    """The settings in force now, whether or not bitguard set them."""
    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "NCCL_ALGO": os.environ.get("NCCL_ALGO"),
        "NCCL_PROTO": os.environ.get("NCCL_PROTO"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "TORCHINDUCTOR_DETERMINISTIC": os.environ.get("TORCHINDUCTOR_DETERMINISTIC"),
    }


def apply(config: DeterminismConfig) -> dict:
    """Apply the controls; return what is now in force, for the manifest."""
    if not config.enabled:
        return {"enabled": False, **current_settings()}
    import numpy as np

    random.seed(config.seed)
    np.random.seed(config.seed % 2**32)
    torch.manual_seed(config.seed)  # seeds CUDA generators too
    _use_deterministic_algorithms(config.warn_only)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    os.environ.setdefault("NCCL_PROTO", "Simple")
    # On CPU the thread count alone changes reduction order: pin it (to the default unless told)
    # so both runs state, and use, the same value.
    torch.set_num_threads(config.threads or torch.get_num_threads())
    _patch_dataloader()
    return {
        "enabled": True,
        "seed": config.seed,
        "seeded": ["python", "numpy", "torch_cpu", "torch_cuda"],
        "dataloader_worker_seeding": True,
        **current_settings(),
    }
