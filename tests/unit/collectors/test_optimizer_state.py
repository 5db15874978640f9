"""An optimizer whose `state` holds None for a parameter (ZeroRedundancyOptimizer after
`load_state_dict`, for the parameters another rank's shard steps) records its step without a
collector error: the error made two identical reruns of a two-rank ZeRO training compare
inconclusive (helper 63). The parameters and gradients of such a step are still recorded."""

from __future__ import annotations

import torch
import torch.nn as nn

import bitguard
from bitguard.backend.ingest import load_rank, open_run
from recorded import collector_errors


def _train(path, lr: float = 0.1) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # (without momentum: SGD never reads its state)
    with bitguard.record(path, determinism=False):
        for step in range(3):
            if step == 1:
                opt.state[model[0].weight] = None  # (as ZeroRedundancyOptimizer leaves another rank's parameters)
            opt.zero_grad()
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()


def test_a_step_whose_state_holds_none_is_recorded_without_a_collector_error(tmp_path):
    for name, lr in (("a", 0.1), ("b", 0.1), ("c", 0.2)):
        _train(tmp_path / name, lr)
    assert collector_errors(tmp_path / "a") == []
    events, tensors, _ = load_rank(open_run(tmp_path / "a"), 0)
    steps = events.filter((events["kind"] == "step") & (events["boundary"] == "0.weight"))
    assert steps.height == 3, steps
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    assert bitguard.compare(tmp_path / "a", tmp_path / "c").verdict == "diverged"
