"""benchmarks/bench_online.py's scoring on made-up runs: an injection is detected by the checksum
sensor only through an alert on its module, at its step, whose rows hold its row; the loss watcher
by a flagged step (it or the next); latencies and clean-step confirmations are counted."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bench_online  # noqa: E402

M = bench_online.MODULE


def _alert(step, rows, state="confirmed", boundary=M, latency=1):
    return {"sensor": "checksum", "boundary": boundary, "op": "linear", "step": step, "state": state,
            "evidence": {"rows": rows}, "verdict": {"latency_steps": latency} if state != "pending" else None}


def test_detection_needs_the_module_the_step_and_the_row():
    losses = [3.0] * 12 + [50.0, 3.0, 3.0]  # a spike at step 12
    got = {"losses": losses,
           "injections": [{"step": 10, "row": 4}, {"step": 10, "row": 9}, {"step": 11, "row": 2},
                          {"step": 12, "row": 1}, {"step": 5, "row": 0}],
           "alerts": {"alerts": [_alert(10, [4]), _alert(11, [2], boundary="blocks.0.mlp.fc"),
                                 _alert(12, [1], state="transient"), _alert(3, [7])],
                      "coverage": [{"sensor": "checksum", "ops": [{"op": f"linear:{M}", "rate": 0.5}]}]}}
    s = bench_online.score(got, first=8)
    assert s["injections"] == 4, "injections before the first scored step are not counted"
    assert s["detected"] == 2 and s["verdicts"] == {"confirmed": 1, "transient": 1}
    assert s["alert_latency_steps"] == {"median": 0, "max": 0, "n": 2}
    assert s["confirm_latency_steps"] == {"median": 1, "max": 1, "n": 1}
    assert s["loss_watcher_detected"] == 2, "the spike at step 12 flags the injections of steps 11 and 12"
    assert s["confirmed_on_clean_steps"] == 1, "step 3 had no injection"
    assert s["sampling_rate"] == 0.5
