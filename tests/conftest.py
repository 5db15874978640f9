"""Suite-wide: tests marked `extended` (a further variant of something the default tiers already
cover: more ranks, a second parameter mode, a second dtype) are skipped unless BITGUARD_EXTENDED=1,
so that `make test` stays within its 15-minute budget; run them before a release
(tests/README.md)."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("BITGUARD_EXTENDED", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="extended variant: BITGUARD_EXTENDED=1 runs it")
    for item in items:
        if item.get_closest_marker("extended") is not None:
            item.add_marker(skip)
