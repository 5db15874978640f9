"""Suite-wide:
- tests marked `extended` (a further variant of something the default tiers already cover: more
  ranks, a second parameter mode, a second dtype) are skipped unless BITGUARD_EXTENDED=1, so that
  `make test` stays within its 15-minute budget; run them before a release (tests/README.md);
- on pytest-xdist's workers (`make test` runs `-n 2 --dist loadgroup`) a test file's tests stay
  on one worker, so that its module fixtures are made once, and a folder whose conftest makes
  session fixtures (a server, a browser, the scenario recordings) stays on one worker whole."""

import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
WHOLE_FOLDERS = {"api", "browser", "fuzz", "scenarios", "unit/backend"}  # their conftests' session fixtures
# the longest groups first, so that the last group a worker takes is a short one (xdist hands out
# groups in the order it first meets them)
FIRST = ("scenarios", "stacks", "record", "drill", "fuzz", "browser", "invariants")


def _rel(item) -> Path | None:
    path = Path(str(item.fspath)).resolve()
    return path.relative_to(TESTS) if path.is_relative_to(TESTS) else None


def _rank(item) -> int:
    rel = _rel(item)
    top = rel.parts[0] if rel is not None else ""
    return FIRST.index(top) if top in FIRST else len(FIRST)


def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist") and getattr(config.option, "dist", "no") == "loadgroup":
        items.sort(key=_rank)  # stable: the order inside a group is the collection's
        for item in items:
            rel = _rel(item)
            if rel is None:
                continue
            folder = rel.parent.as_posix()
            item.add_marker(pytest.mark.xdist_group(folder if folder in WHOLE_FOLDERS else rel.as_posix()))
    if os.environ.get("BITGUARD_EXTENDED", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="extended variant: BITGUARD_EXTENDED=1 runs it")
    for item in items:
        if item.get_closest_marker("extended") is not None:
            item.add_marker(skip)
