"""The traceback of a recorded script's own failure, as python prints it, without bitguard's frames.

The recorder wraps every module call (collectors/hooks.py `_call_impl`): an error raised in a
model's forward passed through two of its frames per module on the way out, and a user reading
`collectors/hooks.py` in their traceback took bitguard for the cause. Those frames are left out and
counted in a last line (`BITGUARD_TRACEBACK=full` shows them), unless the error was raised in
bitguard's own code: then every frame stays, for the report. An error leaving a `with
bitguard.record()` block, which Python prints itself, has those frames taken out of its traceback
(`trim`) and the count added as a note. A read's call made as a line of the reader's code
(collectors/reads.py, `READ_CALL`) is bitguard's frame too, and what it raises is torch's.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from types import TracebackType

# where bitguard's packages live (the install maps bitguard, collectors, cuda and backend apart)
_OURS = tuple(str(Path(p).resolve()) + os.sep for p in {
    Path(__file__).parent, Path(__file__).parent.parent / "collectors", Path(__file__).parent.parent / "cuda",
    Path(__file__).parent.parent / "backend"})


# the name of the call collectors/reads.py makes as a line of the reader's code (its file and line)
READ_CALL = "<bitguard: the read>"


def _ours(filename: str, name: str = "") -> bool:
    if name == READ_CALL:
        return True
    try:
        return str(Path(filename).resolve()).startswith(_OURS)
    except (OSError, ValueError):
        return False


def _raised_in_ours(filename: str, name: str) -> bool:
    """Whether a traceback's last frame is bitguard's raising, not one passing a call through (a read's
    call raising is torch's error)."""
    return name != READ_CALL and _ours(filename)


def _kept(frames: list, place) -> list:
    """`frames` (innermost last) without bitguard's, or all of them when bitguard's code raised;
    `place(frame)`: its file name and function name."""
    if not frames or _raised_in_ours(*place(frames[-1])):
        return frames
    return [f for f in frames if not _ours(*place(f))]


def _trimmed(te: traceback.TracebackException, seen: set[int]) -> int:
    """Leave bitguard's frames out of `te` and the exceptions chained to it; how many were left out."""
    if id(te) in seen:
        return 0
    seen.add(id(te))
    frames = list(te.stack)
    kept = _kept(frames, lambda f: (f.filename, f.name))
    left = len(frames) - len(kept)
    if left:
        te.stack = traceback.StackSummary.from_list(kept)
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            left += _trimmed(chained, seen)
    for group in getattr(te, "exceptions", None) or ():
        left += _trimmed(group, seen)
    return left


def print_failure(exc: BaseException, tb: TracebackType | None, file=None) -> None:
    """Print `exc` from traceback `tb` on stderr as python would, without bitguard's frames."""
    file = file or sys.stderr
    te = traceback.TracebackException(type(exc), exc, tb)
    left = 0 if os.environ.get("BITGUARD_TRACEBACK") == "full" else _trimmed(te, set())
    for line in te.format():
        print(line, end="", file=file)
    if left:
        print(f"({left} frames of bitguard's recorder left out: it passes module calls through and did not raise "
              f"this; BITGUARD_TRACEBACK=full shows them)", file=file)


def trim(exc: BaseException) -> None:
    """Take bitguard's frames out of the traceback of `exc` leaving a `with bitguard.record()` block
    (Python prints it, or the code around the block catches it), with a note saying how many: as
    `print_failure` does, only for an error raised outside bitguard's code."""
    if os.environ.get("BITGUARD_TRACEBACK") == "full" or not isinstance(exc, Exception):
        return
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    kept = _kept(frames, lambda t: (t.tb_frame.f_code.co_filename, t.tb_frame.f_code.co_name))
    left = len(frames) - len(kept)
    if not left:
        return
    try:
        for outer, inner in zip(kept, kept[1:] + [None]):
            outer.tb_next = inner
        exc.__traceback__ = kept[0]
        exc.add_note(f"({left} frames of bitguard's recorder left out of this traceback: it passes module calls "
                     f"through and did not raise this; BITGUARD_TRACEBACK=full keeps them)")
    except (AttributeError, TypeError, ValueError):  # an exception that refuses notes or a traceback: left as it is
        pass
