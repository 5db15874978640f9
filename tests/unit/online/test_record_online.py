"""`bitguard record --mode online` end to end on the tiny GPT, with the SDC simulator: the alert
is a stderr line and a row, confirmed by the verifier; a killed run keeps its alerts (the journal)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from bitguard.collectors.store import recover

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
BITGUARD = str(ROOT / ".venv" / "bin" / "bitguard")
SCRIPT = str(ROOT / "sample_traces" / "tinygpt.py")
SPEC = json.dumps({"module": "blocks.1.mlp.fc", "bit": 29, "from_step": 2})


def _latest(path):
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute("SELECT alert_id, arg_max(state, t_ns), any_value(step), any_value(boundary) "
                           "FROM alerts GROUP BY alert_id ORDER BY alert_id").fetchall()
    finally:
        con.close()


def test_record_online_names_the_corrupted_layer_and_confirms_it(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, BITGUARD_SDC_SIMULATE=SPEC)
    # --budget 1: every call checked (at the default budget calls are sampled: a faulty call may be skipped)
    proc = subprocess.run([BITGUARD, "record", "--mode", "online", "--budget", "1", "--out", str(out), "--",
                           sys.executable, SCRIPT, "--steps", "4"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "SDC SIMULATION ACTIVE" in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("bitguard: online alert #")]
    assert lines[0].startswith("bitguard: online alert #0 step 2 rank 0 checksum blocks.1.mlp.fc (linear): gap "), lines
    alerts = _latest(out / "rank-0.duckdb")
    assert alerts and {a[1] for a in alerts} == {"confirmed"} and {a[3] for a in alerts} == {"blocks.1.mlp.fc"}
    assert sorted({a[2] for a in alerts}) == [2, 3]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["mode"] == "online" and manifest["status"] == "complete"
    assert manifest["online"]["sdc_simulate"]["module"] == "blocks.1.mlp.fc"


def test_a_killed_online_run_keeps_its_alerts(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, BITGUARD_SDC_SIMULATE=SPEC)
    # the script's path after --: this process records it (no launcher), so SIGKILL leaves the journal as it is
    proc = subprocess.Popen([BITGUARD, "record", "--mode", "online", "--budget", "1", "--out", str(out), "--", SCRIPT,
                             "--steps", "200",
                             "--sleep", "0.2", "--progress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen, deadline = [], time.monotonic() + 240
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step 5 done") or time.monotonic() > deadline:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert any("online alert #0 step 2" in x for x in seen), "".join(seen[-20:])
    assert (out / "rank-0.journal").exists(), "killed: the journal holds the last steps"
    recover(out / "rank-0.duckdb")  # what the launcher does when its child dies
    alerts = _latest(out / "rank-0.duckdb")
    assert [a[2] for a in alerts][:2] == [2, 3], alerts
    assert all(a[3] == "blocks.1.mlp.fc" for a in alerts)
