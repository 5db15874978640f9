"""Every failure reaches the browser in one shape: {"error": {"type", "message"}} with its status."""

from __future__ import annotations

import inspect

import pytest

import bitguard.errors as errors
from api.conftest import assert_error
from bitguard.backend.server import create_app


def test_every_bitguard_error_class_gets_its_status_and_its_name(tmp_path):
    from fastapi.testclient import TestClient

    app = create_app(str(tmp_path / "ws"))
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.BitguardError)]
    names = {c.__name__ for c in classes}
    assert {"NotARun", "CorruptRun", "SchemaMismatch", "RulesError", "NotFound", "BadInput"} <= names
    for cls in classes:
        @app.get(f"/raise/{cls.__name__}")
        def _raise(cls=cls):
            raise cls(f"{cls.__name__} happened; do the thing")
    with TestClient(app) as client:
        for cls in classes:
            r = client.get(f"/raise/{cls.__name__}")
            assert_error(r, cls.http_status, cls.__name__, "happened; do the thing")


def test_unknown_routes_and_ids(client):
    assert_error(client.get("/api/nope"), 404, "NotFound", "/api/nope")
    assert_error(client.get("/api/runs/r-missing"), 404, "NotFound", "r-missing")
    assert_error(client.get("/api/rulesets/rs-missing"), 404, "NotFound")
    assert_error(client.get("/api/comparisons/c-missing"), 404, "NotFound")
    assert_error(client.get("/api/comparisons/c-missing/timeline"), 404, "NotFound")


def test_malformed_requests(client):
    assert_error(client.post("/api/comparisons", json={"run_a": 3}), 400, "BadInput", "run_b")
    assert_error(client.post("/api/runs", content=b"{}", headers={"content-type": "application/json"}),
                 400, "BadInput", "multipart")
    multipart = {"content-type": "multipart/form-data; boundary=q"}
    assert_error(client.post("/api/runs", content=b"garbage", headers=multipart),
                 400, "BadInput")
    assert_error(client.delete("/api/health"), 405, "BadInput")


@pytest.mark.parametrize("path", ["/api/runs", "/api/rulesets", "/api/comparisons"])
def test_lists_are_json_arrays(client, path):
    r = client.get(path)
    assert r.status_code == 200 and isinstance(r.json(), list)


def test_openapi_documents_every_route(client):
    doc = client.get("/openapi.json").json()
    want = {
        ("post", "/api/runs"), ("get", "/api/runs"), ("delete", "/api/runs/{run_id}"),
        ("post", "/api/comparisons"), ("get", "/api/comparisons/{cid}"), ("get", "/api/comparisons/{cid}/pivot"),
        ("get", "/api/comparisons/{cid}/events"), ("get", "/api/comparisons/{cid}/events/{rank}/{side}/{seq}"),
        ("get", "/api/comparisons/{cid}/graph/nodes/{node_id}"), ("get", "/api/comparisons/{cid}/timeline"),
        ("post", "/api/comparisons/{cid}/rerun"), ("get", "/api/comparisons/{cid}/perfetto"),
        ("post", "/api/comparisons/{cid}/drill"), ("get", "/api/comparisons/{cid}/drill"),
        ("post", "/api/rulesets"), ("put", "/api/rulesets/{rule_set_id}"), ("delete", "/api/rulesets/{rule_set_id}"),
        ("post", "/api/rulesets/import"), ("get", "/api/rulesets/{rule_set_id}/export"),
        ("post", "/api/rulesets/{rule_set_id}/copy"),
        ("get", "/api/comparisons/{cid}/divergences"), ("get", "/api/comparisons/{cid}/loss"),
        ("get", "/api/comparisons/{cid}/search"),
        ("get", "/api/runs/{run_id}/violations"), ("post", "/api/runs/{run_id}/violations"),
    }
    have = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert want <= have, want - have
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op.get("description") or op.get("summary"), f"{method.upper()} {path} is undocumented"
    upload = doc["paths"]["/api/runs"]["post"]
    assert "multipart/form-data" in upload["requestBody"]["content"]


def test_an_unexpected_exception_is_an_internal_error_without_server_paths(tmp_path):
    """The catch-all stays for bugs: 500 "internal error" in the one shape, naming no server folder."""
    from fastapi.testclient import TestClient

    app = create_app(str(tmp_path / "ws"))
    root = app.state.workspace.root

    @app.get("/raise/bug")
    def _bug():
        raise RuntimeError(f"{root}/runs/r1/rank-0.duckdb went away")

    with TestClient(app, raise_server_exceptions=False) as client:
        message = assert_error(client.get("/raise/bug"), 500, "InternalError", "internal error", "RuntimeError",
                               "rank-0.duckdb went away")
    assert str(root) not in message and str(tmp_path) not in message


def test_errors_name_stored_runs_by_their_names(tmp_path, scenarios):
    """A BitguardError whose message holds a stored run's folder shows the run's name instead."""
    from fastapi.testclient import TestClient

    app = create_app(str(tmp_path / "ws"))
    ws = app.state.workspace
    run = ws.import_run(scenarios["identical"][0], name="my reference")

    @app.get("/raise/corrupt")
    def _corrupt():
        raise errors.CorruptRun(f"{ws.root}/runs/{run['id']}/rank-0.duckdb is truncated; re-record it")

    with TestClient(app) as client:
        message = assert_error(client.get("/raise/corrupt"), 400, "CorruptRun", "my reference/rank-0.duckdb")
    assert str(ws.root) not in message
