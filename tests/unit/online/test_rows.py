"""Online mode's row tables (alerts, sensor_stats): written through the journal like events, so a
killed run keeps its alerts; a fold puts them in the rank file."""

import json

from bitguard import db
from bitguard.collectors import journal, store
from bitguard.schema import ALERTS, SENSOR_STATS


def _alert(i: int, state: str) -> dict:
    return {"alert_id": i, "step": 3, "rank": 0, "sensor": "checksum", "boundary": "blocks.0.mlp.fc",
            "op": "linear", "severity": "alert", "state": state, "evidence": json.dumps({"gap": 0.5}),
            "threshold": 1e-5, "t_ns": 12345}


def _killed(s: store.RankStore) -> None:
    """Stop the writer as a SIGKILL would: no fold, no close."""
    s._queue.put(None)
    s._thread.join()


def test_a_killed_run_keeps_its_alerts_through_the_journal(tmp_path):
    path = tmp_path / "rank-0.duckdb"
    s = store.RankStore(str(path), {"rank": 0, "world_size": 1, "mode": "online"})
    s.add_rows(ALERTS.name, [_alert(0, "pending")])
    s.add_rows(SENSOR_STATS.name, [{"step": 3, "rank": 0, "sensor": "checksum", "op": None, "calls": 7,
                                    "checked": 2, "rate": 0.25, "seconds": 1e-4, "queue": 1}])
    assert s.step_barrier()
    s.add_rows(ALERTS.name, [[0, 3, 0, "checksum", "blocks.0.mlp.fc", "linear", "alert", "confirmed", "{}", 1e-5,
                              12346, 1, 0.02]])  # a sequence in column order
    s.step_barrier()
    assert s.step_barrier()  # the second step's rows are durable now
    _killed(s)
    s._con.close()
    decoded = journal.decode(path.with_suffix(".journal").read_bytes())
    assert [g.first_step for g in decoded.groups] == [3, 3], "a batch of sensor rows carries its step range"
    assert store.recover(path) == 2
    con = db.connect(path, read_only=True)
    try:
        alerts = con.execute("SELECT alert_id, state, threshold, latency_steps FROM alerts ORDER BY t_ns").fetchall()
        stats = con.execute("SELECT step, sensor, op, calls, checked, rate, threshold FROM sensor_stats").fetchall()
    finally:
        con.close()
    assert alerts == [(0, "pending", 1e-5, None), (0, "confirmed", 1e-5, 1)]
    assert stats == [(3, "checksum", None, 7, 2, 0.25, None)]


def test_add_rows_refuses_a_table_it_does_not_write(tmp_path):
    s = store.RankStore(str(tmp_path / "rank-0.duckdb"), {"rank": 0, "world_size": 1})
    try:
        for name in ("events", "nonsense"):
            try:
                s.add_rows(name, [{}])
            except ValueError as exc:
                assert name in str(exc)
            else:
                raise AssertionError(f"add_rows took table {name!r}")
    finally:
        s.close("complete")
