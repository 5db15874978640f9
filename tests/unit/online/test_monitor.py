"""The online monitor in process: it leaves training bitwise as a plain run's, counts steps as
events do, writes sensor_stats at each step's end and every alert state change as a row and one
stderr line."""

import io
import json

import duckdb
import torch

import bitguard
from bitguard.collectors.online.monitor import OnlineMonitor
from bitguard.collectors.online.sensor import Alert, Sensor
from bitguard.collectors.store import RankStore
from online_tiny import build, train


def _rows(path, sql):
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_an_online_run_trains_bitwise_as_a_plain_one(tmp_path):
    model, opt, data = build()
    plain_losses = train(model, opt, data, 4)
    plain = [p.detach().clone() for p in model.parameters()]
    model, opt, data = build()
    with bitguard.record(tmp_path / "run", mode="online", budget=1.0):
        online_losses = train(model, opt, data, 4)
    assert online_losses == plain_losses
    for a, b in zip(plain, model.parameters()):
        assert torch.equal(a, b), "the online monitor changed the training's numbers"
    assert torch.nn.Linear.forward.__qualname__ == "Linear.forward", "the sensor's wrapper was not removed"
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["mode"] == "online" and manifest["online"]["budget"] == 1.0
    assert manifest["determinism"]["enabled"] is False, "online mode must not change the run's settings"
    stats = _rows(tmp_path / "run" / "rank-0.duckdb",
                  "SELECT step, count(*), sum(checked) FROM sensor_stats WHERE op LIKE 'linear:%' GROUP BY step ORDER BY step")
    assert [s for s, *_ in stats] == [0, 1, 2, 3]
    assert all(n == 9 and checked >= 9 for _, n, checked in stats), stats  # 2 layers x 4 Linear + lm_head
    assert _rows(tmp_path / "run" / "rank-0.duckdb", "SELECT count(*) FROM alerts") == [(0,)]
    assert _rows(tmp_path / "run" / "rank-0.duckdb", "SELECT count(*) FROM events") == [(0,)]


class _Raiser(Sensor):
    """A sensor that raises one alert and one warning at step 1 and verifies as told."""

    name = "checksum"

    def __init__(self, verdict):
        self.verdict = verdict

    def on_step_end(self, step):
        if step == 1:
            self.monitor.raise_alert(Alert(self.name, "blocks.0.mlp.fc", "linear", "alert", {"gap": 0.5}, 1e-5),
                                     payload={"x": 1})
            self.monitor.raise_alert(Alert(self.name, "loss", "loss", "warning", {"summary": "loss jumped"}))

    def verify(self, task):
        assert task.payload == {"x": 1}
        return self.verdict, {"summary": f"verified: {self.verdict}"}

    def stats(self):
        return [{"sensor": self.name, "op": None, "calls": 1, "checked": 1, "rate": 1.0, "seconds": 0.0}]


def test_alerts_are_rows_and_stderr_lines_with_their_verdict(tmp_path):
    path = tmp_path / "rank-0.duckdb"
    store = RankStore(str(path), {"rank": 0, "world_size": 1, "mode": "online"})
    err = io.StringIO()
    monitor = OnlineMonitor(store, sensors=[_Raiser("confirmed")], out=err, verifier_thread=False)
    monitor.install()
    model, opt, data = build()
    try:
        train(model, opt, data, 3)
        monitor.verifier.run_one()
        train(model, opt, data, 1)
    finally:
        monitor.remove()
        store.close("complete")
    rows = _rows(path, "SELECT alert_id, step, severity, state, threshold, latency_steps FROM alerts ORDER BY t_ns")
    assert rows == [(0, 1, "alert", "pending", 1e-5, None), (1, 1, "warning", "warning", None, None),
                    (0, 1, "alert", "confirmed", 1e-5, 2)]  # verified once step 2 had ended
    lines = err.getvalue().splitlines()
    assert lines[0] == ("bitguard: online alert #0 step 1 rank 0 checksum blocks.0.mlp.fc (linear): gap 5.0e-01 > "
                        "threshold 1.0e-05 — pending")
    assert lines[1].endswith("loss (loss): loss jumped — warning")
    assert lines[2].endswith("(linear): verified: confirmed — confirmed")
    assert _rows(path, "SELECT step, queue FROM sensor_stats ORDER BY step") == [(0, 0), (1, 1), (2, 1), (3, 0)]


def test_a_second_optimizer_in_the_same_step_does_not_count_a_step(tmp_path):
    monitor = OnlineMonitor(None, sensors=[], verifier_thread=False)
    monitor.install()
    try:
        w = torch.nn.Parameter(torch.ones(2))
        a, b = torch.optim.SGD([w], lr=0.1), torch.optim.SGD([w], lr=0.1)
        monitor.budget.allow("checksum", "op")  # a protected call in step 0
        a.step()
        b.step()  # nothing ran since a.step(): the same step
        assert monitor.steps_seen() == 1
        monitor.budget.allow("checksum", "op")
        a.step()
        assert monitor.steps_seen() == 2 and monitor.step == 2
    finally:
        monitor.remove()


class _WriterStore:
    """A store whose writer thread spent a given CPU time (what RankStore.writer_cpu_s counts)."""

    def __init__(self):
        self.errors, self.writer_cpu_s, self.rows = [], 0.5, []  # 0.5 s before the recording: not its cost

    def add_rows(self, table, rows):
        self.rows += rows

    def step_barrier(self):
        return True


def test_the_writer_threads_cpu_is_charged_as_fixed_cost_per_step():
    store = _WriterStore()
    monitor = OnlineMonitor(store, budget=0.02, sensors=[])
    charged = []
    monitor.budget.charge_fixed = charged.append
    store.writer_cpu_s += 0.004  # step 0's rows
    monitor._end_step()
    store.writer_cpu_s += 0.020  # a fold in step 1: spread over the steps so far
    monitor._step = 1
    monitor._end_step()
    # each step end charges the writer's mean, then its own time (the rows, the barrier)
    assert len(charged) == 4 and abs(charged[0] - 0.004) < 1e-12 and abs(charged[2] - 0.012) < 1e-12, charged
    assert abs(monitor.writer_charge_s - 0.012) < 1e-12


def test_a_rank_store_counts_its_writer_threads_cpu(tmp_path):
    store = RankStore(str(tmp_path / "rank-0.duckdb"), {"rank": 0, "world_size": 1, "mode": "online"})
    try:
        assert store.writer_cpu_s == 0.0
        store.add_rows("sensor_stats", [{"step": s, "rank": 0, "sensor": "checksum", "calls": 1} for s in range(50)])
        assert store.step_barrier() and store.step_barrier()  # the second waits for the first batch's write
        assert store.writer_cpu_s > 0.0
    finally:
        store.close("complete")


def test_at_a_low_rate_an_operators_stats_row_sums_its_steps_and_loses_no_call(tmp_path):
    """The checksum sensor's operator rows are written on a step the operator was checked in, every
    STATS_STEPS steps and at the end, each summing the steps since the previous one (`steps`); its totals
    row is written every step. Summed, they are every call seen."""
    from bitguard.collectors.online.checksum import STATS_STEPS

    model, opt, data = build()
    steps = STATS_STEPS + 8
    with bitguard.record(tmp_path / "run", mode="online", budget=0.001):
        train(model, opt, data, steps)
    path = tmp_path / "run" / "rank-0.duckdb"
    totals = _rows(path, "SELECT step, calls, steps FROM sensor_stats WHERE sensor = 'checksum' AND op IS NULL "
                         "ORDER BY step")
    assert [s for s, _, _ in totals] == list(range(steps)) and {n for *_, n in totals} == {1}
    per_op = _rows(path, "SELECT op, step, steps, calls, checked FROM sensor_stats WHERE sensor = 'checksum' "
                         "AND op IS NOT NULL ORDER BY op, step")
    assert sum(r[3] for r in per_op) == sum(c for _, c, _ in totals), "every call is in some operator's row"
    assert len(per_op) < len(totals) * 9 / 2, "fewer rows than one per operator per step"
    by_op = {}
    for op, step, covered, calls, checked in per_op:
        by_op.setdefault(op, []).append((step, covered, checked))
    for op, rows in by_op.items():
        first = 0
        for step, covered, checked in rows:
            assert step - covered + 1 == first, (op, rows)  # the rows tile the steps, none twice, none left out
            assert covered <= STATS_STEPS and (checked or covered == STATS_STEPS or step == steps - 1), (op, rows)
            first = step + 1
        assert first == steps, (op, rows)


def test_a_paused_monitor_observes_nothing_and_resumes_where_it_was(tmp_path):
    """pause() (the overhead benchmark's paired steps): the paused steps are not counted, checked,
    charged or written, not even as API events; the training's numbers stay a plain run's; after
    resume() the next steps are counted on from where the step counter stood, with what the budget
    learned; a recording that ends paused still writes what it held."""
    model, opt, data = build()
    plain_losses = train(model, opt, data, 7)
    model, opt, data = build()
    with bitguard.record(tmp_path / "run", mode="online", budget=1.0) as rec:
        monitor = rec.monitor
        losses = train(model, opt, data, 2)
        calls = {key: entry.calls for key, entry in monitor.budget.ops.items()}
        learned = {key: entry.unit for key, entry in monitor.budget.ops.items()}
        monitor.pause()
        losses += train(model, opt, data, 3)
        assert monitor.steps_seen() == 2, "paused steps are not counted"
        assert {key: entry.calls for key, entry in monitor.budget.ops.items()} == calls, "nothing observed"
        monitor.resume()
        assert {key: entry.unit for key, entry in monitor.budget.ops.items()} == learned, "what it learned is kept"
        losses += train(model, opt, data, 1)
        monitor.pause()
        losses += train(model, opt, data, 1)  # ends paused
    assert losses == plain_losses
    path = tmp_path / "run" / "rank-0.duckdb"
    steps = _rows(path, "SELECT DISTINCT step FROM sensor_stats WHERE op LIKE 'linear:%' ORDER BY step")
    assert [s for s, in steps] == [0, 1, 2], "three observed steps, numbered on"
    zero_grads = _rows(path, "SELECT count(*) FROM api_events WHERE kind = 'zero_grad'")
    assert zero_grads == [(3,)], zero_grads
    assert torch.nn.Linear.forward.__qualname__ == "Linear.forward", "the sensor's wrapper was not removed"
