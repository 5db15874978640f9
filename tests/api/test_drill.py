"""A comparison's drill through the API: started off the request thread, polled, kept, and its failures
in the one error shape. The engine's drill is a stand-in here (api/drill_fake.py): these tests are
about the routes and the worker, not about what a replay finds (tests of backend/drill.py are)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from api.conftest import assert_error
from api.drill_fake import DOCUMENT, FakeDrill
from bitguard.backend import comparison_jobs, drills
from bitguard.backend.server import create_app
from bitguard.errors import NotSupported


@pytest.fixture
def fake(monkeypatch):
    fake = FakeDrill()
    monkeypatch.setattr(drills, "_engine_drill", fake)
    yield fake
    fake.gate.set()  # never leave the worker waiting


def _app(root):
    app = create_app(str(root))
    return app, app.state.workspace


def _comparison(ws, pair, rule_set_id=None) -> dict:
    a, b = ws.import_run(pair[0], name="reference"), ws.import_run(pair[1], name="suspect")
    c = ws.wait(ws.create_comparison(a["id"], b["id"], rule_set_id)["id"])
    assert c["status"] == "ready", c
    return c


def _poll(client, cid: str, until=("done", "failed"), timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = client.get(f"/api/comparisons/{cid}/drill")
        assert r.status_code == 200, r.text
        state = r.json()
        if state["state"] in until:
            return state
        assert time.monotonic() < deadline, f"drill of {cid} still {state['state']} after {timeout}s"
        time.sleep(0.02)


def test_a_drill_runs_off_the_request_thread_is_polled_and_kept(tmp_path, scenarios, fake):
    app, ws = _app(tmp_path / "ws")
    with TestClient(app) as client:
        c = _comparison(ws, scenarios["benign_probe_then_real"])
        drill = f"/api/comparisons/{c['id']}/drill"
        assert_error(client.get(drill), 404, "NotFound", "has not been drilled", f"POST /api/comparisons/{c['id']}/drill")

        r = client.post(drill)
        assert r.status_code == 202, r.text
        first = r.json()
        assert first["schema"] == "bitguard.drill-state/1" and first["state"] in ("queued", "running")
        assert (first["comparison"], first["revision"], first["rank"]) == (c["id"], 1, None)
        assert first["document"] is None and first["error"] is None
        assert fake.entered.wait(10)
        running = client.get(drill).json()
        assert running["state"] == "running" and running["elapsed_s"] >= 0 and running["document"] is None

        again = client.post(drill, json={"rank": 0})
        assert again.status_code == 202 and again.json()["created"] == first["created"], \
            "a second POST while the drill runs gives the running one"
        assert len(fake.calls) == 1
        assert fake.calls[0] == {"dir_a": ws.run_path(c["run_a"]["id"]), "dir_b": ws.run_path(c["run_b"]["id"]),
                                 "rank": None, "rules": None}

        fake.gate.set()
        done = _poll(client, c["id"])
        assert done["state"] == "done" and done["error"] is None and done["exit_status"] == 0
        assert done["document"] == DOCUMENT
        assert done["finished"] >= done["started"] >= done["created"]

        # once finished, a POST drills again (here on rank 0)
        assert client.post(drill, json={"rank": 0}).json()["rank"] == 0
        assert _poll(client, c["id"])["state"] == "done" and fake.calls[1]["rank"] == 0

    # the finished drill survives a restart of the server
    app, ws = _app(tmp_path / "ws")
    with TestClient(app) as client:
        kept = client.get(drill).json()
        assert kept["state"] == "done" and kept["rank"] == 0 and kept["document"] == DOCUMENT


def test_a_failed_drill_shows_the_engines_message_in_the_users_terms(tmp_path, scenarios, fake):
    # the real drill says this of a run uploaded from another machine; its message names the run's folder
    fake.error = lambda dir_a, _b: NotSupported(
        f"{dir_a}: the recorded command's script /home/u/train.py is not on this machine; the replay needs it "
        "where it was recorded: drill the runs with `bitguard drill` there")
    fake.gate.set()
    app, ws = _app(tmp_path / "ws")
    with TestClient(app) as client:
        c = _comparison(ws, scenarios["benign_probe_then_real"])
        assert client.post(f"/api/comparisons/{c['id']}/drill").status_code == 202
        failed = _poll(client, c["id"])
        assert failed["state"] == "failed" and failed["document"] is None and failed["exit_status"] is None
        assert failed["error"]["type"] == "NotSupported"
        message = failed["error"]["message"]
        assert message.startswith("reference: the recorded command's script /home/u/train.py is not on this machine")
        assert str(ws.root) not in message


def test_a_bug_in_the_drill_is_an_internal_error(tmp_path, scenarios, fake):
    fake.error = KeyError("op_pivot")
    fake.gate.set()
    app, ws = _app(tmp_path / "ws")
    with TestClient(app) as client:
        c = _comparison(ws, scenarios["benign_probe_then_real"])
        client.post(f"/api/comparisons/{c['id']}/drill")
        error = _poll(client, c["id"])["error"]
        assert error["type"] == "InternalError" and "KeyError" in error["message"] and "a bug in bitguard" in \
            error["message"]


def test_what_cannot_be_drilled_is_refused_at_once(tmp_path, scenarios, fake, monkeypatch):
    fake.gate.set()
    app, ws = _app(tmp_path / "ws")
    with TestClient(app) as client:
        assert_error(client.post("/api/comparisons/c-missing/drill"), 404, "NotFound", "c-missing")
        assert_error(client.get("/api/comparisons/c-missing/drill"), 404, "NotFound", "c-missing")
        same = _comparison(ws, scenarios["identical"])
        assert_error(client.post(f"/api/comparisons/{same['id']}/drill"), 400, "BadInput", "no pivot",
                     "verdict identical")
        probe = _comparison(ws, scenarios["benign_probe_then_real"])
        assert_error(client.post(f"/api/comparisons/{probe['id']}/drill", json={"rank": 3}), 400, "BadInput",
                     "rank 3 is not one of the compared ranks [0]")
        assert_error(client.post(f"/api/comparisons/{probe['id']}/drill", json={"rank": "one"}), 400, "BadInput",
                     "rank")

        # a comparison still being computed: 409, poll it first
        gate, real = __import__("threading").Event(), comparison_jobs._engine_compare
        monkeypatch.setattr(comparison_jobs, "_engine_compare", lambda *a: gate.wait(30) and real(*a))
        busy = ws.rerun(probe["id"])
        assert_error(client.post(f"/api/comparisons/{busy['id']}/drill"), 409, "ComparisonNotReady", "poll")
        gate.set()
        ws.wait(busy["id"])
    assert fake.calls == []


def test_the_drill_uses_the_comparisons_rules_and_goes_with_it(tmp_path, scenarios, fake):
    app, ws = _app(tmp_path / "ws")
    rule = {"id": "probe-debug-only", "action": "ignore", "match": {"boundary": "model.probe"}}
    with TestClient(app) as client:
        rs = client.post("/api/rulesets", json={"name": "probe", "rules": [rule]}).json()
        c = _comparison(ws, scenarios["benign_probe_then_real"], rule_set_id=rs["id"])
        client.post(f"/api/comparisons/{c['id']}/drill")
        assert fake.entered.wait(10)
        assert fake.calls[0]["rules"] == ws.rules_body(rs["id"], 1)
        assert [r["id"] for r in fake.calls[0]["rules"]["rules"]] == ["probe-debug-only"]

        # deleted while its drill runs: the drill is gone with it and writes nothing
        assert client.delete(f"/api/comparisons/{c['id']}").status_code == 204
        fake.gate.set()
        assert_error(client.get(f"/api/comparisons/{c['id']}/drill"), 404, "NotFound", c["id"])
        deadline = time.monotonic() + 10
        while c["id"] in app.state.drills._jobs:  # until the worker has finished with it
            assert time.monotonic() < deadline, "the deleted comparison's drill was never dropped"
            time.sleep(0.02)
        assert not (ws.root / "comparisons" / c["id"]).exists()


def test_a_damaged_stored_drill_reads_as_failed_saying_so(tmp_path, scenarios, fake):
    app, ws = _app(tmp_path / "ws")
    with TestClient(app) as client:
        c = _comparison(ws, scenarios["benign_probe_then_real"])
        folder = ws.root / "comparisons" / c["id"]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / drills.FILE_NAME).write_text("{not json")
        state = client.get(f"/api/comparisons/{c['id']}/drill").json()
        assert state["state"] == "failed" and state["error"]["type"] == "CorruptRun"
        assert "drill it again" in state["error"]["message"]


def test_a_run_recorded_on_another_machine_is_not_replayed_and_the_drill_says_so(tmp_path, scenarios):
    """The real engine: uploads are copies, and the replay needs the recorded working directory and script
    where they were; here the manifests name a folder this machine lacks."""
    import json
    import shutil

    pair = []
    for side, src in zip(("reference", "suspect"), scenarios["benign_probe_then_real"]):
        shutil.copytree(src, tmp_path / side)
        manifest = tmp_path / side / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "cwd": "/home/someone/elsewhere"}))
        pair.append(str(tmp_path / side))
    app, ws = _app(tmp_path / "ws")
    with TestClient(app) as client:
        c = _comparison(ws, pair)
        assert client.post(f"/api/comparisons/{c['id']}/drill").status_code == 202
        failed = _poll(client, c["id"])
    assert failed["state"] == "failed" and failed["error"]["type"] == "NotSupported", failed
    assert failed["error"]["message"] == ("cannot replay reference: its working directory /home/someone/elsewhere is "
                                          "not on this machine; drill on the machine that recorded it")


def test_drills_run_one_at_a_time_the_next_one_queued(tmp_path, scenarios, fake):
    app, ws = _app(tmp_path / "ws")
    with TestClient(app) as client:
        first = _comparison(ws, scenarios["benign_probe_then_real"])
        second = _comparison(ws, scenarios["gap_then_divergence"])
        client.post(f"/api/comparisons/{first['id']}/drill")
        assert fake.entered.wait(10)
        queued = client.post(f"/api/comparisons/{second['id']}/drill").json()
        assert queued["state"] == "queued" and queued["started"] is None and queued["elapsed_s"] is None
        assert client.get(f"/api/comparisons/{second['id']}/drill").json()["state"] == "queued"
        fake.gate.set()
        assert _poll(client, first["id"])["state"] == "done" and _poll(client, second["id"])["state"] == "done"
        assert [call["dir_a"] for call in fake.calls] == [ws.run_path(first["run_a"]["id"]),
                                                          ws.run_path(second["run_a"]["id"])]
