"""Comparisons through the API: summary, pivot, timelines, events, propagation, rules, reruns."""

from __future__ import annotations

import pytest

from api.conftest import assert_error, compare, upload, wait_ready

PROBE_RULE = {"id": "probe-debug-only", "action": "ignore", "match": {"boundary": "model.probe", "phase": "forward"}}


@pytest.fixture(scope="module")
def probe(client_module, scenarios):
    return compare(client_module, scenarios["benign_probe_then_real"])


@pytest.fixture(scope="module")
def client_module(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def test_summary_and_pivot(client, probe):
    assert probe["verdict"] == "diverged" and probe["ranks"] == [0]
    fd = probe["summary"]["first_divergence"]
    assert (fd["boundary"], fd["step"], fd["phase"], fd["blame"]) == ("model.probe", 0, "forward", "source")
    assert probe["summary"]["schema"] == "bitguard.compare/1"
    assert probe["summary"]["propagation"] == {"nodes": 1, "edges": 0}, "the summary carries counts, not the graph"
    pivot = client.get(f"/api/comparisons/{probe['id']}/pivot").json()
    assert pivot["first_divergence"]["boundary"] == "model.probe"
    assert pivot["position"] == {"rank": 0, "pos": 1} == probe["pivot_position"]
    assert [t["differs"] for t in pivot["first_divergence"]["tensors"]] == [False, True]


def test_timeline_raw_window_around_the_pivot(client, probe):
    t = client.get(f"/api/comparisons/{probe['id']}/timeline", params={"rank": 0, "start": 0, "end": 20}).json()
    assert t["mode"] == "events" and t["axis"] == "seq" and t["extent"] == [0, 39]
    assert [ln["phase"] for ln in t["lanes"]] == ["forward", "backward", "optimizer"] * 2
    assert [e["pos"] for e in t["events"]] == list(range(20))
    assert t["events"][1]["status"] == "diverged" and t["events"][1]["is_pivot"]
    assert t["prefix"] == {"a": [0, 1], "b": [0, 1]} and t["pivot"]["pos"] == 1
    assert t["events"][0]["a_x"] == 0 and t["events"][0]["b_x"] == 0


def test_timeline_bins_count_every_event(client, probe):
    t = client.get(f"/api/comparisons/{probe['id']}/timeline", params={"rank": 0, "bins": 4}).json()
    assert t["mode"] == "bins" and t["bins"]["count"] == 4
    lanes = t["bins"]["lanes"]
    for side in ("a", "b"):
        assert sum(sum(ln["n"]) for ln in lanes if ln["side"] == side) == 39
    fwd_a = next(ln for ln in lanes if ln["side"] == "a" and ln["phase"] == "forward")
    assert fwd_a["status"][0] == t["status_codes"].index("diverged"), "a bin shows its worst status"
    diverged = sum(sum(ln["diverged"]) for ln in lanes if ln["side"] == "a")
    assert diverged == 1 + 10 + 13, "the probe at step 0, blocks 2.. and backward at step 1, all of step 2"


def test_timeline_by_time(client, probe):
    t = client.get(f"/api/comparisons/{probe['id']}/timeline",
                   params={"axis": "time", "start": 0, "end": 50_000}).json()
    assert t["axis"] == "time" and t["mode"] == "events"
    assert [e["pos"] for e in t["events"]] == [0, 1, 2, 3, 4]
    assert t["events"][2]["a_x"] == 20_000
    big = client.get(f"/api/comparisons/{probe['id']}/timeline", params={"axis": "time", "bins": 10}).json()
    assert big["mode"] == "bins" and big["extent"][1] > 380_000


def test_timeline_windows_carry_step_boundaries_and_each_bins_steps(client, probe):
    # 13 events a step (5 blocks, the probe, the root, 5 gradients, the optimizer), 3 steps
    url = f"/api/comparisons/{probe['id']}/timeline"
    seq = client.get(url, params={"rank": 0, "start": 10, "end": 39}).json()
    assert seq["steps"] == {"every": 1, "marks": [{"step": 1, "x": 13, "b_x": 13}, {"step": 2, "x": 26, "b_x": 26}]}
    t = client.get(url, params={"rank": 0, "axis": "time"}).json()
    assert [(m["step"], m["x"]) for m in t["steps"]["marks"]] == [(0, 0), (1, 130_000), (2, 260_000)]
    assert all(m["b_x"] is not None for m in t["steps"]["marks"])
    bins = client.get(url, params={"rank": 0, "bins": 3}).json()["bins"]
    assert (bins["step_lo"], bins["step_hi"]) == ([0, 1, 2], [0, 1, 2])
    two = client.get(url, params={"rank": 0, "bins": 2}).json()["bins"]  # 19.5 positions a bin
    assert (two["step_lo"], two["step_hi"]) == ([0, 1], [1, 2])


def test_events_pages_and_detail(client, probe):
    page = client.get(f"/api/comparisons/{probe['id']}/events", params={"status": "diverged", "limit": 5}).json()
    assert page["total"] == 24 and len(page["rows"]) == 5
    row = page["rows"][0]
    for col in ("rank", "row", "pos", "status", "in_prefix", "reordered", "is_pivot", "step", "phase", "boundary",
                "module_type", "call", "a_seq", "b_seq", "a_t_start_ns", "b_t_start_ns"):
        assert col in row, col
    nxt = client.get(f"/api/comparisons/{probe['id']}/events", params={"offset": 38, "limit": 5}).json()
    assert len(nxt["rows"]) == 1 and nxt["total"] == 39
    d = client.get(f"/api/comparisons/{probe['id']}/events/0/a/1").json()
    assert d["event"]["boundary"] == "model.probe" and d["status"] == "diverged" and d["pos"] == 1
    assert d["stack"] and d["tensors_a"][1]["xor"] != d["tensors_b"][1]["xor"]
    assert d["tensors_a"][0]["shape"] == [8, 16] and d["tensors_a"][0]["dtype"] == "float32"
    assert_error(client.get(f"/api/comparisons/{probe['id']}/events/0/a/999"), 404, "NotFound", "999")
    assert_error(client.get(f"/api/comparisons/{probe['id']}/timeline", params={"rank": 5}), 404, "NotFound", "rank 5")


def test_a_rule_moves_the_pivot_and_the_graph_follows(client, scenarios):
    c = compare(client, scenarios["benign_probe_then_real"])
    rs = client.post("/api/rulesets", json={"name": "probe is benign", "rules": [PROBE_RULE]}).json()
    r = client.post(f"/api/comparisons/{c['id']}/rerun", json={"rule_set_id": rs["id"]})
    assert r.status_code == 202 and r.json()["revision"] == 2
    c2 = wait_ready(client, c["id"])
    fd = c2["summary"]["first_divergence"]
    assert (fd["boundary"], fd["step"]) == ("model.layers.2", 1)
    assert c2["summary"]["rules_fired"] == [{"id": "probe-debug-only", "count": 2}]
    assert c2["rule_set"] == {"id": rs["id"], "name": "probe is benign", "version": 1, "latest_version": 1}
    probe_event = client.get(f"/api/comparisons/{c['id']}/events/0/a/1").json()  # the probe at step 0
    assert probe_event["status"] == "benign"
    output = next(t for t in probe_event["tensors_a"] if t["role"] == "output")
    assert output["differs"] and output["ignored"] and output["rule_id"] == "probe-debug-only", output
    benign = client.get(f"/api/comparisons/{c['id']}/events", params={"status": "benign"}).json()
    assert [r["boundary"] for r in benign["rows"]] == ["model.probe", "model.probe"]
    graph = client.get(f"/api/comparisons/{c['id']}/graph").json()
    pivot = next(n for n in graph["nodes"] if n["is_pivot"])
    assert pivot["pos"] == c2["pivot_position"]["pos"]
    hop1 = client.get(f"/api/comparisons/{c['id']}/graph/nodes/{pivot['id']}").json()
    assert [n["boundary"] for n in hop1["consumers"]] == ["model.layers.3"]
    hop2 = client.get(f"/api/comparisons/{c['id']}/graph/nodes/{hop1['consumers'][0]['id']}").json()
    assert [n["boundary"] for n in hop2["consumers"]] == ["model.layers.4"]
    assert [n["boundary"] for n in hop2["producers"]] == ["model.layers.2"]
    assert hop2["consumers"][0]["pos"] == hop2["node"]["pos"] + 1
    assert_error(client.get(f"/api/comparisons/{c['id']}/graph/nodes/r0:nope"), 404, "NotFound")
    # editing the rule set reruns the comparisons that use it: without the rule the probe is back
    client.put(f"/api/rulesets/{rs['id']}", json={"rules": []})
    c3 = wait_ready(client, c["id"])
    assert c3["revision"] == 3 and c3["summary"]["first_divergence"]["boundary"] == "model.probe"
    assert c3["rule_set"]["version"] == 2


def test_identical_runs(client, scenarios):
    c = compare(client, scenarios["identical"])
    assert c["verdict"] == "identical" and c["pivot_position"] is None
    t = client.get(f"/api/comparisons/{c['id']}/timeline").json()
    assert t["pivot"] is None and t["prefix"]["a"] == [0, t["extent"][1]]
    assert client.get(f"/api/comparisons/{c['id']}/pivot").json()["first_divergence"] is None


GAP_RULE = {"id": "no-probe", "action": "allow-gap", "match": {"boundary": "model.probe"}}


def test_a_gap_no_rule_allows_is_a_structure_pivot(client, scenarios):
    c = compare(client, scenarios["gap_then_divergence"])
    fd = c["summary"]["first_divergence"]
    assert c["verdict"] == "diverged" and fd["cause"] == "structure" and fd["missing_side"] == "b"
    assert (fd["boundary"], fd["step"], fd["a_seq"], fd["b_seq"]) == ("model.probe", 0, 1, None)
    pivot = client.get(f"/api/comparisons/{c['id']}/pivot").json()
    assert pivot["first_divergence"]["cause"] == "structure" and pivot["inconclusive"] is None
    t = client.get(f"/api/comparisons/{c['id']}/timeline",
                   params={"rank": fd["rank"], "around": c["pivot_position"]["pos"], "span": 10}).json()
    gap = next(e for e in t["events"] if e["is_pivot"])
    assert gap["status"] == "only_a" and gap["b_seq"] is None


def test_gaps_on_two_ranks(client, scenarios):
    rs = client.post("/api/rulesets", json={"name": "the probe may be missing", "rules": [GAP_RULE]}).json()
    c = compare(client, scenarios["gap_then_divergence"], rule_set_id=rs["id"])
    assert c["ranks"] == [0, 1] and c["pivot_position"]["rank"] == 1
    assert c["summary"]["first_divergence"]["cause"] == "digest"
    t = client.get(f"/api/comparisons/{c['id']}/timeline", params={"rank": 1, "start": 0, "end": 10}).json()
    gap = next(e for e in t["events"] if e["status"] == "only_a")
    assert gap["boundary"] == "model.probe" and gap["b_seq"] is None and gap["b_x"] is None
    t0 = client.get(f"/api/comparisons/{c['id']}/timeline", params={"rank": 0, "bins": 3}).json()
    fwd_b = next(ln for ln in t0["bins"]["lanes"] if ln["side"] == "b" and ln["phase"] == "forward")
    fwd_a = next(ln for ln in t0["bins"]["lanes"] if ln["side"] == "a" and ln["phase"] == "forward")
    assert sum(fwd_a["n"]) == sum(fwd_b["n"]) + 1
    assert fwd_a["status"][0] == t0["status_codes"].index("gap")


def test_incompatible_runs_fail_with_the_engine_message(client, scenarios):
    a = upload(client, scenarios["identical"][0])
    b = upload(client, scenarios["gap_then_divergence"][1])
    r = client.post("/api/comparisons", json={"run_a": a["id"], "run_b": b["id"]})
    c = wait_ready(client, r.json()["id"])
    assert c["status"] == "failed" and c["error"]["type"] == "IncompatibleRuns"
    assert "world size" in c["error"]["message"]
    assert_error(client.get(f"/api/comparisons/{c['id']}/timeline"), 409, "ComparisonNotReady", "failed")
    assert_error(client.post("/api/comparisons", json={"run_a": a["id"], "run_b": "r-none"}), 404, "NotFound")


def test_perfetto_download(client, probe):
    pytest.importorskip("bitguard.backend.perfetto_export")
    r = client.get(f"/api/comparisons/{probe['id']}/perfetto")
    assert r.status_code == 200, r.text
    assert "reference-vs-suspect.pftrace" in r.headers["content-disposition"] and len(r.content) > 100


def test_deleting_a_run_deletes_its_comparisons(client, scenarios):
    c = compare(client, scenarios["identical"])
    assert client.delete(f"/api/runs/{c['run_a']['id']}").status_code == 204
    assert_error(client.get(f"/api/comparisons/{c['id']}"), 404, "NotFound")
    assert client.get(f"/api/comparisons/{c['id']}/timeline").status_code == 404


def test_timeline_window_around_a_position(client, probe):
    seq = client.get(f"/api/comparisons/{probe['id']}/timeline", params={"around": 20, "span": 9}).json()
    assert (seq["start"], seq["end"]) == (17, 26) and [e["pos"] for e in seq["events"]] == list(range(17, 26))
    t = client.get(f"/api/comparisons/{probe['id']}/timeline", params={"axis": "time", "around": 20, "span": 9}).json()
    assert t["start"] == 170_000 and [e["pos"] for e in t["events"]] == list(range(17, 26))


def test_concurrent_comparisons_and_uploads(client, server, scenarios):
    import threading

    import httpx

    pair = scenarios["benign_probe_then_real"]
    a, b = upload(client, pair[0]), upload(client, pair[1])
    created, uploaded = [], []

    def start_one():
        with httpx.Client(base_url=server.url, timeout=30) as c:
            created.append(c.post("/api/comparisons", json={"run_a": a["id"], "run_b": b["id"]}).json()["id"])

    def upload_one():
        with httpx.Client(base_url=server.url, timeout=30) as c:
            uploaded.append(upload(c, pair[1])["id"])

    threads = [threading.Thread(target=f) for f in (start_one, upload_one) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(created)) == 4 and len(set(uploaded)) == 4
    for cid in created:
        c = wait_ready(client, cid)
        assert c["status"] == "ready" and c["summary"]["first_divergence"]["boundary"] == "model.probe"
    listed = {r["id"] for r in client.get("/api/runs").json()}
    assert set(uploaded) <= listed


@pytest.mark.timeout(120)
def test_comparisons_survive_a_restart(tmp_path, scenarios):
    import httpx

    from api.live_server import start_server

    ws = str(tmp_path / "workspace")
    first = start_server(ws)
    try:
        with httpx.Client(base_url=first.url, timeout=30) as c:
            cmp = compare(c, scenarios["benign_probe_then_real"])
            rs = c.post("/api/rulesets", json={"name": "probe", "rules": [PROBE_RULE]}).json()
            c.post(f"/api/comparisons/{cmp['id']}/rerun", json={"rule_set_id": rs["id"]})
            assert wait_ready(c, cmp["id"])["summary"]["first_divergence"]["boundary"] == "model.layers.2"
    finally:
        first.stop()
    second = start_server(ws)
    try:
        with httpx.Client(base_url=second.url, timeout=30) as c:
            listed = {x["id"]: x for x in c.get("/api/comparisons").json()}
            assert listed[cmp["id"]]["status"] == "ready", "listing shows the stored summary without recomputing"
            assert_error(c.get(f"/api/comparisons/{cmp['id']}/timeline"), 409, "ComparisonNotReady")
            again = wait_ready(c, cmp["id"])
            assert again["summary"]["first_divergence"]["boundary"] == "model.layers.2"
            assert again["rule_set"]["name"] == "probe" and again["revision"] == 2
            timeline = c.get(f"/api/comparisons/{cmp['id']}/timeline").json()
            assert timeline["pivot"]["pos"] == again["pivot_position"]["pos"]
    finally:
        second.stop()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_a_timeline_bound_that_is_not_finite_is_refused(client, probe, value):
    for bound in ("start", "end"):
        for axis in ("seq", "time"):
            r = client.get(f"/api/comparisons/{probe['id']}/timeline", params={bound: value, "axis": axis})
            assert_error(r, 400, "BadInput", bound, "finite")


@pytest.mark.parametrize("start,end", [(1e300, None), (-1e300, None), (None, 1e300), (None, -1e300), (1e300, 2e300),
                                       (-1e300, 1e300), (5e18, 6e18)])
def test_a_timeline_window_far_outside_the_run_is_clamped_into_it(client, probe, start, end):
    for axis in ("seq", "time"):
        params = {k: v for k, v in (("start", start), ("end", end), ("axis", axis)) if v is not None}
        r = client.get(f"/api/comparisons/{probe['id']}/timeline", params=params)
        assert r.status_code == 200, r.text
        t = r.json()
        lo, hi = t["extent"]
        assert lo <= t["start"] <= hi and t["start"] < t["end"] <= hi + 1, t


def test_huge_numbers_in_queries_are_answered(client, probe):
    huge = 10**30
    cid = probe["id"]
    page = client.get(f"/api/comparisons/{cid}/events", params={"offset": huge})
    assert page.status_code == 200 and page.json()["rows"] == [], page.text
    assert client.get(f"/api/comparisons/{cid}/events", params={"limit": huge}).status_code == 200
    assert client.get(f"/api/comparisons/{cid}/timeline", params={"around": huge, "span": huge}).status_code == 200
    assert client.get(f"/api/comparisons/{cid}/timeline", params={"bins": huge}).status_code == 200
    for path in (f"/events/0/a/{huge}", f"/events/0/a/{2**63}", f"/events/0/b/-{2**63 + 1}", f"/events/{huge}/a/0"):
        assert_error(client.get(f"/api/comparisons/{cid}{path}"), 404, "NotFound")
    assert_error(client.get(f"/api/comparisons/{cid}/timeline", params={"rank": huge}), 404, "NotFound")
    assert client.get(f"/api/comparisons/{cid}/graph", params={"limit": huge}).status_code == 200


def test_an_incomplete_run_gives_an_inconclusive_verdict_with_its_reasons(client, scenarios, tmp_path):
    import json
    import shutil
    from pathlib import Path

    killed = tmp_path / "killed"
    shutil.copytree(scenarios["identical"][1], killed)
    manifest = json.loads((killed / "manifest.json").read_text())
    (killed / "manifest.json").write_text(json.dumps({**manifest, "status": "interrupted", "complete": False,
                                                      "exit_status": None, "signal": "SIGKILL"}))
    c = compare(client, (scenarios["identical"][0], str(Path(killed))))
    assert c["verdict"] == "inconclusive" and c["pivot_position"] is None
    reasons = c["summary"]["inconclusive"]["reasons"]
    assert reasons and all(set(r) >= {"code", "message"} for r in reasons), reasons
    pivot = client.get(f"/api/comparisons/{c['id']}/pivot").json()
    assert pivot["verdict"] == "inconclusive" and pivot["first_divergence"] is None
    assert [r["code"] for r in pivot["inconclusive"]["reasons"]] == [r["code"] for r in reasons]


def test_a_graph_node_whose_boundary_holds_a_slash_is_found(client, scenarios, tmp_path):
    import shutil
    from urllib.parse import quote

    import duckdb

    pair = []
    for side, source in zip(("reference", "suspect"), scenarios["benign_probe_then_real"]):
        shutil.copytree(source, tmp_path / side)
        con = duckdb.connect(str(tmp_path / side / "rank-0.duckdb"))
        con.execute("UPDATE events SET boundary = 'model.probe/x' WHERE boundary = 'model.probe'")
        con.close()
        pair.append(str(tmp_path / side))
    c = compare(client, tuple(pair))
    pivot = next(n for n in client.get(f"/api/comparisons/{c['id']}/graph").json()["nodes"] if n["is_pivot"])
    assert "/" in pivot["id"]
    for path in (pivot["id"], quote(pivot["id"], safe="")):
        r = client.get(f"/api/comparisons/{c['id']}/graph/nodes/{path}")
        assert r.status_code == 200 and r.json()["node"]["boundary"] == "model.probe/x", r.text
