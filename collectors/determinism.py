"""Determinism controls applied before the user's script runs.

Each control is applied only when asked and reported in a flat dict that goes to the manifest,
so a reader can tell two runs apart by their settings before blaming an operator. This module
does not hide nondeterminism that remains (a racy third-party kernel stays racy: that is what
bitguard should expose).
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from functools import partial

import torch

from bitguard.collectors.patching import Patch


@dataclass
class DeterminismConfig:
    enabled: bool = True  # False: record the settings as found, change nothing
    seed: int | None = 0  # seed for Python, NumPy and torch CPU/CUDA RNGs (None: leave them as they are)
    warn_only: bool = False  # torch.use_deterministic_algorithms(..., warn_only=)
    threads: int | None = None  # intra-op threads; None keeps the value the script would get


def _use_deterministic_algorithms(warn_only: bool) -> None:
    """`torch.use_deterministic_algorithms(True, warn_only=...)` without its import of torch's
    inductor config (1.6 s here, paid at the start of every recording and every drill replay):
    the one thing it sets there, inductor's `deterministic`, is set directly when inductor is
    already loaded, else through `TORCHINDUCTOR_DETERMINISTIC=1`, which that config reads when it
    is first imported (by a `torch.compile`)."""
    _set_deterministic(True, warn_only)
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = True
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"


def _set_deterministic(on: bool, warn_only: bool) -> None:
    """Deterministic algorithms on or off, through torch's native setter (the public call imports
    inductor's config first: 1.6 s); the public call where a torch lacks it."""
    native = getattr(torch._C, "_set_deterministic_algorithms", None)
    if native is None:
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
    else:
        native(on, warn_only=warn_only)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _set_threads(n: int) -> None:
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


class _FillKept:
    """While a recording applies the controls, torch's fill of uninitialised memory stays on: a script that
    turns it off (ultralytics' `init_seeds(deterministic=True)` does, for speed) reads in `torch.empty`'s
    memory whatever bytes were there, and two identical runs differ where a call reads one (helper 61: a
    FLOPs profile of the model on an empty input, at every YOLO training's start, made every two runs
    differ). The places that asked for it off are kept (`refused`), said at the end, and the script's last
    wish is applied when the recording gives the settings back. `--no-determinism` leaves it alone."""

    _SETTER = "_set_deterministic_fill_uninitialized_memory"

    def __init__(self):
        self.patch: Patch | None = None  # torch's setter, while kept
        self.refused: list[str] = []
        self.wanted: bool | None = None  # the script's last wish, while kept
        self.before = True  # the setting before the recording

    def install(self) -> None:
        if self.patch is not None or not hasattr(torch._C, self._SETTER):
            return
        self.before = torch._C._get_deterministic_fill_uninitialized_memory()
        self.refused, self.wanted = [], None
        getattr(torch._C, self._SETTER)(True)
        self.patch = Patch(torch._C, self._SETTER, self._keeping)

    def _keeping(self, original, patch):
        def setter(mode) -> None:
            if not patch.active:
                return original(mode)
            self.wanted = bool(mode)
            if not mode:  # (the caller of the property's setter: the script's line)
                caller = sys._getframe(2) if sys._getframe(1).f_code.co_name == "fill_uninitialized_memory" \
                    else sys._getframe(1)
                place = f"{caller.f_code.co_filename}:{caller.f_lineno}"
                if place not in self.refused:
                    self.refused.append(place)
        return setter

    def remove(self) -> list[str]:
        """The setter given back, with the script's last wish applied (else the setting before); the places
        refused."""
        if self.patch is None:
            return []
        self.patch.remove()
        self.patch.original(self.before if self.wanted is None else self.wanted)
        self.patch = None
        return self.refused


FILL = _FillKept()


class _Touched:
    """The settings the script itself sets while a recording runs (mmengine's `randomness=dict(deterministic=
    True)` turns deterministic algorithms and cuDNN's determinism on inside the recording): `give_back` leaves
    them as the script set them, even where that is the value the controls had given (helper 59: they were
    off again after a `with bitguard.record()` block). Seen at torch's setters, the functions torch's public
    calls and cuDNN's flags call."""

    _C_SETTERS = {"_set_deterministic_algorithms": "deterministic_algorithms", "_set_cublas_allow_tf32": "tf32_matmul",
                  "_set_float32_matmul_precision": "float32_matmul_precision"}
    _CUDNN = {"deterministic": "cudnn_deterministic", "benchmark": "cudnn_benchmark", "allow_tf32": "tf32_cudnn"}

    def __init__(self):
        self.keys: set[str] = set()
        self.patches: list[Patch] = []

    def install(self) -> None:
        if self.patches:
            return
        self.keys = set()
        places = [(torch._C, name, key) for name, key in self._C_SETTERS.items() if hasattr(torch._C, name)]
        props = vars(type(torch.backends.cudnn))
        places += [(props[name], "setter", key) for name, key in self._CUDNN.items()
                   if hasattr(props.get(name), "setter")]
        self.patches = [Patch(owner, attribute, self._noting(key)) for owner, attribute, key in places]

    def _noting(self, key: str):
        def make(original, patch):
            def setter(*args, **kwargs):
                if patch.active:
                    self.keys.add(key)
                return original(*args, **kwargs)
            return setter
        return make

    def remove(self) -> set[str]:
        """The setters given back; the settings the script set."""
        for patch in self.patches:
            patch.remove()
        self.patches = []
        return self.keys


TOUCHED = _Touched()


# What apply() changes, by current_settings()' key (the interop threads and OMP_NUM_THREADS, which it
# only reports, are not here): how each is set back.
_SETTERS = {
    "deterministic_algorithms": None,  # with deterministic_warn_only, in restore()
    "cudnn_deterministic": lambda v: setattr(torch.backends.cudnn, "deterministic", v),
    "cudnn_benchmark": lambda v: setattr(torch.backends.cudnn, "benchmark", v),
    "tf32_matmul": lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v),
    "tf32_cudnn": lambda v: setattr(torch.backends.cudnn, "allow_tf32", v),
    "float32_matmul_precision": torch.set_float32_matmul_precision,
    "torch_threads": _set_threads,
    **{name: partial(_set_env, name) for name in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO",
                                                 "TORCHINDUCTOR_DETERMINISTIC")},
}


def snapshot() -> dict:
    """current_settings() and inductor's deterministic flag (None while inductor is not loaded): taken
    before apply() and after it, for give_back(), or for restore()."""
    inductor = sys.modules.get("torch._inductor.config")
    return {**current_settings(), "inductor": getattr(inductor, "deterministic", None) if inductor else None}


def give_back(before: dict, applied: dict, touched: set[str] = frozenset()) -> list[str]:
    """At a recording's end, put back the settings the user had (`before`, a snapshot taken before
    apply()), each one only if it still holds the value apply() gave it (`applied`, the snapshot
    after): a setting the script changed during the recording is the script's and stays. Without
    this a notebook that recorded a few steps would train on with deterministic algorithms (an error
    for an op that has none), TF32 off and the environment changed. The RNGs, once seeded, are the
    training's and are not touched, nor is a setting the script set itself (`touched`: `TOUCHED`), whatever
    its value. Returns the names of the settings given back."""
    now = snapshot()
    pairs = {k: (k,) for k in _SETTERS}
    pairs["deterministic_algorithms"] = ("deterministic_algorithms", "deterministic_warn_only")
    changed = [k for k, ks in pairs.items() if any(before[x] != applied[x] for x in ks)
               and all(now[x] == applied[x] for x in ks) and k not in touched]
    restore(before, changed)
    return changed


def restore(saved: dict, keys: list[str] | None = None) -> None:
    """Set the settings apply() changes (those named `keys`, all by default) to their values in
    `saved`, a snapshot(). Inductor's deterministic flag goes with the deterministic algorithms, as
    torch's public call sets it."""
    for key in _SETTERS if keys is None else keys:
        if key != "deterministic_algorithms":
            _SETTERS[key](saved[key])
            continue
        _set_deterministic(saved["deterministic_algorithms"], saved["deterministic_warn_only"])
        inductor = sys.modules.get("torch._inductor.config")  # loaded before or since
        if inductor is not None:
            inductor.deterministic = saved["inductor"] if saved["inductor"] is not None \
                else saved["deterministic_algorithms"]


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

    if config.seed is not None:
        random.seed(config.seed)
        np.random.seed(config.seed % 2**32)
        torch.manual_seed(config.seed)  # seeds CUDA generators too
    _use_deterministic_algorithms(config.warn_only)
    FILL.install()
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    TOUCHED.install()  # (after the controls' own settings: what is set from here on is the script's)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    os.environ.setdefault("NCCL_PROTO", "Simple")
    # On CPU the thread count alone changes reduction order: pin it (to the default unless told)
    # so both runs state, and use, the same value.
    torch.set_num_threads(config.threads or torch.get_num_threads())
    # DataLoader workers: torch seeds each one's torch, Python and NumPy generators from the main
    # process's torch generator (seeded above, or by the script). bitguard once reseeded Python's and
    # NumPy's with a seed of its own, which changed what a seeded script's workers drew (helper 23).
    return {
        "enabled": True,
        "seed": config.seed,
        "seeded": ["python", "numpy", "torch_cpu", "torch_cuda"] if config.seed is not None else [],
        "dataloader_worker_seeding": "torch",  # (True in older runs: bitguard reseeded Python's and NumPy's)
        **current_settings(),
    }
