"""Hooks that never raise into the user's training: one idiom for every recorder part.

A class that mixes in `Guarded` has an `enabled` flag and a `_fail(where, exc)` that records the
failure; `guard(fn)` gives `fn` back as a hook that does nothing once disabled and turns any
exception into a `_fail`, returning None. (collectors/hooks.py keeps its own, which also stays out
of code dynamo traces.) Nothing here knows what is recorded.
"""

from __future__ import annotations

from functools import partial


class Guarded:
    __slots__ = ()

    def guard(self, fn):
        """`fn` as a hook that never raises into training: a failure is recorded, never raised."""
        return partial(self._guarded, fn)

    def _guarded(self, fn, *args, **kwargs):
        if not self.enabled:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail(self._where(fn), exc)
            return None

    def _where(self, fn) -> str:
        """How a failure of `fn` is named in the collector errors."""
        return getattr(fn, "__qualname__", getattr(fn, "__name__", "hook"))
