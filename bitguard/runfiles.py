"""Reading the files of a run directory without trusting them.

A run directory may come from anywhere (a copy, an upload, a fuzzer). `member()` says whether a
name in it is a regular file inside the directory, and refuses named pipes (opening one would
wait forever), devices, sockets, folders and links that lead out of the directory, before
anything opens them. `read()` opens a member without blocking, checks it again on the open
descriptor, and reads at most a given size (`head()`: only the first bytes). `loads()` parses JSON whose size and nesting depth
are bounded before `json.loads` sees it, so a hostile file is a one-line refusal, never a
RecursionError. Failures are `CorruptRun`s that name the path as the caller gave it.

This module knows files and JSON; what a run's files mean is ingest's and manifest's.
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import accumulate
from pathlib import Path

from bitguard.errors import CorruptRun

MAX_JSON_DEPTH = 64  # deeper JSON is refused: nothing bitguard writes nests more than a few levels
_JSON_TOKENS = re.compile(rb'[\\"\[\]{}]')


class JSONRefused(ValueError):
    """JSON that is not valid, or nests deeper than MAX_JSON_DEPTH."""


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def _refuse(path: Path, what: str) -> CorruptRun:
    return CorruptRun(f"{path} is {what}; bitguard reads only the regular files a recording wrote: replace it "
                      f"with the file itself (or re-record the run)")


def member(run_dir: Path, path: Path) -> os.stat_result | None:
    """The stat of `path`, a file of `run_dir`; None when it does not exist. Raises CorruptRun when
    it is not a regular file, or a link that leads outside `run_dir` (or to nothing)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CorruptRun(f"{path} cannot be examined ({exc.strerror or exc}); check its permissions") from None
    if stat.S_ISLNK(st.st_mode):
        root, target = os.path.realpath(run_dir), os.path.realpath(path)
        if os.path.commonpath([root, target]) != root:
            raise _refuse(path, "a link to a file outside the run directory")
        try:
            st = os.stat(path)
        except OSError:
            raise _refuse(path, "a link to nothing") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, _kind(st.st_mode))
    return st


def read(run_dir: Path, path: Path, limit: int | None = None, what: str = "file") -> bytes | None:
    """The bytes of member `path` (None when absent); CorruptRun when it is not a regular file of
    `run_dir`, cannot be read, or holds more than `limit` bytes."""
    return _read(run_dir, path, limit, what, prefix=None)


def head(run_dir: Path, path: Path, size: int) -> bytes | None:
    """The first `size` bytes of member `path` (fewer when it is shorter; None when absent), with
    the checks of `read()`."""
    return _read(run_dir, path, None, "file", prefix=size)


def _read(run_dir: Path, path: Path, limit: int | None, what: str, prefix: int | None) -> bytes | None:
    if member(run_dir, path) is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CorruptRun(f"{path} cannot be read ({exc.strerror or exc}); check its permissions") from None
    try:
        st = os.fstat(fd)  # what was opened, not what was looked at: a pipe swapped in meanwhile is refused
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, _kind(st.st_mode))
        if limit is not None and st.st_size > limit:
            raise CorruptRun(f"{path} is {st.st_size:,} bytes, more than a bitguard {what} can be "
                             f"({limit:,}); it is not one a recording wrote: re-record the run")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(prefix if prefix is not None else -1 if limit is None else limit + 1)
    except OSError as exc:
        raise CorruptRun(f"{path} cannot be read ({exc.strerror or exc}); copy the run again") from None
    finally:
        os.close(fd)
    if limit is not None and len(data) > limit:
        raise CorruptRun(f"{path} holds more than {limit:,} bytes, more than a bitguard {what} can be; "
                         f"re-record the run")
    return data


def too_deep(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the arrays and objects of JSON text nest deeper than `limit` (brackets inside
    strings do not count). Linear in the text, with no recursion."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    steps, in_string, escaped_at = [], False, -2
    for m in _JSON_TOKENS.finditer(data):
        at, c = m.start(), data[m.start()]
        if in_string:
            if at == escaped_at:
                continue
            if c == 0x5C:  # backslash: the byte after it is escaped
                escaped_at = at + 1
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in b"[{":
            steps.append(1)
        elif c in b"]}":
            steps.append(-1)
    return max(accumulate(steps), default=0) > limit


def loads(data: bytes | str) -> object:
    """JSON text as Python values; JSONRefused when it is not valid JSON or nests too deeply."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if too_deep(raw):
        raise JSONRefused(f"it nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw)
    except RecursionError:
        raise JSONRefused(f"it nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise JSONRefused(str(exc).splitlines()[0][:200]) from None
