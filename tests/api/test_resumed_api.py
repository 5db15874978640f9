"""A resumed training compared in the explorer: `POST /api/comparisons` takes `resumed_at` (the CLI's
`--resumed-at`), keeps it on the comparison through reruns and restarts of the catalogue, and a
workspace made before the field opens with its comparisons step for step."""

from __future__ import annotations

import pytest

from api.conftest import assert_error, upload, wait_ready
from bitguard.backend.catalogue import Catalogue
from bitguard.db import connect
from compare.test_resumed import SAVE_AT, record_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return record_runs(tmp_path_factory.mktemp("resumed-api"))


def _create(client, a: dict, b: dict, **body):
    return client.post("/api/comparisons", json={"run_a": a["id"], "run_b": b["id"], **body})


def test_a_resumed_run_compares_identical_with_the_tail_it_resumed_and_keeps_the_step(client, runs):
    a, b = upload(client, str(runs / "a"), "uninterrupted"), upload(client, str(runs / "resumed"), "resumed")
    r = _create(client, a, b, resumed_at=SAVE_AT)
    assert r.status_code == 202, r.text
    c = wait_ready(client, r.json()["id"])
    assert (c["status"], c["verdict"], c["resumed_at"]) == ("ready", "identical", SAVE_AT), c.get("error") or c
    assert c["summary"]["analysis"]["resumed_at"] == SAVE_AT
    assert any(reason["code"] == "resumed" for reason in c["summary"]["certification"]["reasons"])
    # step for step (the field left out), the same pair parts at B's first parameters, and says which step to give
    plain = wait_ready(client, _create(client, a, b).json()["id"])
    assert (plain["verdict"], plain["resumed_at"]) == ("diverged", 0), plain
    assert "--resumed-at" in str(plain["summary"]["first_divergence"]), plain["summary"]["first_divergence"]
    listed = {x["id"]: x["resumed_at"] for x in client.get("/api/comparisons").json()}
    assert listed[c["id"]] == SAVE_AT and listed[plain["id"]] == 0
    rerun = client.post(f"/api/comparisons/{c['id']}/rerun", json={"rule_set_id": None, "keep_rule_set": False})
    assert rerun.status_code == 202, rerun.text
    again = wait_ready(client, c["id"])
    assert (again["revision"], again["verdict"], again["resumed_at"]) == (2, "identical", SAVE_AT), again


def test_a_resume_step_past_a_or_below_zero_is_refused_and_a_drill_is_not_supported_yet(client, runs):
    a, b = upload(client, str(runs / "a")), upload(client, str(runs / "resumed"))
    for bad in (-1, 2**40, 3.5, True, "3"):  # (a step too large for a rank file's INTEGER was a 500)
        assert_error(_create(client, a, b, resumed_at=bad), 400, "BadInput", "resumed_at")
    c = wait_ready(client, _create(client, a, b, resumed_at=99).json()["id"])
    assert c["status"] == "failed" and c["error"]["type"] == "BadInput", c
    assert "past run A's last step" in c["error"]["message"], c["error"]
    c = wait_ready(client, _create(client, a, upload(client, str(runs / "no_scheduler")), resumed_at=SAVE_AT).json()["id"])
    assert c["verdict"] == "diverged", c
    # the server's drill compares the runs again: step for step, it drilled another pivot than the comparison's
    assert_error(client.post(f"/api/comparisons/{c['id']}/drill", json={}), 400, "NotSupported", "resumed run")


def test_a_workspace_from_before_the_field_opens_with_its_comparisons_step_for_step(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    con = connect(ws / "workspace.duckdb")
    con.execute("CREATE TABLE comparisons (id VARCHAR PRIMARY KEY, run_a VARCHAR, run_b VARCHAR, rule_set VARCHAR, "
                "rule_set_version INTEGER, created DOUBLE, updated DOUBLE, revision INTEGER, status VARCHAR, "
                "error VARCHAR, summary VARCHAR)")
    con.execute("INSERT INTO comparisons VALUES ('c1', 'r1', 'r2', NULL, NULL, 1.0, 1.0, 1, 'failed', NULL, NULL)")
    con.close()
    cat = Catalogue(ws)
    (rec,) = cat.comparison_records()
    assert rec["resumed_at"] == 0 and cat.comparison_listed(rec)["resumed_at"] == 0
