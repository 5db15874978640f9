"""The JSON files a training writes beside its saves: peft's `adapter_config.json` next to the adapter
weights, the HF Trainer's `trainer_state.json` in a checkpoint folder, a `config.json` by
`save_pretrained`. They are written with `json` or a plain `write()`, which no save function sees,
yet a run that would resume or load differently from them is a different run.

`Destinations` remembers the folders the observed saves wrote into (`note`: the second argument of
`torch.save` and safetensors' `save_file`, a distributed checkpoint's folder) and the files they
wrote. When the recording ends, `json_files` lists each such folder's `*.json` files written since
the recording began (not the saves' own files, not what was there before), in the order the
folders were first written and then by name, each with what it holds or why it could not be read.
Their Python numbers are compared as a save's are (collectors/saved.py: `tensors_in`, numbers under a
key that names a time left out); strings are not. Other files beside the saves (a README, YAML,
pickles written without torch.save) are not read. Knows nothing of events or digests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MAX_FOLDERS = 256  # folders looked into when the recording ends
MAX_ENTRIES = 20_000  # directory entries looked at in one folder
MAX_FILES = 256  # JSON files read from one folder
MAX_BYTES = 64 << 20  # a JSON file bigger than this is not read (marked)
_DESTINATION_KEYWORDS = ("f", "filename", "checkpoint_id")


def destination(args: tuple, kwargs: dict) -> str | None:
    """The path a save call writes to, from its arguments (None: to memory, a buffer, or unknown):
    its second positional argument or `f=` / `filename=` / `checkpoint_id=`, a path or an open file
    with a name, or a distributed checkpoint writer (its `.path`)."""
    try:
        where = args[1] if len(args) > 1 else next((kwargs[k] for k in _DESTINATION_KEYWORDS if k in kwargs),
                                                   kwargs.get("storage_writer"))
        if not isinstance(where, (str, os.PathLike)):  # an open file's name, a checkpoint writer's folder
            where = getattr(where, "name", None) or getattr(where, "path", None)
        if isinstance(where, os.PathLike):
            where = os.fspath(where)
        return where if isinstance(where, str) and where else None
    except Exception:  # noqa: BLE001 - an object that fails when looked at: the save is still observed
        return None


class Destinations:
    """The folders the observed saves wrote into, and their JSON files when the recording ends."""

    def __init__(self, since_ns: int):
        self.since_ns = since_ns  # files older than this (there before the recording) are not read
        self._folders: dict[str, None] = {}  # in the order first written
        self._written: set[str] = set()  # the saves' own files

    def note(self, path: str | None) -> None:
        """A save wrote to `path` (a file, or a distributed checkpoint's folder)."""
        if path is None:
            return
        path = os.path.abspath(path)
        self._written.add(path)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        if folder not in self._folders and len(self._folders) < MAX_FOLDERS:
            self._folders[folder] = None

    def json_files(self) -> list[tuple[str, object, str | None]]:
        """(file name, parsed value, None) or (file name, None, why it was not read) of each JSON file
        written beside the saves since the recording began, as the module docstring says."""
        found = []
        for folder in self._folders:
            names = []
            try:
                with os.scandir(folder) as entries:
                    for i, entry in enumerate(entries):
                        if i >= MAX_ENTRIES:
                            found.append(("*.json", None, f"{folder} holds more than {MAX_ENTRIES:,} entries: "
                                                        "the JSON files beside the saves were not all looked for"))
                            break
                        if entry.name.endswith(".json") and entry.path not in self._written \
                                and entry.is_file() and entry.stat().st_mtime_ns >= self.since_ns:
                            names.append(entry.name)
            except OSError:  # a folder removed since (a temporary checkpoint): nothing left to compare
                continue
            names.sort()
            if len(names) > MAX_FILES:
                found.append(("*.json", None, f"{len(names):,} JSON files were written beside the saves in {folder}: "
                                            f"the first {MAX_FILES} by name are compared"))
            found += [_read(Path(folder, name)) for name in names[:MAX_FILES]]
        return found


def _read(path: Path) -> tuple[str, object, str | None]:
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            return path.name, None, f"{path.name} ({size:,} bytes) is bigger than {MAX_BYTES >> 20} MiB: not read"
        return path.name, json.loads(path.read_bytes()), None
    except (OSError, ValueError, RecursionError) as exc:
        return path.name, None, f"{path.name} could not be read as JSON ({type(exc).__name__}: {exc})"[:300]
