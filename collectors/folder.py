"""The fold process: a rank's journal folded into its DuckDB file by another process.

A fold (store.py) decodes journal groups and inserts them into DuckDB: tens of milliseconds every
few seconds, DuckDB's native code and its buffers (about 1.4 times the fold's journal). Done on the
writer thread, all of that was the training's process: its memory, and any fatal error of DuckDB's
(docs/PERFORMANCE.md, "The fold process", measures what moving it does and does not change). So
once a recording has lived long enough to fold, the writer hands the rank file to a
fresh Python (`main()` below, at a lower priority: DuckDB and pyarrow, never torch),
which owns the DuckDB connection from then on while the writer only appends to the journal.

The protocol is one JSON line each way on the process's stdin and stdout, one request at a time:

    writer -> folder   {"limit": BYTES, "folded": GROUP, "written": GROUP}
    folder -> writer   {"groups": N, "last": GROUP, "damage": {...} | null, "keep_as": NAME | null}
                       or {"error": "..."}

`limit` ends a group the writer appended before it asked (whole groups only, at most
store.FOLD_CHUNK bytes but at least one group): the writer is the journal's one writer, and it
goes on appending while the folder folds. The folder folds those bytes exactly as
`store.fold_journal` does in process (one verified transaction that also records the last group
folded); the writer then drops the folded bytes from the journal itself (store.py). A folder that
meets the end of its stdin (the writer asked it to stop, or the training died) finishes the fold in
hand, closes the rank file and exits; it ignores SIGINT, so a Ctrl-C in the terminal reaches the
training and not a fold half done. When the folder cannot start or dies, the writer takes the rank
file back and folds in its own process, as before: nothing is lost either way, since a fold's
transaction is all or nothing and the journal keeps every group until a fold is verified.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

from bitguard import db


class FolderGone(RuntimeError):
    """The fold process exited or its pipe broke."""


# The fold process's first lines: a lower priority before its imports (half a second of CPU beside the
# training's threads), then serve(); -P: a folder named `bitguard` in the training's working directory
# is not imported.
_START = ("import os\ntry:\n    os.nice(5)\nexcept (AttributeError, OSError):\n    pass\n"
          "from bitguard.collectors.folder import main\nmain()\n")


class FoldProcess:
    """The writer's side: start the folder, send a request, poll for its reply, stop it. The pipes
    are unbuffered (a request is one write, well under PIPE_BUF), and a forked child of the
    training closes its copies at once: it must neither hold the folder's stdin open (the folder
    would not see the training end) nor ever write into it."""

    def __init__(self, rank_path: str | os.PathLike, memory_limit: str | None = None):
        self.busy = False  # a request is out and its reply not yet read
        self._got = b""
        self._proc = subprocess.Popen(
            [sys.executable, "-P", "-c", _START, os.fspath(rank_path), *([memory_limit] if memory_limit else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, bufsize=0)
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def request(self, limit: int, folded: int, written: int) -> None:
        """Ask for the journal's first `limit` bytes to be folded (FolderGone when it cannot be asked)."""
        line = json.dumps({"limit": limit, "folded": folded, "written": written}).encode() + b"\n"
        try:
            os.write(self._proc.stdin.fileno(), line)
        except (OSError, ValueError) as exc:
            raise FolderGone(f"the fold process (pid {self.pid}) is gone: {exc}") from None
        self.busy = True

    def poll(self, timeout: float = 0.0) -> dict | None:
        """The reply to the request out, when it has come within `timeout` seconds (None: not yet, or
        no request out). FolderGone when the process ended without replying."""
        if not self.busy:
            return None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._got:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.busy = False
                raise FolderGone(f"the fold process (pid {self.pid}) exited ({self._proc.wait()}) without replying")
            self._got += chunk
        line, _, self._got = self._got.partition(b"\n")
        self.busy = False
        return json.loads(line)

    def stop(self, timeout: float = 30.0) -> dict | None:
        """Let the fold in hand finish (its reply, if one was out) and the process exit, within
        `timeout` seconds in all; killed then (its fold's transaction is all or nothing: the journal
        still holds what it did not commit). FolderGone when a reply was due and did not come."""
        reply, deadline = None, time.monotonic() + timeout
        try:
            if self.busy:
                reply = self.poll(timeout)
                if reply is None:
                    raise FolderGone(f"the fold process (pid {self.pid}) did not reply within {timeout:.0f} s; "
                                     f"it was stopped")
        finally:
            _LIVE.discard(self)
            self._proc.stdin.close()
            try:
                self._proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc.stdout.close()
        return reply

    def _forget(self) -> None:
        """In a forked child of the training: close this process's copies of the pipes."""
        self._proc.stdin.close()
        self._proc.stdout.close()


_LIVE: weakref.WeakSet = weakref.WeakSet()  # the fold processes this process started and has not stopped


def _in_child() -> None:
    for folder in list(_LIVE):
        try:
            folder._forget()
        except OSError:
            pass
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)


def serve(rank_path: Path, requests, replies, memory_limit: str | None = None) -> None:
    """Fold the requests read from `requests` (lines) into `rank_path`, one reply line each
    (`memory_limit`: the dump mode's buffer pool, store.py)."""
    from bitguard.collectors.store import fold_journal, journal_path, rank_db_config

    journal = journal_path(rank_path)
    con = db.connect(rank_path, config=rank_db_config(memory_limit))
    try:
        for line in requests:
            ask = json.loads(line)
            try:
                fold = fold_journal(con, journal, ask["folded"], ask["written"], limit=ask["limit"])
                reply = {"groups": fold.groups, "last": fold.last, "damage": fold.damage, "keep_as": fold.keep_as}
            except Exception as exc:  # noqa: BLE001 - the writer decides what a failed fold means
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            try:
                replies.write(json.dumps(reply, default=str).encode() + b"\n")
                replies.flush()
            except BrokenPipeError:  # the training is gone: what is folded is on record (journal_folded)
                return
    finally:
        con.close()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(Path(sys.argv[1]), sys.stdin.buffer, sys.stdout.buffer, sys.argv[2] if len(sys.argv) > 2 else None)


if __name__ == "__main__":
    main()
