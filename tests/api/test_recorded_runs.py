"""The explorer on real recordings: tiny GPT runs made by `bitguard record`, uploaded as folders."""

from __future__ import annotations

import pytest

import recorded
from api.conftest import compare

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_a_recorded_bitflip_is_found_through_the_api(client, tmp_path_factory):
    pair = recorded.shared(tmp_path_factory, recorded.forward_bitflip)  # the pair tests/unit/backend reads
    c = compare(client, tuple(str(p) for p in pair))
    fd = c["summary"]["first_divergence"]
    assert (fd["boundary"], fd["phase"], fd["step"], fd["blame"]) == ("blocks.0.mlp.fc", "forward", 1, "source")
    pos = c["pivot_position"]
    t = client.get(f"/api/comparisons/{c['id']}/timeline",
                   params={"rank": pos["rank"], "around": pos["pos"], "span": 20}).json()
    assert t["pivot"]["pos"] == pos["pos"] and any(e["is_pivot"] for e in t["events"])
    detail = client.get(f"/api/comparisons/{c['id']}/events/{fd['rank']}/a/{fd['a_seq']}").json()
    assert detail["stack"] and any(x["role"] == "output" for x in detail["tensors_a"])
    graph = client.get(f"/api/comparisons/{c['id']}/graph").json()
    pivot = next(n for n in graph["nodes"] if n["is_pivot"])
    hop = client.get(f"/api/comparisons/{c['id']}/graph/nodes/{pivot['id']}").json()
    assert hop["consumers"], "a flipped activation feeds the rest of the network"
