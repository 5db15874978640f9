"""The panels' routes on a live server: the divergences table, the loss curve, and a rerun that
reopens an earlier version of the comparison's rule set."""

from __future__ import annotations

from api.conftest import assert_error, compare, wait_ready

PROBE_RULE = {"id": "probe-benign", "action": "ignore", "match": {"boundary": "model.probe"}}


def test_divergences_and_loss_routes(client, scenarios):
    c = compare(client, scenarios["gap_then_divergence"])
    path = f"/api/comparisons/{c['id']}"
    page = client.get(f"{path}/divergences", params={"rank": 1, "phase": "forward", "limit": 2}).json()
    assert page["schema"] == "bitguard.divergences/1" and page["limit"] == 2 and len(page["rows"]) == 2
    assert page["total"] > 2 and all(r["rank"] == 1 and r["phase"] == "forward" for r in page["rows"])
    first = page["rows"][0]
    detail = client.get(f"{path}/events/{first['rank']}/{first['side']}/{first['seq']}").json()
    assert detail["event"]["boundary"] == first["boundary"] and detail["pos"] == first["first_pos"]
    assert_error(client.get(f"{path}/divergences", params={"status": "fine"}), 400, "BadInput", "fine")
    loss = client.get(f"{path}/loss").json()
    assert loss["schema"] == "bitguard.loss_curve/1" and loss["rank"] == c["summary"]["first_divergence"]["rank"]
    assert loss["unknown"].startswith("no scalar loss recorded")
    assert_error(client.get(f"{path}/loss", params={"rank": 7}), 404, "NotFound", "rank 7")


def test_a_rerun_reopens_an_earlier_rule_set_version(client, scenarios):
    rs = client.post("/api/rulesets", json={"name": "panels: probe benign", "rules": [PROBE_RULE]}).json()
    c = compare(client, scenarios["benign_probe_then_real"], rule_set_id=rs["id"])
    assert c["summary"]["first_divergence"]["boundary"] == "model.layers.2"
    client.put(f"/api/rulesets/{rs['id']}", json={"rules": []})  # v2 reruns c: the probe is the pivot again
    c2 = wait_ready(client, c["id"])
    assert c2["rule_set"]["version"] == 2 and c2["summary"]["first_divergence"]["boundary"] == "model.probe"
    r = client.post(f"/api/comparisons/{c['id']}/rerun", json={"rule_set_version": 1})
    assert r.status_code == 202, r.text
    c3 = wait_ready(client, c["id"])
    assert c3["rule_set"] == {"id": rs["id"], "name": "panels: probe benign", "version": 1, "latest_version": 2}
    assert c3["summary"]["first_divergence"]["boundary"] == "model.layers.2"
    assert_error(client.post(f"/api/comparisons/{c['id']}/rerun", json={"rule_set_version": 9}), 404, "NotFound",
                 "no version 9")
    bare = compare(client, scenarios["identical"])
    assert_error(client.post(f"/api/comparisons/{bare['id']}/rerun", json={"rule_set_version": 1}), 400, "BadInput",
                 "needs a rule set")
