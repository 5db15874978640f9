"""Playwright against Debian's Chromium (never a downloaded browser) and a live explorer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import fixtures_runs as runs
from api.live_server import start_server

CHROMIUM = os.environ.get("BITGUARD_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def pytest_collection_modifyitems(items):
    if not os.path.exists(CHROMIUM):
        skip = pytest.mark.skip(reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)")
        for item in items:
            if "browser" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    """pytest-playwright's launch options, pointed at the system Chromium."""
    return {**browser_type_launch_args, "executable_path": CHROMIUM, "args": CHROMIUM_ARGS, "headless": True}


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1480, "height": 1000}, "accept_downloads": True}


@pytest.fixture(scope="session")
def explorer(tmp_path_factory):
    ws = str(tmp_path_factory.mktemp("browser") / "workspace")
    srv = start_server(ws)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def scenario_dirs(tmp_path_factory) -> dict[str, tuple[str, str]]:
    root = str(tmp_path_factory.mktemp("browser-scenarios"))
    return {"probe": runs.benign_probe_then_real(root), "gap": runs.gap_then_divergence(root)}


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
