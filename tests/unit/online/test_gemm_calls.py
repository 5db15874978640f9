"""The checksum sensor on functional GEMMs (collectors/online/gemm_calls.py): attention's `@`,
transformers-style Conv1D's addmm, an N-D input times a 2-D weight; what is not checked passes
through untouched; the patch goes away with the recording."""

import json
import sys
import threading

import duckdb
import pytest
import torch

from bitguard.collectors.online.checksum import ChecksumSensor, verify_gemm
from bitguard.collectors.online.monitor import OnlineMonitor
from bitguard.collectors.store import RankStore
from online_tiny import build, train


def _monitored(tmp_path, budget=1.0):
    store = RankStore(str(tmp_path / "rank-0.duckdb"), {"rank": 0, "world_size": 1, "mode": "online"})
    sensor = ChecksumSensor()
    monitor = OnlineMonitor(store, budget=budget, sensors=[sensor], verifier_thread=False)
    return store, sensor, monitor


def _run(tmp_path, fn, budget=1.0):
    store, sensor, monitor = _monitored(tmp_path, budget)
    monitor.install()
    try:
        out = fn()
        while monitor.verifier.run_one():
            pass
    finally:
        monitor.remove()
        store.close("complete")
    con = duckdb.connect(str(tmp_path / "rank-0.duckdb"), read_only=True)
    try:
        alerts = con.execute("SELECT alert_id, step, boundary, op, state, evidence FROM alerts ORDER BY t_ns").fetchall()
        stats = dict((op, (calls, checked)) for op, calls, checked in con.execute(
            "SELECT op, sum(calls)::INT, sum(checked)::INT FROM sensor_stats WHERE op IS NOT NULL GROUP BY op").fetchall())
    finally:
        con.close()
    return out, alerts, stats, store.errors


def test_a_wrong_element_of_attentions_batched_product_is_caught_named_and_confirmed(tmp_path, monkeypatch):
    original = torch.Tensor.__matmul__
    calls = []

    def faulty(a, b):  # a device that gets one element of one head's att @ v wrong in step 3
        out = original(a, b)
        caller = sys._getframe(1)
        caller = caller.f_back if caller.f_code.co_name == "gemm" else caller  # (the sensor's wrapper)
        if not caller.f_code.co_filename.endswith("tinygpt.py"):
            return out  # (bitguard's own checks, localising the element, use @ too)
        calls.append(tuple(out.shape))
        if len(calls) == 4 * 3 + 4:  # step 3's fourth `@`: blocks.1's att @ v
            with torch.no_grad():
                out[1, 2, 7, 5] += 0.5  # batch 1·4 + 2 = 6 of the 4 × 4 heads' (16, 8) products
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", faulty)
    model, opt, data = build()
    _, alerts, stats, errors = _run(tmp_path, lambda: train(model, opt, data, 5))
    assert not errors and len(calls) == 20, "four `@` a step: q·kᵀ and att·v of each block"
    site = "blocks.1.attn (sample_traces/tinygpt.py:102)"
    assert stats[f"matmul:{site}"] == (5, 5) and stats[f"matmul.dgrad:{site}"] == (5, 5), stats
    raised = [a for a in alerts if a[4] == "pending"]
    assert [(a[1], a[2], a[3]) for a in raised] == [(3, site, "matmul")], alerts
    evidence = json.loads(raised[0][5])
    assert evidence["batch"] == 6 and evidence["batches"] == 16 and evidence["batch_index"] == [1, 2], evidence
    assert evidence["elements"] == [[7, 5]] and evidence["shape"] == [16, 8], evidence
    verdicts = [a[4] for a in alerts if a[4] != "pending"]
    assert verdicts == ["confirmed"], alerts


class Conv1D(torch.nn.Module):
    """transformers' GPT-2 Conv1D: y = x·W + b as one addmm, W stored (in, out)."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = torch.nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.weight.shape[1])


def _conv_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(Conv1D(12, 20), torch.nn.GELU(), Conv1D(20, 6))


def _conv_steps(model, steps=4, corrupt_grad=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(3, 5, 12, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


_LINE = Conv1D.forward.__code__.co_firstlineno + 1  # the addmm's line


def test_conv1d_addmm_and_its_gradient_gemms_are_checked_and_a_wrong_weight_gradient_confirmed(tmp_path, monkeypatch):
    plain = _conv_steps(_conv_model())
    (tmp_path / "clean").mkdir()
    watched, alerts, stats, errors = _run(tmp_path / "clean", lambda: _conv_steps(_conv_model()))
    assert watched == plain, "checking changes nothing the training computes"
    assert not errors and not alerts
    first, second = (f"{m} (tests/unit/online/test_gemm_calls.py:{_LINE})" for m in (0, 2))
    assert {op: stats.get(f"{op}:{first}") for op in ("matmul", "matmul.dgrad", "matmul.wgrad")} == \
        {"matmul": (4, 4), "matmul.dgrad": None, "matmul.wgrad": (4, 4)}, "the batch needs no gradient: no dgrad"
    assert all(stats[f"{op}:{second}"] == (4, 4) for op in ("matmul", "matmul.dgrad", "matmul.wgrad")), stats

    original, seen = torch.addmm, []

    def faulty(bias, a, b, **kwargs):  # the second Conv1D's weight gradient comes out wrong in step 2
        out = original(bias, a, b, **kwargs)
        seen.append(out.shape)
        if len(seen) == 2 * 2 + 2:
            def corrupt(grad_inputs, grad_outputs):
                grad_inputs[2][3, 4] += 1.0  # dW[3, 4] of its (20, 6) weight
            out.grad_fn.register_hook(corrupt)  # (before the sensor's: it sees the wrong gradient)
        return out

    monkeypatch.setattr(torch, "addmm", faulty)
    (tmp_path / "fault").mkdir()
    _, alerts, _, errors = _run(tmp_path / "fault", lambda: _conv_steps(_conv_model()))
    raised = [a for a in alerts if a[4] == "pending"]
    assert not errors and [(a[1], a[2], a[3]) for a in raised] == [(2, second, "matmul.wgrad")], alerts
    evidence = json.loads(raised[0][5])
    assert evidence["elements"] == [[3, 4]] and evidence["shape"] == [20, 6], "named in the weight's own layout"
    assert [a[4] for a in alerts if a[4] != "pending"] == ["confirmed"]


def _project(x, w):
    return x @ w  # an N-D input times a 2-D weight: folded to one 2-D product


def test_what_is_not_read_as_a_product_passes_through_and_the_patch_leaves_with_the_recording(tmp_path, monkeypatch):
    before = (torch.matmul, torch.mm, torch.bmm, torch.addmm)
    gen = torch.Generator().manual_seed(3)
    x, w, v = torch.randn(2, 5, 7, generator=gen), torch.randn(7, 4, generator=gen), torch.randn(7, generator=gen)
    m, n = torch.randn(5, 7, generator=gen), torch.randn(5, 4, generator=gen)
    want = {"vector": x @ v, "out": torch.mm(m, w), "alpha": torch.addmm(n, m, w, alpha=2.0), "full": torch.addmm(n, m, w),
            "int": torch.ones(3, 3, dtype=torch.int64) @ torch.ones(3, 3, dtype=torch.int64)}

    def calls():
        got = {"vector": x @ v, "out": torch.mm(m, w, out=torch.empty(5, 4)), "alpha": torch.addmm(n, m, w, alpha=2.0),
               "full": torch.addmm(n, m, w), "int": torch.ones(3, 3, dtype=torch.int64) @ torch.ones(3, 3, dtype=torch.int64)}
        thread = threading.Thread(target=lambda: got.setdefault("thread", torch.matmul(m, w)))
        thread.start()
        thread.join()
        got["fold"] = _project(x, w)
        return got

    got, alerts, _, errors = _run(tmp_path, calls)
    assert not errors and not alerts
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert torch.equal(got["thread"], torch.matmul(m, w)) and torch.equal(got["fold"], torch.matmul(x, w))
    assert (torch.matmul, torch.mm, torch.bmm, torch.addmm) == before
    assert not any(name in vars(torch.Tensor) for name in ("__matmul__", "matmul", "mm", "bmm")), \
        "Tensor's own methods again"

    # only the fold was checked: none of the others is a product the column sums take, or the training thread's
    (tmp_path / "again").mkdir()
    store, sensor, monitor = _monitored(tmp_path / "again")
    monitor.install()
    try:
        calls()
        checked = {key: entry.checked for (_, key), entry in monitor.budget.ops.items() if entry.checked}
        assert sensor.gemm_skipped == 5, "the vector product, out=, alpha, a full-matrix input, integers: not read"
    finally:
        monitor.remove()
        store.close("complete")
    line = _project.__code__.co_firstlineno + 1
    assert checked == {f"matmul:tests/unit/online/test_gemm_calls.py:{line} (_project)": 1}, checked


def test_a_wrong_element_of_a_folded_product_is_caught_in_the_callers_layout(tmp_path, monkeypatch):
    original = torch.Tensor.__matmul__
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 6, 16, generator=gen), torch.randn(16, 9, generator=gen)

    def faulty(a, b):
        out = original(a, b)
        if out.shape == (3, 6, 9) and getattr(faulty, "armed", False):
            out[2, 4, 7] *= -1.5  # row 2·6 + 4 = 16 of the folded (18, 9) product
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", faulty)

    def calls():
        for i in range(12):
            faulty.armed = i == 11
            _project(x + i, w)

    _, alerts, _, errors = _run(tmp_path, calls)
    raised = [a for a in alerts if a[4] == "pending"]
    assert not errors and len(raised) == 1 and raised[0][3] == "matmul", alerts
    evidence = json.loads(raised[0][5])
    assert evidence["elements"] == [[16, 7]] and evidence["shape"] == [18, 9], evidence
    assert [a[4] for a in alerts if a[4] != "pending"] == ["confirmed"]


def test_a_call_site_reads_as_the_user_wrote_it():
    from bitguard.collectors.online.gemm_calls import _shown, _unravel

    cwd = "/home/me/project"
    assert _shown("/usr/lib/python3/site-packages/transformers/pytorch_utils.py", cwd) == "transformers/pytorch_utils.py"
    assert _shown("/home/me/project/model.py", cwd) == "model.py"
    assert _shown("/elsewhere/train.py", cwd) == "train.py"
    assert _unravel(6, (4, 4)) == [1, 2] and _unravel(23, (2, 3, 4)) == [1, 2, 3] and _unravel(5, ()) == [5]
