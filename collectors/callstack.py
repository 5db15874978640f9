"""User call stacks for events, deduplicated.

A frame is "user" when it is not inside torch, bitguard or the Python standard library: the
stack shows the training script and model code (transformers included) that reached the
boundary. Stacks are interned so that each distinct stack is stored once.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig

import torch


def _package_dir(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


def _skip_prefixes() -> tuple[str, ...]:
    import bitguard
    import bitguard.backend
    import bitguard.collectors
    import bitguard.cuda

    dirs = [_package_dir(m) for m in (torch, bitguard, bitguard.collectors, bitguard.cuda, bitguard.backend)]
    return tuple(dirs)


_SKIP_PREFIXES = _skip_prefixes()
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
MAX_FRAMES = 24  # deepest frames kept (innermost)


def _is_user(filename: str) -> bool:
    if filename.startswith(_SKIP_PREFIXES) or filename.startswith("<"):
        return False
    return not filename.startswith(_STDLIB) or "site-packages" in filename


class StackTable:
    """Interns user stacks; `new` holds rows (stack_id, frames_json) not yet written.

    A stack key is a flat tuple of ints, `(id(code), line, id(code), line, ...)`, innermost frame
    first: hashing a code object hashes its contents (about half a microsecond each), hashing an
    int is nearly free, and a key is hashed for every event. Every code object met is kept alive
    in `_codes`, so its id is never reused for another one while this table lives.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}
        self._codes: dict[int, tuple[bool, object]] = {}  # id(code) -> (is it user code, the code)
        self.new: list[tuple[int, str]] = []

    def capture(self) -> int:
        """The id of the calling code's user stack (the hook's own frames are not user frames)."""
        return self.intern(self.key_until(sys._getframe(2))[0])

    def key_until(self, frame, stop_code=None) -> tuple[tuple, object]:
        """The user frames from `frame` outwards, as a key, up to and including the first frame
        running `stop_code`; that frame is returned too (None when the walk reached the top)."""
        key = []
        codes = self._codes
        while frame is not None:
            code = frame.f_code
            known = codes.get(id(code))
            if known is None:
                known = codes[id(code)] = (_is_user(code.co_filename), code)
            if known[0]:
                key += (id(code), frame.f_lineno)
            if code is stop_code:
                return tuple(key), frame
            frame = frame.f_back
        return tuple(key), None

    def intern(self, key: tuple) -> int:
        """The id of a stack key (innermost frame first), numbered on first sight."""
        key = key[: 2 * MAX_FRAMES]
        sid = self._ids.get(key)
        if sid is None:
            sid = len(self._ids)
            self._ids[key] = sid
            codes = [self._codes[key[i]][1] for i in range(0, len(key), 2)]
            frames = [f"{c.co_filename}:{line} in {c.co_name}" for c, line in zip(codes, key[1::2])]
            self.new.append((sid, json.dumps(frames[::-1])))
        return sid

    def take_new(self) -> list[tuple[int, str]]:
        rows, self.new = self.new, []
        return rows
