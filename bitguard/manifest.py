"""`manifest.json`: what a run directory says about how it was recorded, as one declared model.

Written by rank 0 when recording starts (status "running") and again when it ends; the
`bitguard record` launcher patches in the script's exit status afterwards, so a run whose
process was killed still says so. Writes are atomic (temporary file, then rename).

`Manifest` declares every field bitguard writes and reads, with its type and range; `new()`
builds a manifest through it, and `load()` reads one back through it (bounded in size and JSON
depth), so a field of the wrong type is a one-line `CorruptRun` naming the field, not a
traceback later. `RankMeta` does the same for the facts in a rank file's meta table. Fields
this version does not know are kept (a newer bitguard may add some). This module knows nothing
about rank files' tables or how runs are compared.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bitguard import runfiles
from bitguard.errors import CorruptRun, NotARun, SchemaMismatch
from bitguard.schema import DIGEST, DIGEST_BUILD, MANIFEST_NAME, SCHEMA_VERSION

STATUSES = ("running", "complete", "failed", "interrupted")
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few kilobytes; a bigger one was not written by bitguard
MAX_WORLD_SIZE = 65536
_INT32 = 2**31 - 1
Status = Literal["running", "complete", "failed", "interrupted"]  # = STATUSES


def _field(description: str, default: Any = None, **constraints) -> Any:
    """A model field whose `description` completes "must be ..." in the message naming it."""
    return Field(default, description=description, **constraints)


class Manifest(BaseModel):
    """manifest.json. Types are strict: "2" is not a world size and true is not an exit status."""

    model_config = ConfigDict(extra="allow", strict=True)

    tool: Literal["bitguard"] = _field('"bitguard"', ...)
    tool_version: str | None = _field("a version string")
    schema_version: int = _field(f"an integer between 1 and {_INT32}", ..., ge=1, le=_INT32)
    digest: str | None = _field("the name of a digest definition (a string)")
    digest_build: int | None = _field("the host digest kernel's revision (an integer)")
    recorder: str | None = _field("16 hex digits naming the build of bitguard's recording code (a string)")
    command: list[str] | str | None = _field("the recorded command, a list of strings")
    cwd: str | None = _field("a folder path (a string)")
    python: str | None = _field("the interpreter's path (a string)")
    script_sha256: str | None = _field("the SHA-256 of the recorded script, 64 hex digits (a string)")
    env: dict[str, str] | None = _field("an object mapping environment variable names to their values (strings)")
    sources: dict[str, str] | None = _field("an object mapping source files to their SHA-256 (strings)")
    mode: str | None = _field("a recording mode (a string)")
    steps: list[int | None] | None = _field("null or [first step, end step or null]", max_length=2)
    # required: without it, a missing rank could not be told from a smaller job
    world_size: int = _field(f"an integer between 1 and {MAX_WORLD_SIZE}", ..., ge=1, le=MAX_WORLD_SIZE)
    determinism: dict[str, Any] | None = _field("an object (the determinism settings in force)")
    versions: dict[str, str] | None = _field("an object mapping library names to version strings")
    devices: list[str] | None = _field("a list of device names (strings)")
    platform: str | None = _field("a string")
    machine: str | None = _field("a string")
    hostname: str | None = _field("a string")
    cpu_count: int | None = _field("a non-negative integer", ge=0, le=_INT32)
    start_time: str | None = _field("a time stamp (a string)")
    end_time: str | None = _field("a time stamp (a string)")
    status: Status | None = _field("one of " + ", ".join(STATUSES))
    complete: bool | None = _field("true or false")
    exit_status: int | None = _field("an integer exit status", ge=-_INT32, le=_INT32)
    signal: str | None = _field("a signal name (a string)")
    collector_errors: list[str] | None = _field("a list of messages (strings)")
    events_rank0: int | None = _field("a non-negative integer", ge=0)
    steps_completed: int | None = _field("a non-negative integer", ge=0)
    dump: bool | None = _field("true or false")
    digest_cache: bool | None = _field("true or false")


class JournalDamage(BaseModel):
    """What a fold found wrong in a rank's journal (see collectors/journal.py)."""

    model_config = ConfigDict(extra="allow", strict=True)

    from_step: int | None = _field("null or the first step that cannot be trusted", ge=0)
    reason: str = _field("a message (a string)", ...)
    kept_as: str | None = _field("null or the name of the journal kept")


class RankMeta(BaseModel):
    """The facts of a rank file's meta table, each stored as a JSON value under its key."""

    model_config = ConfigDict(extra="allow", strict=True)

    schema_version: int | None = _field(f"an integer between 1 and {_INT32}", ge=1, le=_INT32)
    status: Status | None = _field("one of " + ", ".join(STATUSES))
    rank: int | None = _field(f"an integer between 0 and {MAX_WORLD_SIZE - 1}", ge=0, lt=MAX_WORLD_SIZE)
    world_size: int | None = _field(f"an integer between 1 and {MAX_WORLD_SIZE}", ge=1, le=MAX_WORLD_SIZE)
    mode: str | None = _field("a recording mode (a string)")
    determinism: dict[str, Any] | None = _field("an object (the determinism settings in force)")
    steps: list[int | None] | None = _field("null or [first step, end step or null]", max_length=2)
    start_time_ns: int | None = _field("an integer time stamp")
    end_time_ns: int | None = _field("an integer time stamp")
    pid: int | None = _field("an integer process id")
    dump: bool | None = _field("true or false")
    digest_cache: bool | None = _field("true or false")
    journal_folded: int | None = _field("an integer journal group number (-1: none)", ge=-1)
    journal_damage: JournalDamage | None = _field('null or {"from_step": ..., "reason": ...}')
    collector_errors: list[str] | None = _field("a list of messages (strings)")
    steps_completed: int | None = _field("a non-negative integer", ge=0)
    events: int | None = _field("a non-negative integer", ge=0)
    threads_not_recorded: dict[str, int] | None = _field(
        "an object mapping thread names to the module calls made there and not recorded (integers)")
    threads_drew_rng: dict[str, int] | None = _field(
        "an object mapping thread names to those of their calls that moved a generator's state (integers)")


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else f"{text[:32]}... ({len(text):,} characters)"


def problem(model: type[BaseModel], exc: ValidationError, data: dict, label: str = "field") -> str:
    """'field 'world_size' must be an integer between 1 and 65536 (got "abc")' for the first error,
    naming the top-level field and its whole value (a nested error's position means little to a user)."""
    error = exc.errors(include_url=False)[0]
    name = str(error["loc"][0]) if error["loc"] else "?"
    info = model.model_fields.get(name)
    expected = info.description if info is not None and info.description else error["msg"]
    got = f"got {_shown(data[name])}" if isinstance(data, dict) and name in data else "missing"
    return f"{label} {name!r} must be {expected} ({got})"


def validate(data: dict, where: str | os.PathLike) -> Manifest:
    """`data` (a manifest read back from `where`) through the model; CorruptRun naming the field."""
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        raise CorruptRun(f"{where}: {problem(Manifest, exc, data)}; re-record the run or fix the file") from None


def load(directory: str | os.PathLike) -> dict:
    """The manifest of run directory `directory`, validated; NotARun / SchemaMismatch / CorruptRun
    in one line naming the file when it is missing, not bitguard's, newer, or damaged."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    data = runfiles.read(directory, path, MAX_MANIFEST_BYTES, what="manifest")
    if data is None:
        raise NotARun(f"{directory} has no {MANIFEST_NAME}: it is not a bitguard run directory; record one with "
                      f"'bitguard record --out {directory} -- python train.py'")
    try:
        manifest = runfiles.loads(data)
    except runfiles.JSONRefused as exc:
        raise CorruptRun(f"{path} is not valid JSON ({exc}); the run directory is damaged: re-record it") from None
    if not isinstance(manifest, dict) or manifest.get("tool") != "bitguard":
        raise NotARun(f"{path} was not written by bitguard; give a run directory from 'bitguard record'")
    version = manifest.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptRun(f"{path} has no integer schema_version (got {_shown(version)}); the run directory is "
                         f"damaged: re-record it")
    if version > SCHEMA_VERSION:
        raise SchemaMismatch(f"{directory} was recorded with schema version {version}, newer than this bitguard "
                             f"reads ({SCHEMA_VERSION}); upgrade bitguard (pip install -U bitguard)")
    if version < 1:
        raise SchemaMismatch(f"{directory} has unknown schema version {version}; re-record it with this bitguard")
    validate(manifest, path)
    return manifest


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bitguard")
    except PackageNotFoundError:
        return "0+unknown"


def recorder_build() -> str:
    """16 hex digits of the SHA-256 of the recording code's sources (bitguard's own package, its
    collectors and digest kernels): two runs recorded by different builds of one version (a
    development checkout, an upgrade between the reference and the suspect) say so, since what
    one build records and the other does not can differ by itself."""
    import hashlib
    import importlib.util

    digest, seen = hashlib.sha256(), set()
    for name in ("bitguard", "bitguard.collectors", "bitguard.cuda"):
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            for path in sorted(Path(folder).rglob("*.py")):
                if path not in seen:  # (installed from a wheel, the subpackages are inside bitguard's own folder)
                    seen.add(path)
                    digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def environment() -> dict:
    """Versions and devices: what, beside the code, can make two runs differ."""
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    return {
        "versions": versions(imported=False),  # the script's imports are added when the recording ends
        "devices": devices,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
    }


def versions(imported: bool = True) -> dict[str, str]:
    """The version of Python, torch and NumPy, of every installed distribution a module of which is
    imported now (`imported`; torch, transformers, accelerate, deepspeed, flash-attn, triton, ...:
    taken when the recording ends, so what the script imported is there; the scan costs about
    0.3 s), keyed by its normalized name, and of CUDA, cuDNN and NCCL where torch has them. A
    library imported only for a moment and dropped from sys.modules, or vendored inside another,
    is not seen."""
    import numpy
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__}
    if imported:
        out.update(_imported_distributions())
    out["torch"] = torch.__version__  # the build tag (+cpu, +cu124) as torch itself says it
    out.update(_native_versions(torch))
    return out


def versions_at_end(previous: dict | None) -> dict:
    """`versions()` when the recording ends (what the script imported by then), over the versions
    taken at the start; those alone if taking them fails (the recording must still end)."""
    try:
        return {**(previous or {}), **versions()}
    except Exception:  # noqa: BLE001 - a broken installation must not fail the end of a recording
        return dict(previous or {})


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: flash_attn and Flash-Attn are one name


_owners_at: dict[tuple[str, int | None], dict[str, list[str]]] = {}  # (folder, its time of change) -> its owners
_versions_at: dict[tuple[tuple[str, int | None], str], str | None] = {}  # ((folder, time), distribution) -> version


def distribution_owners() -> dict[str, list[str]]:
    """Top-level import name -> the installed distributions that provide it, in the order of the
    search path (as `importlib.metadata.packages_distributions()` gives them). Reading a folder's
    distributions reads their files (0.1 to 0.3 s for a site-packages), so each folder of the path is
    read again only when it changed (a distribution installed there since); a folder new on the path
    (a script's, the working directory a recording writes into) is read alone. A process that forks
    recordings reads the rest once before forking."""
    out: dict[str, list[str]] = {}
    for _, owners in _owners_by_folder():
        for top, dists in owners.items():
            out.setdefault(top, []).extend(dists)
    return out


def _owners_by_folder() -> list[tuple[tuple[str, int | None], dict[str, list[str]]]]:
    """((folder, its time of change), its owners) of each folder of the search path, in its order."""
    out = []
    for entry in sys.path:
        where = os.path.abspath(entry or ".")
        key = (where, _changed_at(where))
        owners = _owners_at.get(key)
        if owners is None:
            owners = _owners_at[key] = _folder_owners(where)
        out.append((key, owners))
    return out


def _folder_owners(folder: str) -> dict[str, list[str]]:
    """The owners of the distributions installed in one folder: the names a distribution declares
    (top_level.txt), else the first part of each Python file it installed."""
    from importlib import metadata

    owners: dict[str, list[str]] = {}
    try:
        for dist in metadata.distributions(path=[folder]):
            tops = (dist.read_text("top_level.txt") or "").split() or \
                {f.parts[0] if len(f.parts) > 1 else f.with_suffix("").name
                 for f in dist.files or () if f.suffix == ".py"}
            for top in tops:
                owners.setdefault(top, []).append(dist.metadata["Name"])
    except Exception:  # noqa: BLE001 - a broken installed distribution: fall back to the modules' own versions
        return {}
    return owners


def _changed_at(entry: str) -> int | None:
    try:
        return os.stat(entry or ".").st_mtime_ns
    except (OSError, ValueError):
        return None


def _imported_distributions() -> dict[str, str]:
    owners: dict[str, list[tuple[tuple, str]]] = {}  # top-level name -> (folder key, distribution), in path order
    for folder, tops in _owners_by_folder():
        for top, dists in tops.items():
            owners.setdefault(top, []).extend((folder, dist) for dist in dists)
    out = {}
    for top in sorted({name.partition(".")[0] for name in list(sys.modules)}):
        for folder, dist in owners.get(top, ()):
            key = _normalized(dist)
            if key in out:
                continue
            version = _version_in(folder, dist)  # the first on sys.path: the one imported
            if version is not None:
                out[key] = version
        module = sys.modules.get(top)
        if top not in owners and top not in sys.stdlib_module_names and not top.startswith("_") \
                and isinstance(getattr(module, "__version__", None), str):
            out.setdefault(_normalized(top), module.__version__)  # a package not installed as a distribution
    return out


def _version_in(folder: tuple[str, int | None], dist: str) -> str | None:
    """The version of distribution `dist` installed in `folder` (its path and time of change: read
    again once it changed), None without one; parsed once (every recording's end asks, and parsing
    the metadata of sixty distributions took 0.2 s)."""
    from importlib import metadata

    if (folder, dist) not in _versions_at:
        try:
            found = next(iter(metadata.distributions(name=dist, path=[folder[0]])), None)
            _versions_at[folder, dist] = found.version if found is not None else None
        except Exception:  # noqa: BLE001 - metadata without a version
            _versions_at[folder, dist] = None
    return _versions_at[folder, dist]


def _native_versions(torch) -> dict[str, str]:
    """CUDA, cuDNN and NCCL as this torch build links them (none on a CPU build)."""
    out = {}
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    if getattr(torch.version, "hip", None):
        out["hip"] = torch.version.hip
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:  # noqa: BLE001 - a CUDA build on a machine without the library
        cudnn = None
    if cudnn:
        out["cudnn"] = str(cudnn)
    try:
        nccl = torch.cuda.nccl.version() if torch.version.cuda and torch.distributed.is_nccl_available() else None
    except Exception:  # noqa: BLE001 - NCCL absent or not loadable here
        nccl = None
    if nccl:
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return out


# Environment variables that can change what a training computes, recorded so that a replay
# (`bitguard drill`) runs under them again. Secrets are never recorded (names holding TOKEN, KEY,
# SECRET, PASSWORD or CREDENTIAL), nor what a launcher sets per process (RANK, MASTER_ADDR, ...).
# BITGUARD_RECORD_ENV="NAME,NAME2" records more names (a script's own switches).
ENV_PREFIXES = ("CUDA_", "CUBLAS_", "CUDNN_", "NCCL_", "NVIDIA_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_",
                "OPENBLAS_", "HF_", "TRANSFORMERS_", "ACCELERATE_", "TOKENIZERS_", "XLA_", "TRITON_", "KERAS_", "BITGUARD_")
ENV_NAMES = ("PYTHONHASHSEED", "PYTHONPATH", "LD_PRELOAD", "CUBLASLT_WORKSPACE_SIZE")
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL", re.I)
_PER_PROCESS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|"
                          r"ROLE_WORLD_SIZE|ROLE_NAME|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|TORCH_NCCL_ASYNC_.*|"
                          r"BITGUARD_DRILL|BITGUARD_LAUNCHER_COMMAND)$")


def recorded_env(environ: dict | None = None) -> dict[str, str]:
    """The environment variables a replay must run under again (see ENV_PREFIXES)."""
    environ = os.environ if environ is None else environ
    extra = {n.strip() for n in environ.get("BITGUARD_RECORD_ENV", "").split(",") if n.strip()}
    return {name: value for name, value in sorted(environ.items())
            if (name in extra or name in ENV_NAMES or name.startswith(ENV_PREFIXES))
            and not _SECRET.search(name) and not _PER_PROCESS.match(name)}


def script_of(command: list[str] | str | None) -> str | None:
    """The training script of a recorded command (`python [OPTS] train.py ...` or `train.py ...`)."""
    if not isinstance(command, list):
        return None
    return next((c for c in command if isinstance(c, str) and c.endswith(".py")), None)


def file_sha256(path: str | os.PathLike) -> str | None:
    import hashlib

    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def replay_facts(command: list[str]) -> dict:
    """What a replay needs beside the command: the interpreter, the script's hash (to tell an
    edited script) and the environment that matters."""
    script = script_of(command)
    return {"python": sys.executable, "script_sha256": file_sha256(script) if script else None,
            "env": recorded_env()}


MAX_SOURCES = 256


def sources(cwd: str | None, command) -> dict[str, str]:
    """SHA-256 of the user's own Python files the training imported: every module file under the
    working directory or the script's folder, outside installed packages (site-packages) and
    bitguard itself, at most MAX_SOURCES. A replay compares them: an edited model.py is named."""
    script = script_of(command)
    roots = frozenset(Path(r).resolve() for r in (cwd, Path(cwd or ".", script).parent if script else None) if r)
    kept = _kept_at.setdefault(roots, {})  # a module's file -> its resolved path if the user's own, else None
    out = {}
    for key, module in list(sys.modules.items()):
        name = getattr(module, "__file__", None)
        if key == "bitguard" or key.startswith("bitguard.") or not isinstance(name, str) or not name.endswith(".py"):
            continue
        if name not in kept:  # (each module file once a process: a recording's end walks thousands)
            kept[name] = _users_file(name, roots)
        path = kept[name]
        if path is None:
            continue
        digest = file_sha256(path)
        if digest:
            out[str(path)] = digest
        if len(out) >= MAX_SOURCES:
            break
    return dict(sorted(out.items()))


_resolved_at: dict[str, Path] = {}  # a folder of imported modules -> its real path
_kept_at: dict[frozenset, dict[str, Path | None]] = {}  # sources' roots -> `_users_file` of each module file


def _users_file(name: str, roots: frozenset) -> Path | None:
    """The real path of module file `name` when it is the user's own (under `roots`, outside installed
    packages), else None."""
    linked = _linked(name)
    if linked is not None:  # (the file itself links elsewhere: resolved whole)
        return linked if _users_own(linked, roots) else None
    folder, file = os.path.split(name)
    where = _resolved(folder)  # (thousands of modules in a few hundred folders: each resolved once)
    return where / file if _users_own(where, roots) else None
_linked_at: dict[str, Path | None] = {}  # an imported module's file -> its real path if it is a link, else None


def _resolved(folder: str) -> Path:
    """`Path(folder).resolve()`, once a process: the folders modules were imported from (a few
    hundred, each resolved through every part of its path: 0.1 s at every recording's end)."""
    where = _resolved_at.get(folder)
    if where is None:
        where = _resolved_at[folder] = Path(folder).resolve()
    return where


def _linked(file: str) -> Path | None:
    """The real path of an imported module's `file` where the file itself is a symbolic link, else
    None; once a process (a thousand modules: a thousand lstat calls at every recording's end)."""
    if file not in _linked_at:
        _linked_at[file] = Path(file).resolve() if os.path.islink(file) else None
    return _linked_at[file]


def _users_own(path: Path, roots: set[Path]) -> bool:
    """Is the resolved `path` under one of `roots` and outside installed packages?"""
    return "site-packages" not in path.parts and "dist-packages" not in path.parts and \
        any(path.is_relative_to(r) for r in roots)


def write(directory: str | os.PathLike, data: dict) -> None:
    path = Path(directory) / MANIFEST_NAME
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def read(directory: str | os.PathLike) -> dict:
    """The manifest's JSON as it is, unvalidated (the launcher patches what its child wrote); a
    ValueError when it is not JSON or nests too deeply, OSError when it cannot be read."""
    directory = Path(directory)
    try:
        data = runfiles.read(directory, directory / MANIFEST_NAME, MAX_MANIFEST_BYTES, what="manifest")
    except CorruptRun as exc:  # a pipe, a link out of the folder, too big
        raise ValueError(str(exc)) from None
    if data is None:
        raise FileNotFoundError(2, "No such file", str(directory / MANIFEST_NAME))
    return runfiles.loads(data)


def new(command: list[str], mode: str, world_size: int, determinism: dict, steps, extra: dict | None = None) -> dict:
    """A new run's manifest (status "running"), checked against `Manifest` as the JSON it is written as:
    what a reader will find. A field of the wrong type here is a bug in bitguard (ValueError)."""
    data = {
        "tool": "bitguard",
        "tool_version": tool_version(),
        "schema_version": SCHEMA_VERSION,
        "digest": DIGEST,
        "digest_build": DIGEST_BUILD,
        "recorder": recorder_build(),
        "command": command,
        "cwd": os.getcwd(),
        **replay_facts(command),
        "mode": mode,
        "steps": None if steps is None else list(steps),
        "world_size": world_size,
        "determinism": determinism,
        **environment(),
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "end_time": None,
        "status": "running",
        "complete": False,
        "exit_status": None,
        "collector_errors": [],
        **(extra or {}),
    }
    as_written = json.loads(json.dumps(data, default=str))
    try:
        Manifest.model_validate(as_written)
    except ValidationError as exc:
        raise ValueError(f"bitguard built an invalid manifest: {problem(Manifest, exc, as_written)}") from None
    return as_written
