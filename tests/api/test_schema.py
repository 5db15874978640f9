"""GET /api/schema: the vocabularies the browser reads instead of retyping them (backend/statuses.py)."""

from __future__ import annotations

from api.conftest import compare


def test_the_status_vocabulary_is_the_one_timeline_windows_are_drawn_with(client, scenarios):
    schema = client.get("/api/schema").json()
    codes, of_event = schema["status_codes"], schema["status_of_event"]
    assert codes[0] == "empty" and codes[-1] == "diverged", "least to most severe"
    assert of_event["only_a"] == of_event["only_b"] == "gap" and set(of_event.values()) <= set(codes)

    c = compare(client, scenarios["gap_then_divergence"])
    url = f"/api/comparisons/{c['id']}/timeline"
    end = int(client.get(url, params={"rank": 0, "bins": 1}).json()["extent"][1])
    events = [e for lo in range(0, end, 25)  # windows of the server's raw size (30 events) or less
              for e in client.get(url, params={"rank": 0, "start": lo, "end": min(lo + 25, end)}).json()["events"]]
    assert [e["pos"] for e in events] == list(range(end))
    assert {e["status"] for e in events} <= set(of_event), "every event status has a code"
    # a bin's status is the worst code of the events in it, as the vocabulary maps them
    binned = client.get(url, params={"rank": 0, "bins": 1}).json()
    assert binned["mode"] == "bins" and binned["status_codes"] == codes
    for lane in binned["bins"]["lanes"]:
        side = [e for e in events if e["phase"] == lane["phase"] and e[f"{lane['side']}_seq"] is not None]
        want = max((codes.index(of_event[e["status"]]) for e in side), default=0)
        assert lane["status"] == [want] and lane["n"] == [len(side)], lane
    assert "gap" in {codes[ln["status"][0]] for ln in binned["bins"]["lanes"]}
