"""Every test here is of the `stacks` tier, and records in subprocesses (so also `slow`: the fast
tier's command leaves it out). Variants marked `extended` (more ranks, a second parameter mode of
a stack already covered) are skipped unless BITGUARD_EXTENDED=1: they keep `make test` within its
time budget and run before a release (tests/README.md)."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    extended = os.environ.get("BITGUARD_EXTENDED", "") not in ("", "0")
    skip = pytest.mark.skip(reason="extended variant: BITGUARD_EXTENDED=1 runs it")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.stacks)
            item.add_marker(pytest.mark.slow)
            if not extended and item.get_closest_marker("extended") is not None:
                item.add_marker(skip)
