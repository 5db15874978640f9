"""GET /api/comparisons/{id}/search over a live server: filters, the hit from a position, paging,
and bad queries in the one error shape."""

from __future__ import annotations

import pytest

from api.conftest import assert_error, compare


@pytest.fixture(scope="module")
def gap_pair(server, scenarios):
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as client:
        return compare(client, scenarios["gap_then_divergence"])


def test_next_divergence_and_gap_from_a_position(client, gap_pair):
    path = f"/api/comparisons/{gap_pair['id']}/search"
    first = client.get(path, params={"rank": 1, "status": "diverged", "limit": 0}).json()
    assert first["schema"] == "bitguard.search/1"
    hit = first["hit"]["event"]
    assert first["total"] > 1 and first["matches"] == [] and first["hit"]["index"] == 0
    assert (hit["boundary"], hit["step"], hit["phase"]) == ("model.layers.1", 1, "forward")
    after = client.get(path, params={"rank": 1, "status": "diverged", "from": hit["pos"], "limit": 0}).json()
    assert after["hit"]["index"] == 1 and after["hit"]["event"]["pos"] > hit["pos"]
    back = client.get(path, params={"rank": 1, "status": "gap", "from": hit["pos"], "direction": "prev"}).json()
    assert back["total"] == 1 and back["hit"]["event"]["boundary"] == "model.probe"
    assert back["hit"]["event"]["b_seq"] is None  # the suspect skipped it
    none = client.get(path, params={"rank": 0, "status": "diverged"}).json()
    assert none["total"] == 0 and none["hit"] is None  # rank 0 never diverges


def test_a_search_page(client, gap_pair):
    path = f"/api/comparisons/{gap_pair['id']}/search"
    out = client.get(path, params={"boundary": "layers.*.weight", "module_type": "Linear", "phase": "backward",
                                   "step_min": 1, "step_max": 2, "offset": 2, "limit": 3}).json()
    assert out["total"] == 8 and len(out["matches"]) == 3 and out["offset"] == 2
    assert all(m["phase"] == "backward" and m["step"] in (1, 2) for m in out["matches"])
    assert out["query"] == {"boundary": "layers.*.weight", "module_type": "Linear", "phase": "backward",
                            "step_min": 1, "step_max": 2}


def test_bad_queries_are_one_line_errors(client, gap_pair):
    path = f"/api/comparisons/{gap_pair['id']}/search"
    assert_error(client.get(path, params={"status": "broken"}), 400, "BadInput", "unknown status 'broken'")
    assert_error(client.get(path, params={"step_min": 3, "step_max": 1}), 400, "BadInput", "step_min 3")
    assert_error(client.get(path, params={"direction": "up"}), 400, "BadInput")
    assert_error(client.get(path, params={"rank": 7}), 404, "NotFound", "rank 7")
    assert_error(client.get("/api/comparisons/nope/search"), 404, "NotFound")
