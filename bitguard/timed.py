"""Which numbers of a saved object or a JSON file name a time, and are not compared: under a key
naming a duration or a rate of work (`train_runtime`, `samples_per_second`, `step_time_s`), all;
under a point in time (`saved_at`, `timestamp_start`), a timestamp (`decay_at: 200` is a step);
under `times`, a float (`repeat_times: 3` is a count); under any key, a `time.time()` or
`time.time_ns()` by its value. The last word of a key says so (`time_embedding_dim` is a size). Used by collectors/saved.py and collectors/beside.py, and by the comparison of a run recorded
before this rule (schema 10; backend/certification.py, `timed_before_10`). Torch-free: the backend
reads it too."""

from __future__ import annotations

import re

# The words of a key that name a time or a rate of work (`clock_of`); a key is split into its words at every
# character that is not a letter.
_TIME_WORDS = frozenset({"time", "times", "timer", "timestamp", "timestamps", "elapsed", "duration", "durations",
                         "dur", "durs", "runtime", "date", "datetime", "clock", "wall", "walltime", "seconds", "secs",
                         "sec", "ms", "throughput", "speed", "now", "at", "tflops", "mfu", "eta", "latency", "pid",
                         "ppid", "fps"})
_INSTANT_WORDS = frozenset({"at", "now", "date", "datetime", "clock", "wall", "timestamp", "timestamps"})
_COUNT_WORDS = frozenset({"times"})  # `repeat_times: 3` is a count, `step_times: [0.12, 0.15]` durations
_TIME_ENDS = frozenset({"s", "us", "ns", "min", "mins", "minutes", "h", "hours", "start", "end", "started", "ended",
                        "total", "avg", "mean", "utc", "taken", "spent"})  # after a time word: `step_time_s`,
# `timestamp_start`, `time_taken`
_LAST_KEY = re.compile(r"(?:\[['\"]([^'\"]*)['\"]\]|\.(\w+))$")
_KEYS = re.compile(r"\[['\"]([^'\"]*)['\"]\]|\.(\w+)")


def _last_words(path: str) -> list[str]:
    """The words of the last key of `path` (`['train_runtime']`: train, runtime)."""
    found = _LAST_KEY.search(path)
    if found is None:
        return []
    return [w for w in re.split(r"[^a-z]+", (found.group(1) or found.group(2) or "").lower()) if w]


def _per_second(words: list[str], units=("second", "s", "sec")) -> bool:
    return any(a == "per" and b in units for a, b in zip(words, words[1:]))


def clock_of(path: str) -> str | None:
    """What the last key of `path` names: a time or a rate of work, "duration" (`['train_runtime']`,
    `['samples_per_second']`, `['step_time_s']`: no number under it is compared), a point in time,
    "instant" (`.saved_at`, `['timestamp_start']`) or "count" (`['repeat_times']`): `compared` tells;
    or None.
    Its last word says so (a time word, or a unit or an end after one): `time_embedding_dim` is a
    size, not a time."""
    words = _last_words(path)
    if not words:
        return None
    if _per_second(words):
        return "duration"
    last = words[-1]
    if last not in _TIME_WORDS:
        earlier = _TIME_WORDS.intersection(words[:-1])
        if last not in _TIME_ENDS or not earlier:
            return None
        return "instant" if earlier <= _INSTANT_WORDS else "duration"
    return "instant" if last in _INSTANT_WORDS else "count" if last in _COUNT_WORDS else "duration"


def clock_below(path: str, clock: str | None) -> str | None:
    """What `clock_of` says for an item at `path` inside a value under `clock`: a named item (a dict's
    key, an attribute) by its own name (`{"runtime": {"seed": 0}}`: the seed is compared); an item of
    a list or of what pickle writes of an object, by its container's (`"step_times": [0.1, 0.2]`); an
    attribute whose name names no time, of an object kept under a duration, by that duration (helper
    59: mmengine's MessageHub saves each logged scalar as a HistoryBuffer, its `_log_history` the
    values: under `train/time`, wall-clock durations; a key of what its `__getstate__` gives is an attribute)."""
    last = _LAST_KEY.search(path)
    if last is None:
        return clock
    own = clock_of(path)
    attribute = last.group(2) is not None or path[:last.start()].endswith(".__getstate__()")  # (its state's keys)
    return clock if own is None and attribute and clock == "duration" else own


# A timestamp, whatever its key: a float of seconds or milliseconds since 1970 between 2017 and 2039
# (`time.time()`), an int of nanoseconds (`time.time_ns()`); other ints in those ranges are counts.
_STAMPS = (1.5e9, 2.2e9)


def compared(clock: str | None, value) -> bool:
    """Whether a number under a key of that `clock_of` is compared: under none, yes, but a timestamp
    (below); under a duration, no; under a point in time, what is no timestamp (`decay_at: 100` is a
    step, `clip_at: 0.5` a fraction; `saved_at: 1733400000.5`, or an int of seconds, is a time); under
    `times`, an int (a count, not a float of seconds)."""
    if isinstance(value, bool):
        return clock != "duration"
    low, high = _STAMPS
    scales = (1e9,) if isinstance(value, int) else (1, 1e3)
    if any(low * scale <= value < high * scale for scale in scales):
        return False  # (a time.time() or time_ns(), whatever its key: `t`, `ts`, `start`)
    if clock is None:
        return True
    seconds = isinstance(value, int) and not -10**9 < value < 10**9  # (an int of seconds since 1970, or more)
    if clock == "instant":
        return not seconds
    return clock == "count" and isinstance(value, int) and not seconds


def clock_at(path: str) -> str | None:
    """The `clock_of` a value at `path` (a row's path, its mark taken off) was taken under: its last
    named key's (an item of a list under it, that key's; an attribute naming no time under a duration,
    that duration's: `clock_below`)."""
    clock = None
    for key in _KEYS.finditer(path):
        clock = clock_below(path[:key.end()], clock)
    return clock


def timed_before_10(path: str) -> bool:
    """Whether a number at `path` was left out by runs recorded before schema 10: under a key (the
    last or one above) any word of which is a time word (`time_embedding_dim`, `decay_at` too)."""
    for key in _KEYS.finditer(path):
        words = re.split(r"[^a-z]+", (key.group(1) or key.group(2) or "").lower())
        if _TIME_WORDS.intersection(words) or _per_second(words, ("second", "s")):
            return True
    return False
