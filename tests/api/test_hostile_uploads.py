"""Hostile and broken uploads through a live server (issue 12, the server): each is a 4xx in the one
error shape that names the user's folder and no server path, and leaves nothing in the workspace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import pytest

from api.conftest import assert_error, run_files

RUN_ERRORS = {"NotARun", "CorruptRun", "SchemaMismatch", "BadInput"}


def _workspace_state(server) -> tuple[set, list]:
    ws = Path(server.workspace)
    return {p.name for p in (ws / "runs").iterdir()}, list((ws / "tmp").iterdir())


def _no_server_path(message: str, server) -> None:
    for server_path in (server.workspace, str(Path(server.workspace).resolve()), "/tmp", "payload", "<workspace>"):
        assert server_path not in message, (server_path, message)


def _refused(client, server, folder: Path, status: int = 400, types=RUN_ERRORS) -> str:
    """Upload `folder`; it must be refused in the error shape, naming the folder, keeping nothing."""
    before = _workspace_state(server)
    r = client.post("/api/runs", files=run_files(str(folder)))
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] in types, body
    message = body["error"]["message"]
    assert folder.name in message, message
    _no_server_path(message, server)
    assert _workspace_state(server) == (before[0], []), "a refused run leaves nothing behind"
    return message


def _variant(tmp_path: Path, source: str, name: str, manifest=None, sql: tuple[str, ...] = ()) -> Path:
    """A copy of `source` named `name`, its manifest rewritten by `manifest` and rank 0 edited by `sql`."""
    folder = tmp_path / name
    shutil.copytree(source, folder)
    if manifest is not None:
        text = (folder / "manifest.json").read_text()
        (folder / "manifest.json").write_text(manifest(json.loads(text), text))
    if sql:
        con = duckdb.connect(str(folder / "rank-0.duckdb"))
        try:
            for statement in sql:
                con.execute(statement)
            con.execute("CHECKPOINT")
        finally:
            con.close()
    return folder


def _set(**fields):
    return lambda m, _text: json.dumps({**m, **fields})


# -- the multipart body ---------------------------------------------------------------------------

def test_a_300_character_path_part_is_refused(client, server, scenarios):
    good = run_files(scenarios["identical"][0])
    before = _workspace_state(server)
    r = client.post("/api/runs", files=[*good, ("files", ("reference/" + "x" * 300, b"x", "text/plain"))])
    message = assert_error(r, 400, "BadInput", "over 255 bytes")
    _no_server_path(message, server)
    deep = "reference/" + "/".join(["d"] * 40) + "/f"
    assert_error(client.post("/api/runs", files=[*good, ("files", (deep, b"x", "text/plain"))]), 400, "BadInput",
                 "folders deep")
    assert _workspace_state(server) == (before[0], [])


@pytest.mark.parametrize("order", ["file first", "folder first"])
def test_a_path_that_is_a_file_and_a_folder_is_refused(client, server, scenarios, order):
    good = run_files(scenarios["identical"][0])
    clash = ("files", ("reference/manifest.json/x", b"x", "text/plain"))
    parts = [*good, clash] if order == "file first" else [clash, *good]
    before = _workspace_state(server)
    message = assert_error(client.post("/api/runs", files=parts), 400, "BadInput", "reference/manifest.json")
    assert "file" in message and "folder" in message
    _no_server_path(message, server)
    assert _workspace_state(server) == (before[0], [])


def test_a_multipart_boundary_over_256_characters_is_refused(client, server):
    boundary = "b" * 300
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"r/manifest.json\"\r\n\r\n"
            f"{{}}\r\n--{boundary}--\r\n").encode()
    r = client.post("/api/runs", content=body, headers={"content-type": f"multipart/form-data; boundary={boundary}"})
    assert_error(r, 400, "BadInput", "multipart")
    assert _workspace_state(server)[1] == []


# -- the run's contents ---------------------------------------------------------------------------

BAD_RUNS = {
    "world_size_abc": dict(manifest=_set(world_size="abc")),
    "world_size_list": dict(manifest=_set(world_size=[2])),
    "world_size_5000_digit_string": dict(manifest=_set(world_size="9" * 5000)),
    "world_size_5000_digit_number": dict(manifest=lambda m, text: text.replace(
        f'"world_size": {m["world_size"]}', '"world_size": ' + "9" * 5000)),
    "determinism_not_an_object": dict(manifest=_set(determinism="on")),
    "versions_not_an_object": dict(manifest=_set(versions=["torch 2.13"])),
    "deeply_nested_manifest": dict(manifest=lambda m, text: text[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "status_an_object": dict(manifest=_set(status={})),
    "command_an_object": dict(manifest=_set(command={"python": "train.py"})),
    "bad_json_in_meta": dict(sql=("UPDATE meta SET value = '{bad' WHERE key = 'status'",)),
    "bad_json_in_stack_frames": dict(sql=("UPDATE stacks SET frames = '{bad'",)),
    "stack_frames_not_a_list": dict(sql=("UPDATE stacks SET frames = '{\"a\": 1}'",)),
    "meta_schema_version_a_string": dict(sql=("UPDATE meta SET value = '\"1\"' WHERE key = 'schema_version'",)),
    "tensors_xor_of_another_type": dict(sql=("ALTER TABLE tensors ALTER xor TYPE VARCHAR",)),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_a_run_with_bad_contents_is_refused_before_it_is_kept(client, server, scenarios, tmp_path, case):
    folder = _variant(tmp_path, scenarios["identical"][0], case, **BAD_RUNS[case])
    _refused(client, server, folder)
    assert all(r["name"] != case for r in client.get("/api/runs").json())


def test_a_manifest_without_rank_files_names_the_folder_not_the_staging_path(client, server, scenarios, tmp_path):
    folder = tmp_path / "only-manifest"
    folder.mkdir()
    shutil.copy(Path(scenarios["identical"][0]) / "manifest.json", folder)
    _refused(client, server, folder)
    notes = tmp_path / "my-notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("compare the runs")
    message = _refused(client, server, notes, types={"NotARun"})
    assert "bitguard record --out my-notes" in message, message


def test_the_upload_names_the_folder_when_files_come_without_one(client, server, scenarios, tmp_path):
    folder = _variant(tmp_path, scenarios["identical"][0], "loose", manifest=_set(world_size="abc"))
    r = client.post("/api/runs", files=run_files(str(folder), prefix=""), data={"name": "my run"})
    message = assert_error(r, 400, "CorruptRun")
    assert "my run" in message
    _no_server_path(message, server)


def test_run_details_hold_no_server_path(client, server, scenarios):
    from api.conftest import upload

    run = upload(client, scenarios["identical"][0])
    _no_server_path(json.dumps(run), server)
    _no_server_path(client.get("/api/runs").text, server)


def test_a_bad_run_already_in_the_workspace_is_listed_with_its_problem(tmp_path, scenarios):
    """A run kept by an older version (its manifest status is an object) never breaks the list, even
    after a restart; it is listed with its problem and can be deleted."""
    import httpx

    from api.conftest import upload
    from api.live_server import start_server

    ws = str(tmp_path / "workspace")
    first = start_server(ws)
    try:
        with httpx.Client(base_url=first.url, timeout=30) as c:
            good = upload(c, scenarios["identical"][0])
            old = upload(c, scenarios["identical"][1])
            gone = upload(c, scenarios["benign_probe_then_real"][0])
    finally:
        first.stop()
    con = duckdb.connect(str(Path(ws) / "workspace.duckdb"))  # what an older version let in
    try:
        info = json.loads(con.execute("SELECT info FROM runs WHERE id = ?", [old["id"]]).fetchone()[0])
        info["manifest"]["status"] = {}
        con.execute("UPDATE runs SET info = ? WHERE id = ?", [json.dumps(info), old["id"]])
        con.execute("UPDATE runs SET info = '{not json' WHERE id = ?", [gone["id"]])
    finally:
        con.close()
    second = start_server(ws)
    try:
        with httpx.Client(base_url=second.url, timeout=30) as c:
            r = c.get("/api/runs")
            assert r.status_code == 200, r.text
            listed = {x["id"]: x for x in r.json()}
            assert listed[good["id"]]["problem"] is None and listed[good["id"]]["status"] == "complete"
            assert listed[old["id"]]["status"] is None and "'status' is an object" in listed[old["id"]]["problem"]
            assert "cannot be read" in listed[gone["id"]]["problem"]
            assert c.get(f"/api/runs/{old['id']}").status_code == 200
            assert_error(c.post("/api/comparisons", json={"run_a": good["id"], "run_b": old["id"]}), 400, "BadInput",
                         "cannot be compared", "'status' is an object")
            assert c.delete(f"/api/runs/{old['id']}").status_code == 204
            assert c.delete(f"/api/runs/{gone['id']}").status_code == 204
            assert {x["id"] for x in c.get("/api/runs").json()} == {good["id"]}
    finally:
        second.stop()


def test_a_failed_comparison_names_the_runs_not_workspace_folders(client, server, scenarios):
    from api.conftest import upload

    a, b = upload(client, scenarios["identical"][0]), upload(client, scenarios["identical"][1])
    stored = Path(server.workspace) / "runs" / b["id"] / "rank-0.duckdb"
    stored.write_bytes(stored.read_bytes()[:3000])  # damaged on the server's disk after it was admitted
    from api.conftest import wait_ready

    c = wait_ready(client, client.post("/api/comparisons", json={"run_a": a["id"], "run_b": b["id"]}).json()["id"])
    assert c["status"] == "failed", c
    message = c["error"]["message"]
    assert "suspect" in message, message
    _no_server_path(message, server)


def test_the_catalogue_connection_loads_no_extension(tmp_path):
    from bitguard.backend.workspace import Workspace

    ws = Workspace(tmp_path / "ws")
    try:
        row = ws._query("SELECT current_setting('autoinstall_known_extensions') AS install, "
                        "current_setting('autoload_known_extensions') AS load, "
                        "current_setting('enable_external_access') AS external")[0]
    finally:
        ws.close()
    assert row == {"install": False, "load": False, "external": False}


def test_an_unreadable_comparison_record_is_listed_as_failed(tmp_path, scenarios):
    from bitguard.backend.workspace import Workspace

    ws = Workspace(tmp_path / "ws")
    try:
        a, b = ws.import_run(scenarios["identical"][0]), ws.import_run(scenarios["identical"][1])
        good = ws.wait(ws.create_comparison(a["id"], b["id"])["id"])
        bad = ws.create_comparison(a["id"], b["id"])
        ws.wait(bad["id"])
        ws._exec("UPDATE comparisons SET summary = '{broken', status = 'ready' WHERE id = ?", (bad["id"],))
        listed = {c["id"]: c for c in ws.comparisons()}
        assert listed[good["id"]]["status"] == "ready"
        assert listed[bad["id"]]["status"] == "failed" and "cannot be read" in listed[bad["id"]]["error"]["message"]
        assert ws.comparison(bad["id"])["status"] == "failed"
        ws.delete_comparison(bad["id"])
    finally:
        ws.close()


def test_an_upload_of_many_form_fields_is_refused(client, server, scenarios):
    fields = [(f"field{i}", (None, "x")) for i in range(40)]
    r = client.post("/api/runs", files=[*run_files(scenarios["identical"][0]), *fields])
    assert_error(r, 400, "BadInput", "form fields")
    assert _workspace_state(server)[1] == []
