"""Online-mode run directories written through the real RankStore, for the alerts tests (reader,
CLI, API, browser): a manifest saying mode online, and rank files holding the given `alerts` and
`sensor_stats` rows. The rows are dicts by column name (bitguard.schema's ALERTS, SENSOR_STATS)."""

from __future__ import annotations

import json
from pathlib import Path

from bitguard.collectors import store
from bitguard.schema import ALERTS, RANK_FILE, SENSOR_STATS
from fixtures_runs import write_manifest


def alert(i, state, step=5, t=0, sensor="checksum", severity="alert", rank=0, **kw) -> dict:
    row = {"alert_id": i, "step": step, "rank": rank, "sensor": sensor, "boundary": "blocks.0.mlp.fc",
           "op": "linear", "severity": severity, "state": state, "evidence": json.dumps({"gap": 0.5, "rows": [3]}),
           "threshold": 1e-5, "t_ns": 1_000 + t}
    row.update(kw)
    return row


def stats(step, sensor="checksum", op=None, calls=10, checked=2, flops=100.0, queue=0, rank=0) -> dict:
    return {"step": step, "rank": rank, "sensor": sensor, "op": op, "calls": calls, "checked": checked, "rate": 0.2,
            "seconds": 1e-3, "flops_seen": flops, "flops_checked": flops / 5, "threshold": 1e-5, "queue": queue}


def online_run(root, alerts, stat_rows=(), killed_alerts=(), world_size=1, name="online", **manifest) -> Path:
    """`root/name`, as online mode writes it. `killed_alerts` go to the journal of a store that is
    then stopped as a SIGKILL would (never folded)."""
    run = Path(root) / name
    run.mkdir(parents=True)
    write_manifest(str(run), world_size, mode="online", command=["python", "train.py", "--lr", "3e-4"], **manifest)
    for rank in range(world_size):
        s = store.RankStore(str(run / RANK_FILE.format(rank=rank)), {"rank": rank, "world_size": world_size,
                                                                    "mode": "online"})
        s.add_rows(ALERTS.name, [a for a in alerts if a["rank"] == rank])
        s.add_rows(SENSOR_STATS.name, [r for r in stat_rows if r["rank"] == rank])
        if killed_alerts:
            s.add_rows(ALERTS.name, list(killed_alerts))
            assert s.step_barrier() and s.step_barrier()
            s._queue.put(None)  # the writer stops with no fold, no close
            s._thread.join()
            s._con.close()
        else:
            s.close("complete")
    return run
