"""Every test here is of the `stacks` tier, and records in subprocesses (so also `slow`: the fast
tier's command leaves it out). Its `extended` variants are skipped by tests/conftest.py."""

import pytest


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.stacks)
            item.add_marker(pytest.mark.slow)
