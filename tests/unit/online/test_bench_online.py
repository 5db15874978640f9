"""benchmarks/bench_online.py's scoring on made-up runs: an injected fault event is detected by the
checksum sensor only through an alert on its module, at its step and call, that names its element;
the loss watcher by a flagged step (it or the next); latencies and clean-step confirmations are
counted, and events after the loss went non-finite are left out."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bench_online  # noqa: E402

M = bench_online.MODULE


def _alert(step, elements, state="confirmed", boundary=M, latency=1, call=0):
    return {"sensor": "checksum", "boundary": boundary, "op": "linear", "step": step, "state": state,
            "evidence": {"elements": elements, "call": call},
            "verdict": {"latency_steps": latency} if state != "pending" else None}


def test_detection_needs_the_module_the_step_the_call_and_the_element():
    losses = [3.0] * 12 + [50.0, 3.0, 3.0, 3.0]  # a spike at step 12
    inj = [{"step": 10, "call": 0, "row": 4, "col": 1}, {"step": 10, "call": 1, "row": 9, "col": 2},
           {"step": 11, "call": 0, "row": 2, "col": 3}, {"step": 12, "call": 0, "row": 1, "col": 5},
           {"step": 13, "call": 0, "row": 1, "col": 6}, {"step": 5, "call": 0, "row": 0, "col": 0}]
    got = {"losses": losses, "injections": inj,
           "alerts": {"alerts": [_alert(10, [[4, 1]]), _alert(11, [[2, 3]], boundary="blocks.0.mlp.fc"),
                                 _alert(12, [[1, 5]], state="transient"), _alert(13, [[1, 7]]), _alert(3, [[7, 0]])],
                      "coverage": [{"sensor": "checksum", "ops": [{"op": f"linear:{M}", "rate": 0.5}]}]}}
    s = bench_online.score(got, first=8)
    assert s["injections"] == 5, "injections before the first scored step are not counted"
    assert s["detected"] == 2 and s["confirmed"] == 1 and s["verdicts"] == {"confirmed": 1, "transient": 1}, \
        "the second call's event, another module's alert and another element are not detections"
    assert s["alert_latency_steps"] == {"median": 0, "max": 0, "n": 2}
    assert s["confirm_latency_steps"] == {"median": 1, "max": 1, "n": 1}
    assert s["steps_to_first_alert"] == 0
    assert s["loss_watcher_detected"] == 2, "the spike at step 12 flags the injections of steps 11 and 12"
    assert s["loss_watcher_steps_to_first"] == 2
    assert s["confirmed_on_clean_steps"] == 1, "step 3 had no injection"
    assert s["sampling_rate"] == 0.5


def test_events_after_the_loss_went_nan_are_not_scored():
    losses = [3.0] * 10 + [float("nan")] * 3
    inj = [{"step": s, "call": 0, "row": 0, "col": 0} for s in (9, 10, 11, 12)]
    got = {"losses": losses, "injections": inj,
           "alerts": {"alerts": [_alert(9, [[0, 0]])], "coverage": []}}
    s = bench_online.score(got, first=8)
    assert s["injections"] == 2 and s["not_scored_after_nan"] == 2 and s["nonfinite_loss_from_step"] == 10
    assert s["detected"] == 1


def test_the_median_interval_holds_the_median_and_narrows_with_more_values():
    import random

    draw = random.Random(1)
    few = [1.0 + draw.gauss(0, 0.05) for _ in range(20)]
    many = [1.0 + draw.gauss(0, 0.05) for _ in range(2000)]
    for values in (few, many):
        got = bench_online.median_interval(values, resamples=2000)
        low, high = got["bootstrap_95"]
        assert low <= got["median"] <= high and got["n"] == len(values), got
        assert got["middle_half"][0] <= got["median"] <= got["middle_half"][1], got
    (a, b), (c, d) = (bench_online.median_interval(v, resamples=2000)["bootstrap_95"] for v in (many, few))
    assert b - a < (d - c) / 4, "a hundred times the values: about a tenth of the width"
    assert bench_online.median_interval([1.5])["bootstrap_95"] == [1.5, 1.5]


def test_the_ratio_of_means_weighs_the_costly_steps_a_median_leaves_out():
    # one observed step in four pays a costly check: the median ratio misses it, the mean does not
    rounds = [{"observed": [1.0, 1.0 if i % 4 else 1.2], "paused": [1.0, 1.0]} for i in range(40)]
    got = bench_online.ratio_of_means(rounds, resamples=500)
    assert abs(got["ratio"] - 1.025) < 1e-12 and got["n"] == 40, got
    assert got["bootstrap_95"][0] <= got["ratio"] <= got["bootstrap_95"][1], got
    assert bench_online.median_interval([sum(r["observed"]) / sum(r["paused"]) for r in rounds])["median"] == 1.0
