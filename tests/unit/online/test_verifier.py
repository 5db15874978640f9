"""The verifier's three outcomes on tasks built directly (cleared: a false alarm; confirmed: the
output is wrong and recomputes to one answer; transient: the recomputations disagree), a full
queue that drops its oldest task as transient, and a drain that leaves what it could not finish."""

import torch
import torch.nn.functional as F

from bitguard.collectors.online.checksum import ChecksumSensor, verify_gemm
from bitguard.collectors.online.sensor import Alert, Sensor, Task
from bitguard.collectors.online.verifier import Verifier


def _payload(corrupt=None):
    torch.manual_seed(0)
    a, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    y = F.linear(a, w, b)
    if corrupt is not None:
        y.view(torch.int32)[1, 5] ^= 1 << corrupt
    return {"kind": "linear", "input": a, "weight": w, "bias": b, "output": y}


def _run(payload):
    verdicts = []
    v = Verifier(verdicts.append, thread=False)
    sensor = ChecksumSensor()
    v.submit(Task(0, 0, sensor, payload, 0.0, Alert("checksum", "m", "linear")))
    assert v.run_one() and not v.run_one()
    return verdicts[0]


def test_a_right_output_is_a_false_alarm():
    verdict = _run(_payload())
    assert verdict.state == "cleared", verdict.evidence
    assert verdict.evidence["elements_over_bound"] == 0 and verdict.seconds >= 0


def test_a_wrong_output_that_recomputes_to_one_answer_is_confirmed():
    verdict = _run(_payload(corrupt=29))
    e = verdict.evidence
    assert verdict.state == "confirmed", e
    assert e["worst"] == [1, 5] and e["flipped_bits"] == [29]
    assert e["recomputations_agree"] and not e["reproduced"], "the recomputation was right: not persistent"


def test_recomputations_that_disagree_are_transient(monkeypatch):
    real, calls = F.linear, []

    def flaky(a, w, b=None):  # a device that gives another answer every time (float32 only: not the reference)
        out = real(a, w, b)
        if out.dtype == torch.float32:
            calls.append(1)
            out = out.clone()
            out[0, 0] += len(calls)
        return out

    monkeypatch.setattr(F, "linear", flaky)
    verdict = _run(_payload(corrupt=29))
    assert verdict.state == "transient", verdict.evidence
    assert not verdict.evidence["recomputations_agree"]


def test_the_backward_gemms_are_recomputed_too():
    torch.manual_seed(1)
    g, w, x = torch.randn(4, 8), torch.randn(8, 16), torch.randn(4, 16)
    dx, dwt = g @ w, x.T @ g
    assert verify_gemm({"kind": "linear.dgrad", "grad_output": g, "weight": w, "output": dx})[0] == "cleared"
    bad = dwt[:2].clone()
    bad[1, 3] *= 2
    state, evidence = verify_gemm({"kind": "linear.wgrad", "input_columns": x[:, :2], "grad_output": g, "output": bad})
    assert state == "confirmed" and evidence["worst"] == [1, 3]


class _Slow(Sensor):
    name = "slow"

    def verify(self, task):
        return "confirmed", {}


def test_a_full_queue_drops_its_oldest_task_as_transient_and_drain_leaves_the_rest():
    verdicts = []
    v = Verifier(verdicts.append, max_tasks=2, thread=False)
    for i in range(3):
        v.submit(Task(i, 0, _Slow(), None, 0.0, Alert("slow", "m", "op")))
    assert [(x.task.alert_id, x.state, x.evidence) for x in verdicts] == [(0, "transient", {"dropped": "queue full"})]
    assert len(v) == 2 and v.dropped == 1
    assert v.drain(0.0) == 2, "no time left: both stay pending"


def test_the_worker_thread_verifies_and_drains():
    verdicts = []
    v = Verifier(verdicts.append)
    for i in range(3):
        v.submit(Task(i, 0, _Slow(), None, 0.0, Alert("slow", "m", "op")))
    assert v.drain(30.0) == 0
    assert sorted(x.task.alert_id for x in verdicts) == [0, 1, 2] and {x.state for x in verdicts} == {"confirmed"}


def test_a_verification_that_fails_is_transient_with_the_error():
    class Broken(Sensor):
        name = "broken"

        def verify(self, task):
            raise RuntimeError("evidence lost")

    verdicts = []
    v = Verifier(verdicts.append, thread=False)
    v.submit(Task(0, 0, Broken(), None, 0.0, Alert("broken", "m", "op")))
    v.run_one()
    assert verdicts[0].state == "transient" and "evidence lost" in verdicts[0].evidence["verifier_error"]
