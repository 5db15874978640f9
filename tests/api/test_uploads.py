"""Uploading run directories through a live server: what is kept, what is refused, what is left."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from api.conftest import assert_error, run_files, upload, wait_ready


def _workspace_state(server) -> tuple[set, list]:
    ws = Path(server.workspace)
    return {p.name for p in (ws / "runs").iterdir()}, list((ws / "tmp").iterdir())


def test_upload_keeps_the_run_byte_for_byte(client, server, scenarios):
    ref, _ = scenarios["benign_probe_then_real"]
    run = upload(client, ref)
    assert run["name"] == "reference" and run["world_size"] == 1 and run["ranks"] == [0]
    assert run["files"] == 2 and run["status"] == "complete"
    stored = Path(server.workspace) / "runs" / run["id"]
    for f in ("manifest.json", "rank-0.duckdb"):
        assert (stored / f).read_bytes() == (Path(ref) / f).read_bytes()
    assert client.get(f"/api/runs/{run['id']}").json() == run
    assert run["id"] in {r["id"] for r in client.get("/api/runs").json()}


def test_upload_without_a_top_folder_and_with_a_name(client, scenarios):
    _, suspect = scenarios["gap_then_divergence"]
    r = client.post("/api/runs", files=run_files(suspect, prefix=""), data={"name": "suspect on 2 ranks"})
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "suspect on 2 ranks" and r.json()["ranks"] == [0, 1]


def test_a_folder_that_is_not_a_run_is_refused_and_leaves_nothing(client, server, tmp_path):
    (tmp_path / "holiday").mkdir()
    (tmp_path / "holiday" / "photo.jpg").write_bytes(b"\xff\xd8not a run")
    before = _workspace_state(server)
    r = client.post("/api/runs", files=run_files(str(tmp_path / "holiday")))
    message = assert_error(r, 400, "NotARun")
    assert "manifest.json" in message
    assert _workspace_state(server) == (before[0], [])


def test_a_truncated_rank_file_is_a_corrupt_run(client, server, scenarios, tmp_path):
    ref, _ = scenarios["identical"]
    broken = tmp_path / "broken"
    shutil.copytree(ref, broken)
    data = (broken / "rank-0.duckdb").read_bytes()
    (broken / "rank-0.duckdb").write_bytes(data[: len(data) // 3])
    before = _workspace_state(server)
    assert_error(client.post("/api/runs", files=run_files(str(broken))), 400, "CorruptRun", "rank-0.duckdb")
    assert _workspace_state(server) == (before[0], [])


def test_a_newer_schema_is_refused(client, scenarios, tmp_path):
    ref, _ = scenarios["identical"]
    newer = tmp_path / "newer"
    shutil.copytree(ref, newer)
    manifest = json.loads((newer / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 99}))
    assert_error(client.post("/api/runs", files=run_files(str(newer))), 400, "SchemaMismatch")


def test_unsafe_paths_are_refused_before_anything_is_written(client, server, scenarios):
    ref, _ = scenarios["identical"]
    good = run_files(ref)
    before = _workspace_state(server)
    for bad in ("../escape.txt", "run/../../escape.txt", "/etc/passwd", "C:\\x\\manifest.json",
                "run\\..\\x", "run//manifest.json", "./manifest.json"):
        r = client.post("/api/runs", files=[*good, ("files", (bad, b"x", "text/plain"))])
        assert_error(r, 400, "BadInput")
        assert _workspace_state(server) == (before[0], []), bad
    assert not (Path(server.workspace).parent / "escape.txt").exists()


def test_size_limits_say_which_limit(client, server, scenarios):
    ref, _ = scenarios["identical"]
    before = _workspace_state(server)
    big = ("files", ("reference/big.bin", b"\0" * (5 << 20), "application/octet-stream"))
    assert_error(client.post("/api/runs", files=[*run_files(ref), big]), 413, "TooLarge",
                 "big.bin", "per-file limit")
    halves = [("files", (f"reference/part{i}.bin", b"\0" * (3 << 20), "application/octet-stream")) for i in range(3)]
    assert_error(client.post("/api/runs", files=[*run_files(ref), *halves]), 413, "TooLarge", "per-run")
    many = [("files", (f"reference/f{i}.txt", b"x", "text/plain")) for i in range(60)]
    assert_error(client.post("/api/runs", files=many), 400, "BadInput", "at most 50 files")
    assert _workspace_state(server) == (before[0], [])
    assert client.get("/api/limits").json() == {"max_file_bytes": 4 << 20, "max_run_bytes": 6 << 20, "max_files": 50}


def test_an_interrupted_upload_leaves_no_half_run(client, server, scenarios):
    ref, _ = scenarios["identical"]
    before = _workspace_state(server)
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"files\"; filename=\"r/manifest.json\"\r\n\r\n"
            + Path(ref, "manifest.json").read_bytes()
            + b"\r\n--XyZ\r\nContent-Disposition: form-data; name=\"files\"; filename=\"r/rank-0.duckdb\"\r\n\r\n"
            + Path(ref, "rank-0.duckdb").read_bytes()[:5000])
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(b"POST /api/runs HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=XyZ\r\n"
                  + f"Content-Length: {len(body) + 100000}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 30  # the server notices the disconnect and cleans up (seconds, on a loaded machine)
    while _workspace_state(server) != (before[0], []) and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    assert _workspace_state(server) == (before[0], [])
    assert client.get("/api/health").status_code == 200


def test_concurrent_uploads_all_land(client, server, scenarios):
    pairs = list(scenarios.values())
    dirs = [d for pair in pairs for d in pair] * 2
    results: list = [None] * len(dirs)

    def go(i: int) -> None:
        import httpx

        with httpx.Client(base_url=server.url, timeout=60) as c:
            results[i] = c.post("/api/runs", files=run_files(dirs[i]), params={"name": f"concurrent {i}"})

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 201 for r in results), [r.text for r in results if r.status_code != 201]
    ids = {r.json()["id"] for r in results}
    assert len(ids) == len(dirs)
    listed = {r["id"]: r for r in client.get("/api/runs").json()}
    assert ids <= set(listed)
    for r in results:
        run = r.json()
        assert os.path.isfile(Path(server.workspace, "runs", run["id"], "manifest.json"))


def test_delete_a_run(client, server, scenarios):
    run = upload(client, scenarios["identical"][0])
    assert client.delete(f"/api/runs/{run['id']}").status_code == 204
    assert not Path(server.workspace, "runs", run["id"]).exists()
    assert_error(client.get(f"/api/runs/{run['id']}"), 404, "NotFound", run["id"])
    assert_error(client.delete(f"/api/runs/{run['id']}"), 404, "NotFound")


def test_a_folder_name_becomes_a_tidy_run_name(client, scenarios, tmp_path):
    odd = tmp_path / "lr=0.1 [bf16]"
    shutil.copytree(scenarios["identical"][0], odd)
    assert upload(client, str(odd))["name"] == "lr-0.1 -bf16"


def test_links_inside_a_staged_run_are_refused(tmp_path, scenarios):
    import pytest

    from bitguard.backend.workspace import Workspace
    from bitguard.errors import BadInput

    ws = Workspace(tmp_path / "ws")
    try:
        with ws.staging() as staged:
            shutil.copytree(scenarios["identical"][0], staged / "run")
            os.symlink("/etc/passwd", staged / "run" / "notes.txt")
            with pytest.raises(BadInput, match="notes.txt is a link"):
                ws.commit_run(staged / "run", "linked")
        assert ws.runs() == [] and list((tmp_path / "ws" / "tmp").iterdir()) == []
    finally:
        ws.close()


def test_serve_with_a_demo_pair_imports_it_once(tmp_path, scenarios):
    """`bitguard serve --demo A B`: the pair is copied in and compared; a second start reuses both."""
    import httpx

    from api.live_server import free_port

    ref, suspect = scenarios["benign_probe_then_real"]
    ws = str(tmp_path / "ws")
    code = ("import sys\nfrom bitguard.backend.server import serve\n"
            "serve(sys.argv[1], '127.0.0.1', int(sys.argv[2]), demo=(sys.argv[3], sys.argv[4]))\n")
    printed = []
    for _ in range(2):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-u", "-c", code, ws, str(port), ref, suspect],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            line = proc.stdout.readline()
            printed.append(line)
            assert line.startswith(f"bitguard explorer: http://127.0.0.1:{port}/#/c/"), line
            cid = line.split("#/c/")[1].split()[0]
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                for _ in range(100):
                    try:
                        c.get("/api/health")
                        break
                    except httpx.TransportError:
                        threading.Event().wait(0.1)
                assert wait_ready(c, cid)["summary"]["first_divergence"]["boundary"] == "model.probe"
                assert len(c.get("/api/runs").json()) == 2
        finally:
            proc.terminate()
            proc.wait(10)
    ids = [line.split("#/c/")[1].split()[0] for line in printed]
    assert ids[0] == ids[1], "the second start reopens the same comparison"
