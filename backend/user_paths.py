"""What the explorer's user is told about paths: the names they know, never the server's folders.

The engine names files by their full path ("/srv/ws/tmp/3f…/payload/ref/rank-0.duckdb is
truncated"). Behind the server those paths are staging folders and workspace folders the user
never saw. `PathNames` maps each such folder to the name the user knows (the uploaded folder's
name, a run's name, "the workspace") and rewrites messages, errors and JSON values through that
map. It is the one place where the server decides how a path reads; it knows nothing about
HTTP or about what the engine checks.
"""

from __future__ import annotations

import os
from pathlib import Path

from bitguard.errors import BitguardError


class PathNames:
    """Server folders and the names shown instead of them; the longest folder wins."""

    def __init__(self, names: dict[str | os.PathLike, str] | None = None):
        self._names: dict[str, str] = {}
        for folder, shown in (names or {}).items():
            self.add(folder, shown)

    def add(self, folder: str | os.PathLike, shown: str) -> "PathNames":
        """Show `shown` wherever `folder` (as given, resolved, or in POSIX form) appears."""
        for form in {str(folder), Path(folder).as_posix(), str(Path(folder).resolve())}:
            self._names[form.rstrip("/") or "/"] = shown
        return self

    def text(self, message: str) -> str:
        """`message` with every known folder replaced by its shown name."""
        for folder in sorted(self._names, key=len, reverse=True):
            if folder in message:
                message = message.replace(folder, self._names[folder])
        return message

    def error(self, exc: BitguardError) -> BitguardError:
        """The same error class with its message in the user's terms (the traceback is dropped)."""
        mapped = self.text(exc.message)
        return exc if mapped == exc.message else with_message(exc, mapped)

    def value(self, obj):
        """A JSON-able value with every string mapped (for summaries and run details)."""
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {k: self.value(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.value(v) for v in obj]
        return obj


def with_message(exc: BitguardError, message: str) -> BitguardError:
    """An error of the same class (so the same HTTP status and exit code) with another message."""
    out = type(exc).__new__(type(exc))
    BitguardError.__init__(out, message)
    return out
