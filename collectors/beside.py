"""The JSON files a training writes: peft's `adapter_config.json` beside the adapter's weights, the
HF Trainer's `trainer_state.json`, the `config.json` and `scheduler_config.json` that
`save_pretrained` writes (a diffusers pipeline's scheduler has no tensor at all). They are written
with `open()` and `json` or a plain `write()`, which no save function sees, yet a run that would
resume or load differently from them is a different run.

`JsonWrites` wraps `open` (the builtin, which `io.open` and `pathlib` use too) while a recording
runs and notes each `*.json` file the training's code opens for writing (not bitguard's own, not
a forked child's). `written()` gives those whose file object has been closed since (all of them
when the recording ends), each with what it holds or why it could not be read, in the order they
were opened; the collector reads them at each step's end. A noted file the training removes before
then (`os.remove`, `os.unlink`, `shutil.rmtree` of its folder: pytorch-tabnet zips its model's folder
and removes it) is read as it is removed, once closed. `json_values` gives a JSON value's
numbers and strings as tensors named by where they are (`['lora_alpha'] (python int)`): the
numbers as a save's are (collectors/saved.py; none under a key that names a time), and the
strings as a 64-bit hash of their UTF-8 bytes (`['act_fn'] (python str)`), but a path or a URL, and the strings
under a key that names a folder, a file's path or a host (`output_dir`, `_name_or_path`), which
differ from run to run by design; and the keys of each object, as one list of such strings
(`['label2id'] (python keys)`), each object taken in the order of its keys. Knows nothing of events or
digests.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import stat
import sys
import time
import weakref

import torch

from bitguard.collectors.patching import Patch
from bitguard.collectors.saved import (PACKED_INTS, in_key_order, number_tensor, place_key, string_compared,
                                       string_tensor)
from bitguard.schema import KEYS_MARK, NUMBER_MARK, STRING_MARK
from bitguard.timed import clock_below, compared

MAX_PENDING = 4096  # files noted and not yet read (a training that writes more: the oldest are read first)
MAX_BYTES = 64 << 20  # a JSON file bigger than this is not read (marked)
MAX_VALUES = 100_000  # values taken from one file
_WRITING = frozenset("wax+")


class JsonWrites:
    """Notes the JSON files the training opens for writing, or renames to a `.json` name (an atomic
    write: `tmp` then `os.replace`). `active()`: the collector records; `run`: the run directory,
    whose manifest and rank files are bitguard's own (not noted); `where(frame)`: what names the code that opened one,
    given its frame; `child(name)`: called instead in a forked child (a DataLoader worker), whose
    writes are not observed, for the parent to say so."""

    def __init__(self, active, run: str, where, child=None):
        self._active, self._where, self._child = active, where, child
        self._own = os.path.abspath(run)
        self._pending: dict[str, tuple[weakref.ref | None, object]] = {}  # path -> (its file, where), in order
        self._early: list[tuple[tuple, int]] = []  # (what `_read` gave, opened) of files read as they were removed
        self._patches: list[Patch] = []

    @property
    def noted(self) -> bool:
        """Files are waiting to be read, or were read as they were removed."""
        return bool(self._pending or self._early)

    def install(self) -> JsonWrites:
        first = Patch(builtins, "open", self._wrap)
        # the same function for io.open (pathlib's), as torch found them: `open is io.open` stays true
        same = first.wrapper if io.open is first.original else None
        self._patches = [first, Patch(io, "open", (lambda original, patch: same) if same else self._wrap),
                         Patch(os, "replace", self._wrap_rename), Patch(os, "rename", self._wrap_rename),
                         Patch(os, "remove", self._wrap_removal), Patch(os, "unlink", self._wrap_removal),
                         Patch(shutil, "rmtree", self._wrap_removal)]
        return self

    def remove(self) -> None:
        for patch in self._patches:
            patch.remove()
        self._patches.clear()

    def _wrap(self, original, patch):
        def open(file, mode="r", *args, **kwargs):  # noqa: A001 - what it stands in for
            f = original(file, mode, *args, **kwargs)
            if patch.active and type(mode) is str and _WRITING.intersection(mode):
                self._note(file, f, sys._getframe(1))
            return f
        return open

    def _wrap_rename(self, original, patch):
        def rename(src, dst, *args, **kwargs):
            result = original(src, dst, *args, **kwargs)
            if patch.active:
                if self._pending:
                    self._moved(src, dst)
                self._note(dst, None, sys._getframe(1), renamed=src)
            return result
        return rename

    def _moved(self, src, dst) -> None:
        """The noted files under folder `src` are under `dst` now (a checkpoint written in a temporary folder,
        then renamed: helper 67). Never raises."""
        try:
            old, new = (os.path.abspath(os.fspath(p)) for p in (src, dst))
            if not os.path.isdir(new):
                return
            self._pending = {(new + path[len(old):] if path.startswith(old + os.sep) else path): entry
                             for path, entry in self._pending.items()}
        except Exception:  # noqa: BLE001 - these files are then not compared; the training goes on
            pass

    def _wrap_removal(self, original, patch):
        def remove(path, *args, **kwargs):
            if patch.active and self._pending and "dir_fd" not in kwargs:  # (rmtree's own unlinks: by descriptor)
                self._removing(path)
            return original(path, *args, **kwargs)
        return remove

    def _removing(self, path) -> None:
        """Read the noted files at or under `path` that are closed, before it is removed. Never raises."""
        try:
            where = os.path.abspath(os.fspath(path))
            for noted, (ref, caller, opened) in list(self._pending.items()):
                f = ref() if ref is not None else None
                if (noted == where or noted.startswith(where + os.sep)) and (f is None or f.closed):
                    del self._pending[noted]
                    read = _read(noted, caller)
                    if read is not None:
                        self._early.append((read, opened))
        except Exception:  # noqa: BLE001 - these files are then not compared; the training goes on
            pass

    def _note(self, file, f, caller, renamed=None) -> None:
        """Never raises: the file is the training's, opened (or renamed from `renamed`) as it asked."""
        try:
            if not isinstance(file, (str, os.PathLike)):
                return
            path = os.path.abspath(os.fspath(file))
            if not path.lower().endswith(".json") or (os.path.dirname(path) == self._own and (
                    os.path.basename(path) == "manifest.json" or os.path.basename(path).startswith("rank-"))):
                return
            if str(caller.f_globals.get("__name__", "")).startswith("bitguard."):  # (its own files: a manifest)
                return
            if not self._active():
                if self._child is not None:
                    self._child(os.path.basename(path))
                return
            if renamed is not None:  # (the temporary file's entry, if it was noted, is this one now)
                self._pending.pop(os.path.abspath(os.fspath(renamed)), None)
            try:
                ref = weakref.ref(f)
            except TypeError:
                ref = None
            self._pending.pop(path, None)  # (written again: read once, in the order of its last opening)
            self._pending[path] = (ref, self._where(caller), time.time_ns())
        except Exception:  # noqa: BLE001 - this file is then not compared; the training goes on
            pass

    def written(self, ended: bool = False) -> list[tuple[str, object, str | None, object, int]]:
        """(file name, parsed value, None, where, opened) or (file name, None, why it was not read,
        where, opened) of each noted file closed since (`ended`: every one noted), in the order they
        were opened (`opened`: when, in ns: a file read at a step's end was written before it, as a
        checkpoint's config is before the next step's batch); one removed since (a temporary file)
        is left out."""
        ready, waiting = [], {}
        for path, (ref, where, opened) in self._pending.items():
            f = ref() if ref is not None else None
            closed = ended or f is None or f.closed or len(self._pending) > MAX_PENDING
            if closed and f is not None and not f.closed:  # (still open as the recording ends: what it
                try:  # wrote so far, as Python would flush it at exit)
                    f.flush()
                except Exception:  # noqa: BLE001 - read as it is on disk
                    pass
            if closed:
                ready.append((path, where, opened))
            else:
                waiting[path] = (ref, where, opened)
        self._pending = waiting
        found = [(*read, opened) for read, opened in ((_read(path, where), opened) for path, where, opened in ready)
                 if read is not None]
        if self._early:  # (read as they were removed: in the order of their opening, among the others)
            found = sorted(found + [(*read, opened) for read, opened in self._early], key=lambda r: r[-1])
            self._early = []
        return found


def _read(path: str, where) -> tuple[str, object, str | None, object] | None:
    name = os.path.basename(path)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):  # (a named pipe a log shipper reads: opening it would block)
            return None
        if info.st_size > MAX_BYTES:
            return name, None, f"{name} ({info.st_size:,} bytes) is bigger than {MAX_BYTES >> 20} MiB: not read", where
        with builtins.open(path, "rb") as f:
            text = f.read()
        try:
            return name, json.loads(text), None, where
        except ValueError:  # JSON Lines under a .json name (mmengine's scalars.json): a list of its lines
            return name, [json.loads(line) for line in text.splitlines() if line.strip()], None, where
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        return name, None, f"{name} could not be read as JSON ({type(exc).__name__}: {exc})"[:300], where


def json_values(value) -> tuple[list[tuple[str, torch.Tensor]], str | None]:
    """(path, tensor) of a JSON value's numbers and strings, as the module docstring says, and why some
    may be missing (None: none is)."""
    found: list[tuple[str, torch.Tensor]] = []
    # (value, its path, the name of the nearest key above it, what the nearest key naming a time names)
    stack = [(value, "", "", None)]
    while stack:
        value, path, key, clock = stack.pop()
        if len(found) >= MAX_VALUES:
            return found, f"more than {MAX_VALUES:,} values: the rest was not looked at"
        if isinstance(value, bool | int | float):
            if compared(clock, value):
                found.append((path + NUMBER_MARK.format(type(value).__name__), number_tensor(value)))
        elif isinstance(value, str):
            if string_compared(value, key, clock):
                found.append((path + STRING_MARK, string_tensor(value)))
        elif isinstance(value, dict):  # (in the order of its keys, as a save's: saved.in_key_order)
            ordered = in_key_order(value)
            keys = [k for k, _ in ordered if string_compared(k, key, clock) and not place_key(k)]
            if keys:
                found.append((path + KEYS_MARK, string_tensor(keys)))
            items = [(v, f"{path}[{k!r}]", k) for k, v in ordered]
            stack += [(v, sub, k, clock_below(sub, clock)) for v, sub, k in reversed(items)]
        elif isinstance(value, list):
            if len(value) >= PACKED_INTS and all(type(v) is int and -(1 << 63) <= v < (1 << 63)
                                                 and compared(clock, v) for v in value):
                found.append((path + NUMBER_MARK.format("int"), torch.tensor(value, dtype=torch.int64)))
            else:
                stack += [(v, f"{path}[{i}]", key, clock) for i, v in reversed(list(enumerate(value)))]
    return found, None
