"""GET and POST /api/runs/{run_id}/violations on a live server: the violations a run recorded with
--check (bitguard.violations/1), an offline check against an invariants document in the body
(bitguard.invariant-check/1), and bad input in the one error shape."""

import json

from api.conftest import assert_error, upload
from bitguard.backend.invariants.infer import infer
from invariant_loops import Loop, write_run


def violation(step, rank=0, iid="EventContain/zero_grad_before_backward"):
    return {"step": step, "rank": rank, "invariant_id": iid, "template": iid.split("/")[0],
            "message": "each training step calls zero_grad before its first backward", "t_ns": step,
            "evidence": json.dumps({"first_backward_ord": 3, "zero_grad_ords": []})}


def test_recorded_violations_in_step_order_with_counts(client, tmp_path):
    run = write_run(tmp_path, Loop(bugs={"no_zero_grad"}), name="checked-api",
                    violations=[violation(2), violation(1)], meta={"check": {"invariants": 40}})
    doc = client.get(f"/api/runs/{upload(client, str(run))['id']}/violations").json()
    assert doc["schema"] == "bitguard.violations/1" and [v["step"] for v in doc["violations"]] == [1, 2]
    assert doc["violations"][0]["evidence"] == {"first_backward_ord": 3, "zero_grad_ords": []}
    assert doc["by_invariant"] == [{"id": "EventContain/zero_grad_before_backward", "template": "EventContain",
                                    "count": 2, "first_step": 1, "ranks": [0]}]
    assert doc["checked_ranks"] == [0] and doc["notes"] == []


def test_a_run_not_recorded_with_check_says_so(client, tmp_path):
    run = write_run(tmp_path, Loop(), name="unchecked-api")
    doc = client.get(f"/api/runs/{upload(client, str(run))['id']}/violations").json()
    assert doc["violations"] == [] and "does not say it was recorded with --check" in doc["notes"][0]


def test_an_offline_check_against_an_invariants_document(client, tmp_path):
    invariants = infer({"a": Loop(seed="a").run(), "b": Loop(seed="b").run()})
    run_id = upload(client, str(write_run(tmp_path, Loop(seed="c", bugs={"dropout_eval"}), name="dropout-api")))["id"]
    r = client.post(f"/api/runs/{run_id}/violations", json=invariants)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["schema"] == "bitguard.invariant-check/1" and doc["verdict"] == "violated"
    assert {v["invariant_id"] for v in doc["violations"]} == {"Mode/all_training"}  # per-name: another configuration
    assert_error(client.post(f"/api/runs/{run_id}/violations", json={"schema": "bitguard.compare/1"}), 400,
                 "BadInput", "not a bitguard.invariants/1 document")
    old = upload(client, str(write_run(tmp_path, Loop(seed="d"), name="old-api", api_events=False)))["id"]
    assert_error(client.post(f"/api/runs/{old}/violations", json=invariants), 400, "BadInput", "no API events recorded")
    assert_error(client.get("/api/runs/nope/violations"), 404, "NotFound")
