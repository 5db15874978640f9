"""Suite-wide:
- tests marked `extended` (a further variant of something the default tiers already cover: more
  ranks, a second parameter mode, a second dtype) are skipped unless BITGUARD_EXTENDED=1, so that
  `make test` stays within its 15-minute budget; run them before a release (tests/README.md);
- on pytest-xdist's workers (`make test` runs `-n 2 --dist loadfile`: a test file's tests on one
  worker, so its module fixtures are made once) the longest folders come first, so that the last
  file a worker takes is a short one (xdist hands out files in the order it collects them, with
  `--no-loadscope-reorder`: by default it reorders them by their number of tests, which put the
  files of many short unit tests first and left a long stacks file for the end).
  `--dist loadgroup` would keep a folder with session fixtures on one worker, but it did not group
  here (pytest 9.2, xdist 3.8: tests marked with one `xdist_group` still went to both workers), so
  a session fixture (a server, a browser) is made once per worker;
- torch.compile's inductor caches (FX graphs, AOT autograd) go to a folder made fresh for the
  session and shared by its workers (TORCHINDUCTOR_CACHE_DIR, unless set): a compiled test run
  compiles from scratch once, and never reads a cache an earlier session left in /tmp;
- on a clean clone, Numba's kernels are compiled into their on-disk caches once, before the
  workers start (tests/precompile.py): each process the suite starts at once compiled them itself
  until one had written them, 12 s of CPU each;
- once the tests are collected, what the process holds then (torch, polars, the test modules, and
  what a first recording imports: FROZEN_IMPORTS) is moved out of the cyclic garbage collector's
  reach (`gc.freeze()`): the end of every recording made in the test's process runs a full
  collection (collectors/weights.py `_finals`), which walked those few hundred thousand objects each
  time (0.3 s a recording here; 0.18 s while the recorder's own imports were left out of the freeze,
  0.001 s with them); what a test makes afterwards is collected as before."""

import gc
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# folders by the time their tests took in CI, longest first; the rest (short files) fill in last
FIRST = ("scenarios", "stacks", "record", "drill", "fuzz", "unit/collectors", "browser", "invariants",
         "unit/online", "unit/backend")


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import precompile  # (tests/ is on the path: pytest's rootdir conftest)

    if precompile.cold():  # (a clean clone: Numba's kernels compiled once, not in each process the suite starts)
        subprocess.run([sys.executable, str(TESTS / "precompile.py")], check=False, cwd=str(TESTS.parent))
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return  # a worker inherits the controller's folder; a folder the caller set is theirs
    config._bitguard_inductor_cache = tempfile.mkdtemp(prefix="bitguard-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = config._bitguard_inductor_cache


def pytest_unconfigure(config):
    folder = getattr(config, "_bitguard_inductor_cache", None)
    if folder:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        shutil.rmtree(folder, ignore_errors=True)


# what a first recording and comparison import (the recorder, torch._dynamo and the sympy it brings, Numba's
# kernels): imported before the freeze below, or every recording's collection walks their 200,000 objects
FROZEN_IMPORTS = ("bitguard.recording", "bitguard.collectors.hooks", "bitguard.collectors.weights",
                  "bitguard.collectors.api_events", "bitguard.cuda.fingerprint", "bitguard.backend.compare",
                  "torch._dynamo")


def pytest_collection_finish(session):
    for name in FROZEN_IMPORTS:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()


def _rank(item) -> int:
    path = Path(str(item.fspath)).resolve()
    rel = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else ""
    return next((i for i, folder in enumerate(FIRST) if rel.startswith(folder + "/")), len(FIRST))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_rank)  # stable: the order inside a file is the collection's
    if os.environ.get("BITGUARD_EXTENDED", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="extended variant: BITGUARD_EXTENDED=1 runs it")
    for item in items:
        if item.get_closest_marker("extended") is not None:
            item.add_marker(skip)
