"""Fixtures for the explorer's API tests: scenario runs on disk and a live server over them."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

import fixtures_runs as runs
from api.live_server import start_server

os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")  # the live server is on loopback, never via a proxy


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (reference dir, suspect dir) for every scenario in fixtures_runs."""
    root = str(tmp_path_factory.mktemp("scenarios"))
    return {f.__name__: f(root) for f in (runs.benign_probe_then_real, runs.identical, runs.gap_then_divergence)}


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One server for the session, with small upload limits so the limit checks are cheap."""
    ws = str(tmp_path_factory.mktemp("api") / "workspace")
    srv = start_server(ws, {"max_file_bytes": 4 << 20, "max_run_bytes": 6 << 20, "max_files": 50,
                            "raw_event_limit": 30})
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def run_files(run_dir: str, prefix: str | None = None) -> list[tuple]:
    """Multipart parts for a run folder, named by relative path as the browser's picker does."""
    base = Path(run_dir)
    prefix = base.name if prefix is None else prefix
    parts = []
    for path in sorted(base.rglob("*")):
        if path.is_file():
            rel = path.relative_to(base).as_posix()
            parts.append(("files", (f"{prefix}/{rel}" if prefix else rel, path.read_bytes(),
                                    "application/octet-stream")))
    return parts


def upload(client: httpx.Client, run_dir: str, name: str | None = None) -> dict:
    r = client.post("/api/runs", files=run_files(run_dir), params={"name": name} if name else None)
    assert r.status_code == 201, r.text
    return r.json()


def wait_ready(client: httpx.Client, cid: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        c = client.get(f"/api/comparisons/{cid}").json()
        if c["status"] in ("ready", "failed"):
            return c
        assert time.monotonic() < deadline, f"comparison {cid} still {c['status']} after {timeout}s"
        time.sleep(0.05)


def compare(client: httpx.Client, pair: tuple[str, str], rule_set_id: str | None = None) -> dict:
    """Upload both sides of a scenario, compare them and wait for the result."""
    a, b = upload(client, pair[0]), upload(client, pair[1])
    r = client.post("/api/comparisons", json={"run_a": a["id"], "run_b": b["id"], "rule_set_id": rule_set_id})
    assert r.status_code == 202, r.text
    c = wait_ready(client, r.json()["id"])
    assert c["status"] == "ready", c
    return c


def assert_error(response: httpx.Response, status: int, type_: str, *words: str) -> str:
    """The one error shape: {"error": {"type", "message"}} with the class's status."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == type_, body
    message = body["error"]["message"]
    for w in words:
        assert w in message, (w, message)
    return message

