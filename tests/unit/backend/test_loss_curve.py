"""The loss curve (backend/loss_curve.py): values read from one-element digests, the steps where the
losses part, and the honest "no scalar loss recorded" when none is known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import bitguard
import fixtures_runs
from bitguard.backend import loss_curve
from bitguard.cuda.reference import digest_tensor_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_one_element_digest_decodes_to_its_value(dtype):
    values = [1.5, -0.3, 2.0 ** -20, 65000.0, float("nan"), float("inf")]
    for shape in ((), (1,), (1, 1)):
        tensors = [torch.tensor(v, dtype=dtype).reshape(shape) for v in values]
        xors = np.array([digest_tensor_reference(t)[0] for t in tensors], dtype=np.uint64)
        got = loss_curve.decode(xors, str(dtype).removeprefix("torch."))
        want = [t.double().item() for t in tensors]
        for g, w in zip(got, want):
            assert (math.isnan(g) and math.isnan(w)) or g == w, (dtype, shape, got, want)


@pytest.fixture(scope="module")
def drifting(tmp_path_factory):
    """Block 1 diverges at step 2; the suspect's loss drifts by 1e-6 x 8^k after it."""
    spec = fixtures_runs.RunSpec(layers=3, steps=8, scalar_loss=True, taints=(fixtures_runs.Taint(2, "model.layers.1"),))
    return bitguard.compare(*fixtures_runs.write_pair(str(tmp_path_factory.mktemp("loss")), "drift", spec))


def test_the_curve_marks_the_first_step_that_differs_and_the_first_over_the_threshold(drifting):
    fd = drifting.to_dict()["first_divergence"]
    doc = loss_curve.curve(drifting.ranks[0], fd)
    assert doc["schema"] == "bitguard.loss_curve/1" and doc["unknown"] is None
    assert doc["source"] == {"boundary": "Net", "module_type": "Net", "idx": 0, "path": "", "dtype": "float32"}
    assert [s["step"] for s in doc["steps"]] == list(range(8))
    assert doc["steps"][0]["a"] == pytest.approx(2.6) and doc["steps"][0]["equal"]
    assert (doc["pivot_step"], doc["first_differs"], doc["first_over"]) == (2, 2, 6)
    assert (doc["lead_differs"], doc["lead_over"]) == (0, 4)
    step = doc["steps"][5]  # 1e-6 x 8^3 = 5.1e-4 apart: differs, not over
    assert not step["equal"] and 0 < abs(step["a"] - step["b"]) <= 1e-3


def test_no_scalar_output_says_so_and_names_the_root(gap_then_divergence):
    doc = loss_curve.curve(gap_then_divergence.ranks[1], gap_then_divergence.to_dict()["first_divergence"])
    assert doc["source"] is None and doc["steps"] == [] and doc["first_over"] is None
    assert doc["unknown"].startswith("no scalar loss recorded: ") and "(Net)" in doc["unknown"]


def _functional_loss_run(out, bump_at: int | None, scaled: bool):
    """A loop whose loss is F.mse_loss outside every module (no root module returns it): its curve
    comes from the value backward() was called on, in the run's API events."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=scaled)
    losses = []
    with bitguard.record(out):
        for step in range(4):
            opt.zero_grad()
            x = torch.randn(4, 3) + (1.0 if step == bump_at else 0.0)
            loss = torch.nn.functional.mse_loss(model(x), torch.ones(4, 1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("scaled", [False, True])
def test_without_a_scalar_output_the_loss_is_what_backward_was_called_on(tmp_path, scaled):
    la = _functional_loss_run(tmp_path / "a", None, scaled)
    lb = _functional_loss_run(tmp_path / "b", 2, scaled)
    cmp = bitguard.compare(tmp_path / "a", tmp_path / "b")
    doc = loss_curve.curve(cmp.ranks[0], cmp.to_dict()["first_divergence"], runs=(cmp.run_a, cmp.run_b))
    assert doc["unknown"] is None and doc["source"]["boundary"] == "backward" and doc["source"]["api"] is True
    assert [s["a"] for s in doc["steps"]] == la  # unscaled: GradScaler's power-of-two scale divides exactly
    assert [s["b"] for s in doc["steps"]] == lb
    assert [s["equal"] for s in doc["steps"]] == [True, True, False, False]
    assert doc["first_differs"] == 2
    # without the runs (or with runs recorded before API events) it still says why there is no curve
    assert loss_curve.curve(cmp.ranks[0])["unknown"].startswith("no scalar loss recorded: ")
