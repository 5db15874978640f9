"""`bitguard alerts` and backend/alerts.py on run directories written through the real RankStore:
latest state per alert, counts, coverage, what a killed run's journal still holds, the replay
advice of a confirmed alert, exit statuses; and the compare of online runs is never identical."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bitguard.backend.afterwards import advice
from bitguard.backend.alerts import read_alerts, render_text
from bitguard.backend.compare import compare
from bitguard.cli import main
from bitguard.errors import NotSupported
from fixtures_runs import RunSpec, write_run
from online_runs import alert, online_run, stats

ROOT = Path(__file__).resolve().parents[3]


_row, _stats = alert, stats


def test_latest_state_per_alert_counts_and_coverage(tmp_path):
    alerts = [_row(0, "pending", t=0), _row(0, "confirmed", t=5, latency_steps=2, verifier_s=0.01,
                                            evidence=json.dumps({"persistent": True})),
              _row(1, "pending", step=7, t=10), _row(1, "cleared", step=7, t=11, latency_steps=0, verifier_s=0.002),
              _row(2, "warning", step=8, t=12, sensor="guard", severity="warning", boundary="loss", op=None),
              _row(3, "pending", step=9, t=20)]
    stats = [_stats(s, op=op, flops=f) for s in range(10) for op, f in (("linear:a", 60.0), ("linear:b", 40.0))]
    stats += [_stats(s, sensor="guard", calls=1, checked=1, flops=0.0, queue=s % 3) for s in range(10)]
    report = read_alerts(online_run(tmp_path, alerts, stats))
    by_id = {a["alert_id"]: a for a in report.alerts}
    assert [by_id[i]["state"] for i in range(4)] == ["confirmed", "cleared", "warning", "pending"]
    assert report.counts == {"pending": 1, "confirmed": 1, "transient": 0, "cleared": 1, "warning": 1}
    first = by_id[0]
    assert first["evidence"] == {"gap": 0.5, "rows": [3]}, "the raising row's evidence, not the verdict's"
    assert first["verdict"]["evidence"] == {"persistent": True} and first["verdict"]["latency_steps"] == 2
    assert [h["state"] for h in first["history"]] == ["pending", "confirmed"]
    assert "unverified" in by_id[3] and by_id[2]["verdict"] is None
    assert report.exit_status == 1
    checksum = next(c for c in report.coverage if c["sensor"] == "checksum")
    assert checksum["steps"] == 10 and checksum["calls"] == 200 and checksum["flops_seen"] == 1000
    assert checksum["checked_share"] == pytest.approx(0.2)
    assert [o["op"] for o in checksum["ops"]] == ["linear:a", "linear:b"]
    guard = next(c for c in report.coverage if c["sensor"] == "guard")
    assert guard["calls"] == 10, "a sensor's rows without an op are its totals"
    assert report.verifier["queue_max"] == 2 and report.verifier["verified"] == 2
    assert report.verifier["unverified"] == 1 and report.verifier["latency_steps_max"] == 2
    doc = report.to_dict()
    assert doc["schema"] == "bitguard.alerts/1"
    json.dumps(doc)  # every field is JSON


def test_a_confirmed_alert_carries_the_replay_advice(tmp_path):
    report = read_alerts(online_run(tmp_path, [_row(0, "pending", step=120), _row(0, "confirmed", step=120, t=1)]))
    text = render_text(report)
    after = report.alerts[0]["afterwards"]
    assert after["steps"] == "120:121"
    assert after["records"][0] == ("bitguard record --mode full --steps 120:121 --out runs/step-120-healthy -- "
                                   "python train.py --lr 3e-4")
    assert after["compare"] == "bitguard compare runs/step-120-healthy runs/step-120-suspect"
    assert "--steps 120:121" in text and "bitguard compare runs/step-120-healthy" in text
    assert "120-C" in text, "a resumed run counts steps from its checkpoint: the advice says so"


def test_advice_for_a_torchrun_job_records_every_rank():
    a = advice({"step": 3, "rank": 1}, ["train.py", "--ddp"], world_size=2)
    assert a["records"][1] == ("torchrun --nproc-per-node 2 -m bitguard record --mode full --steps 3:4 "
                               "--out runs/step-3-suspect -- train.py --ddp")
    assert "rank 1's device" in a["text"]


def test_a_killed_run_shows_the_alerts_its_journal_holds(tmp_path):
    run = online_run(tmp_path, [_row(0, "pending")], killed_alerts=[_row(1, "pending", step=6, t=3)],
                     status="running", complete=False)
    report = read_alerts(run)
    assert sorted(a["alert_id"] for a in report.alerts) == [0, 1]
    assert any("did not finish" in n for n in report.notes)


def test_a_run_of_another_mode_is_refused_in_one_line(tmp_path, capsys):
    run = write_run(str(tmp_path / "full"), RunSpec(layers=2, steps=1))
    with pytest.raises(NotSupported, match="recorded in full mode: it holds boundary events"):
        read_alerts(run)
    assert main(["alerts", run]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mode online" in err
    assert main(["alerts", str(tmp_path / "nothing")]) == 2


def test_exit_statuses_and_json(tmp_path, capsys):
    clean = online_run(tmp_path, [_row(0, "pending"), _row(0, "cleared", t=1), _row(1, "warning", severity="warning")],
                       name="clean")
    assert main(["alerts", str(clean), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "bitguard.alerts/1" and doc["counts"]["cleared"] == 1 and doc["exit_status"] == 0
    none = online_run(tmp_path, [], name="none")
    assert main(["alerts", str(none)]) == 0, "an online run with no alert is not bad input"
    assert "0 confirmed" in capsys.readouterr().out
    bad = online_run(tmp_path, [_row(0, "pending"), _row(0, "confirmed", t=1)], name="bad")
    assert main(["alerts", str(bad)]) == 1


def test_the_compare_of_online_runs_is_never_identical(tmp_path):
    a = online_run(tmp_path, [], name="a")
    b = online_run(tmp_path, [], name="b")
    c = compare(str(a), str(b))
    assert c.verdict == "inconclusive" and c.exit_status == 3
    assert {r["code"] for r in c.blocking_reasons()} >= {"online"}
    assert any("recorded in online mode" in r["message"] for r in c.blocking_reasons())


def test_an_online_run_against_a_full_one_is_not_a_divergence(tmp_path):
    """A full run's events are all one-sided against an online run's none: never counted."""
    full = write_run(str(tmp_path / "full"), RunSpec(layers=2, steps=2))
    online = write_run(str(tmp_path / "online"), RunSpec(layers=2, steps=2, extra_manifest={"mode": "online"}))
    c = compare(full, online)
    assert c.verdict == "inconclusive" and c.first_divergence is None
    assert any(r["code"] == "online" and r["side"] == "b" for r in c.blocking_reasons())


def test_the_cli_prints_the_alerts(tmp_path):
    run = online_run(tmp_path, [_row(0, "pending", step=4), _row(0, "transient", step=4, t=1, latency_steps=1)])
    proc = subprocess.run([sys.executable, "-m", "bitguard", "alerts", str(run)], capture_output=True, text=True,
                          cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "#0 step 4 rank 0 checksum blocks.0.mlp.fc (linear): transient" in proc.stdout


def test_a_schema_4_rank_file_without_sensor_stats_steps_still_reads(tmp_path):
    """sensor_stats gained `steps` in schema version 5: a rank file written before reads it as NULL."""
    from bitguard import db

    run = online_run(tmp_path, [alert(0, "confirmed")], [stats(0), stats(1), stats(1, op="linear:m", calls=4)])
    con = db.connect(run / "rank-0.duckdb")
    try:
        con.execute("ALTER TABLE sensor_stats DROP COLUMN steps")
        con.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    finally:
        con.close()
    manifest = run / "manifest.json"  # (both say the version it was written with: ingest checks they agree)
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "schema_version": 4}))
    report = read_alerts(run).to_dict()
    checksum = next(c for c in report["coverage"] if c["sensor"] == "checksum")
    assert checksum["calls"] == 20 and checksum["steps"] == 2 and checksum["ops"][0]["calls"] == 4
