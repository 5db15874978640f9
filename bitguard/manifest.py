"""`manifest.json`: what a run directory says about how it was recorded.

Written by rank 0 when recording starts (status "running") and again when it ends; the
`bitguard record` launcher patches in the script's exit status afterwards, so a run whose
process was killed still says so. Writes are atomic (temporary file, then rename).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

from bitguard.schema import DIGEST, MANIFEST_NAME, SCHEMA_VERSION

STATUSES = ("running", "complete", "failed", "interrupted")


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bitguard")
    except PackageNotFoundError:
        return "0+unknown"


def environment() -> dict:
    """Versions and devices: what, beside the code, can make two runs differ."""
    import numpy
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    versions = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__}
    for name in ("numba", "transformers", "duckdb"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", "?")
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    return {
        "versions": versions,
        "devices": devices,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
    }


def write(directory: str | os.PathLike, data: dict) -> None:
    path = Path(directory) / MANIFEST_NAME
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def read(directory: str | os.PathLike) -> dict:
    return json.loads((Path(directory) / MANIFEST_NAME).read_text())


def new(command: list[str], mode: str, world_size: int, determinism: dict, steps, extra: dict | None = None) -> dict:
    return {
        "tool": "bitguard",
        "tool_version": tool_version(),
        "schema_version": SCHEMA_VERSION,
        "digest": DIGEST,
        "command": command,
        "cwd": os.getcwd(),
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
