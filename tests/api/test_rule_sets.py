"""Rule sets through the API: versions kept, names unique, rules files in and out, restarts survived."""

from __future__ import annotations

import json

import pytest

from api.conftest import assert_error
from api.live_server import start_server

PROBE = {"id": "probe-is-debug-only", "action": "ignore", "match": {"boundary": "model.probe", "phase": "forward"},
         "note": "debug probe, never consumed", "author": "ana", "created": "2026-11-29"}
GAP = {"id": "dropout-gap", "action": "allow-gap", "match": {"module_type": "Dropout"}}


def _full(rule: dict) -> dict:
    return {"note": "", "author": "", "created": "", "match": {}, **rule}


def test_create_edit_keeps_versions(client):
    r = client.post("/api/rulesets", json={"name": "versions demo", "rules": [PROBE]})
    assert r.status_code == 201, r.text
    rs = r.json()
    assert rs["version"] == 1 and rs["rules"] == [_full(PROBE)]
    assert rs["file"] == {"schema": "bitguard.rules/1", "rules": [_full(PROBE)]}
    rs2 = client.put(f"/api/rulesets/{rs['id']}", json={"rules": [PROBE, GAP]}).json()
    assert rs2["version"] == 2 and [r["id"] for r in rs2["rules"]] == ["probe-is-debug-only", "dropout-gap"]
    same = client.put(f"/api/rulesets/{rs['id']}", json={"rules": [PROBE, GAP]}).json()
    assert same["version"] == 2, "saving unchanged rules makes no new version"
    renamed = client.put(f"/api/rulesets/{rs['id']}", json={"name": "versions demo renamed"}).json()
    assert renamed["name"] == "versions demo renamed" and renamed["version"] == 2
    v1 = client.get(f"/api/rulesets/{rs['id']}", params={"version": 1}).json()
    assert v1["version"] == 1 and v1["latest_version"] == 2 and len(v1["rules"]) == 1
    assert [v["rules"] for v in v1["versions"]] == [1, 2]
    assert_error(client.get(f"/api/rulesets/{rs['id']}", params={"version": 7}), 404, "NotFound", "version 7")


def test_invalid_rules_name_the_rule_and_the_field(client):
    bad = {**PROBE, "match": {"phase": "sideways"}}
    assert_error(client.post("/api/rulesets", json={"name": "bad", "rules": [bad]}), 400, "RulesError",
                 "probe-is-debug-only", "match.phase")
    assert_error(client.post("/api/rulesets", json={"name": "dup", "rules": [PROBE, PROBE]}), 400, "RulesError",
                 "used twice")
    assert all(r["name"] not in ("bad", "dup") for r in client.get("/api/rulesets").json())


def test_names_are_unique_and_checked(client):
    client.post("/api/rulesets", json={"name": "unique one"})
    assert_error(client.post("/api/rulesets", json={"name": "unique one"}), 400, "BadInput", "exists already")
    assert_error(client.post("/api/rulesets", json={"name": "   "}), 400, "BadInput", "name")
    assert_error(client.post("/api/rulesets", json={"name": "x" * 200}), 400, "BadInput", "name")


def test_export_import_round_trip(client):
    rs = client.post("/api/rulesets", json={"name": "to export", "rules": [PROBE, GAP]}).json()
    r = client.get(f"/api/rulesets/{rs['id']}/export")
    assert r.status_code == 200
    assert 'filename="to-export.v1.rules.json"' in r.headers["content-disposition"]
    exported = r.json()
    assert exported == {"schema": "bitguard.rules/1", "rules": [_full(PROBE), _full(GAP)]}
    from bitguard.backend.rules import RuleSet

    assert RuleSet.from_dict(exported).to_dict() == exported, "the export is what compare --rules reads"
    raw = client.post("/api/rulesets/import", params={"name": "imported raw"}, content=json.dumps(exported),
                      headers={"content-type": "application/json"})
    assert raw.status_code == 201, raw.text
    assert raw.json()["file"] == exported
    multi = client.post("/api/rulesets/import", files={"file": ("team.rules.json", json.dumps(exported).encode())})
    assert multi.status_code == 201, multi.text
    assert multi.json()["name"] == "team" and multi.json()["file"] == exported
    assert_error(client.post("/api/rulesets/import", content=b"{nope", headers={"content-type": "application/json"}),
                 400, "BadInput", "not JSON")
    assert_error(client.post("/api/rulesets/import", json={"schema": "bitguard.rules/9", "rules": []}),
                 400, "RulesError", "bitguard.rules/9")


def test_copy_under_a_name_and_delete(client):
    rs = client.post("/api/rulesets", json={"name": "original", "rules": [PROBE]}).json()
    client.put(f"/api/rulesets/{rs['id']}", json={"rules": [PROBE, GAP]})
    copy = client.post(f"/api/rulesets/{rs['id']}/copy", json={"name": "copy of v1", "version": 1})
    assert copy.status_code == 201, copy.text
    assert copy.json()["version"] == 1 and len(copy.json()["rules"]) == 1 and copy.json()["id"] != rs["id"]
    assert client.delete(f"/api/rulesets/{rs['id']}").status_code == 204
    assert_error(client.get(f"/api/rulesets/{rs['id']}"), 404, "NotFound")
    assert client.get(f"/api/rulesets/{copy.json()['id']}").status_code == 200


@pytest.mark.timeout(60)
def test_rule_sets_survive_a_restart(tmp_path):
    import httpx

    ws = str(tmp_path / "workspace")
    first = start_server(ws)
    try:
        with httpx.Client(base_url=first.url) as c:
            rs = c.post("/api/rulesets", json={"name": "kept", "rules": [PROBE]}).json()
            c.put(f"/api/rulesets/{rs['id']}", json={"rules": [PROBE, GAP]})
    finally:
        first.stop()
    second = start_server(ws)
    try:
        with httpx.Client(base_url=second.url) as c:
            kept = c.get(f"/api/rulesets/{rs['id']}").json()
            assert kept["name"] == "kept" and kept["version"] == 2 and len(kept["versions"]) == 2
            assert [r["id"] for r in kept["rules"]] == ["probe-is-debug-only", "dropout-gap"]
    finally:
        second.stop()


@pytest.mark.parametrize("depth", [100, 100_000])
def test_a_deeply_nested_rules_import_is_refused(client, depth):
    nested = "[" * depth + "]" * depth
    body = '{"schema": "bitguard.rules/1", "rules": [{"id": "deep", "action": "ignore", "match": {"boundary": ' \
           + nested + "}}]}"
    for send in ({"content": body, "headers": {"content-type": "application/json"}},
                 {"files": {"file": ("deep.rules.json", body.encode())}}):
        assert_error(client.post("/api/rulesets/import", **send), 400, "BadInput", "nests deeper")
    for route, method in (("/api/rulesets", "post"),):
        r = getattr(client, method)(route, content='{"name": "deep", "rules": [' + nested + "]}",
                                    headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] in ("BadInput", "RulesError"), r.text
    assert all(rs["name"] != "deep" for rs in client.get("/api/rulesets").json())
