"""torch.jit.trace under the recorder: the module calls a trace runs are its graph's, and the recorder's own
ops (digests, version reads, RNG reads) would go into it. Helper 66: tracing a module with a submodule failed
under `bitguard record` ("Graphs differed across invocations"), and a TracerWarning was said at a line of
bitguard's. The recorder stands aside while torch.jit traces; the traced module, once trained, is observed."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

import bitguard


class T(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


def _train(path, lr: float) -> list[str]:
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with bitguard.record(path, determinism=False):
            traced = torch.jit.trace(T(), torch.randn(2, 4))
            opt = torch.optim.SGD(traced.parameters(), lr=lr)
            for _ in range(2):
                opt.zero_grad()
                traced(torch.randn(3, 4)).pow(2).mean().backward()
                opt.step()
    return [str(w.filename) for w in said if "bitguard" in str(w.filename)]


def test_a_module_traced_under_the_recorder_traces_and_trains_as_without_it(tmp_path):
    for name, lr in (("a", 0.1), ("b", 0.1), ("c", 0.2)):
        assert _train(tmp_path / name, lr) == []
    assert bitguard.compare(tmp_path / "a", tmp_path / "b").verdict == "identical"
    assert bitguard.compare(tmp_path / "a", tmp_path / "c").verdict == "diverged"


def test_a_module_traced_under_the_online_monitor_leaves_no_collector_error(tmp_path):
    """The online sensors stand aside too: their sums of a traced matmul were traced values, which the
    writer could not store (two collector errors)."""
    from recorded import collector_errors

    torch.manual_seed(0)
    with bitguard.record(tmp_path / "run", mode="online", determinism=False):
        traced = torch.jit.trace(T(), torch.randn(2, 4))
        traced(torch.randn(3, 4)).pow(2).mean().backward()
    assert collector_errors(tmp_path / "run") == []
