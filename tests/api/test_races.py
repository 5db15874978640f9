"""Requests that race through a live server: deletes of one run at once, a comparison created or
computed while its run is deleted. Each ends in 2xx or 404, never 500, and leaves no orphan."""

from __future__ import annotations

import threading

import httpx

from api.conftest import upload, wait_ready


def _at_once(server, *calls):
    """Run each call(client) on its own thread, released together; their responses in order."""
    barrier = threading.Barrier(len(calls))
    out: list = [None] * len(calls)

    def go(i, call):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            barrier.wait()
            out[i] = call(c)

    threads = [threading.Thread(target=go, args=(i, call)) for i, call in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _orphans(client) -> list[dict]:
    runs = {r["id"] for r in client.get("/api/runs").json()}
    return [c for c in client.get("/api/comparisons").json()
            if c["run_a"]["id"] not in runs or c["run_b"]["id"] not in runs or "?" in (c["run_a"]["name"],
                                                                                       c["run_b"]["name"])]


def test_two_deletes_of_one_run_at_once_give_204_and_404(client, server, scenarios):
    """Decided: the first DELETE deletes (204), the second finds nothing (404 NotFound), never 500."""
    for _ in range(5):
        run = upload(client, scenarios["identical"][0])
        first, second = _at_once(server, *[lambda c, rid=run["id"]: c.delete(f"/api/runs/{rid}")] * 2)
        assert sorted([first.status_code, second.status_code]) == [204, 404], (first.text, second.text)
        missed = first if first.status_code == 404 else second
        assert missed.json()["error"]["type"] == "NotFound"
        assert client.get(f"/api/runs/{run['id']}").status_code == 404
    assert client.get("/api/health").status_code == 200


def test_a_comparison_created_while_its_run_is_deleted_goes_with_it(client, server, scenarios):
    ref, suspect = scenarios["identical"]
    for _ in range(6):
        a, b = upload(client, ref), upload(client, suspect)
        deleted, created = _at_once(
            server,
            lambda c: c.delete(f"/api/runs/{a['id']}"),
            lambda c: c.post("/api/comparisons", json={"run_a": a["id"], "run_b": b["id"]}))
        assert deleted.status_code == 204, deleted.text
        assert created.status_code in (202, 404), created.text
        if created.status_code == 202:  # created first: deleted with its run
            assert client.get(f"/api/comparisons/{created.json()['id']}").status_code == 404
        assert _orphans(client) == []
        client.delete(f"/api/runs/{b['id']}")


def test_a_comparison_being_computed_when_its_run_is_deleted_leaves_nothing(client, server, scenarios):
    ref, suspect = scenarios["benign_probe_then_real"]
    for _ in range(4):
        a, b = upload(client, ref), upload(client, suspect)
        cid = client.post("/api/comparisons", json={"run_a": a["id"], "run_b": b["id"]}).json()["id"]
        assert client.delete(f"/api/runs/{b['id']}").status_code == 204  # queued or running now
        assert client.get(f"/api/comparisons/{cid}").status_code == 404
        assert _orphans(client) == []
        client.delete(f"/api/runs/{a['id']}")
    # the worker survived: a new comparison still completes, and the deleted ones never came back
    a, b = upload(client, ref), upload(client, suspect)
    c = wait_ready(client, client.post("/api/comparisons", json={"run_a": a["id"], "run_b": b["id"]}).json()["id"])
    assert c["status"] == "ready" and _orphans(client) == []


def test_deletes_and_reruns_of_one_comparison_at_once(client, server, scenarios):
    a, b = upload(client, scenarios["identical"][0]), upload(client, scenarios["identical"][1])
    for _ in range(4):
        cid = client.post("/api/comparisons", json={"run_a": a["id"], "run_b": b["id"]}).json()["id"]
        out = _at_once(server, lambda c: c.delete(f"/api/comparisons/{cid}"),
                       lambda c: c.delete(f"/api/comparisons/{cid}"),
                       lambda c: c.post(f"/api/comparisons/{cid}/rerun", json={}))
        codes = [r.status_code for r in out]
        assert sorted(codes[:2]) == [204, 404] and codes[2] in (202, 404), [r.text for r in out]
        assert client.get(f"/api/comparisons/{cid}").status_code == 404


def test_start_up_removes_folders_the_catalogue_does_not_know(tmp_path, scenarios):
    from bitguard.backend.workspace import Workspace

    ws = Workspace(tmp_path / "ws")
    run = ws.import_run(scenarios["identical"][0])
    ws.close()
    for stray in ("runs/r-crashed-mid-commit", "comparisons/c-deleted-while-exporting", "tmp/dead-upload"):
        (tmp_path / "ws" / stray).mkdir()
    ws = Workspace(tmp_path / "ws")
    try:
        assert [p.name for p in (tmp_path / "ws" / "runs").iterdir()] == [run["id"]]
        assert list((tmp_path / "ws" / "comparisons").iterdir()) == []
        assert list((tmp_path / "ws" / "tmp").iterdir()) == []
        assert ws.run(run["id"])["problem"] is None
    finally:
        ws.close()
