"""GET /api/runs/{run_id}/alerts on a live server: an uploaded online run's bitguard.alerts/1 document;
a run of another mode and an unknown run are errors in the one error shape."""

import fixtures_runs as runs
from api.conftest import assert_error, upload
from online_runs import alert, online_run, stats


def test_an_online_runs_alerts(client, tmp_path):
    run = online_run(tmp_path, [alert(0, "pending", step=9), alert(0, "confirmed", step=9, t=1, latency_steps=1),
                                alert(1, "warning", step=11, sensor="guard", severity="warning", boundary="loss")],
                     [stats(s) for s in range(12)], name="online-api")
    uploaded = upload(client, str(run))
    assert uploaded["mode"] == "online"
    r = client.get(f"/api/runs/{uploaded['id']}/alerts")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["schema"] == "bitguard.alerts/1" and doc["counts"]["confirmed"] == 1 and doc["counts"]["warning"] == 1
    confirmed = next(a for a in doc["alerts"] if a["state"] == "confirmed")
    assert confirmed["afterwards"]["steps"] == "9:10"
    assert doc["coverage"][0]["sensor"] == "checksum" and doc["coverage"][0]["steps"] == 12


def test_a_full_run_and_an_unknown_run_are_refused(client, tmp_path):
    full = upload(client, runs.write_run(str(tmp_path / "full-api"), runs.RunSpec(layers=2, steps=1)))
    message = assert_error(client.get(f"/api/runs/{full['id']}/alerts"), 400, "NotSupported", "online")
    assert "full-api" in message and str(tmp_path) not in message, "the user's folder name, not the server's path"
    assert_error(client.get("/api/runs/nope/alerts"), 404, "NotFound")
