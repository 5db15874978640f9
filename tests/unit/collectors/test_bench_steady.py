"""benchmarks/recording_steady.py's paused blocks run as the plain script would: nothing recorded,
the step counter still, the user's settings in force; the recording goes on after them, with
bitguard's settings back. Its plain arm is only plain if this holds."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import bench_recording  # noqa: E402
import recording_steady  # noqa: E402


def _step(net, opt, x):
    opt.zero_grad(set_to_none=True)
    net(x).sum().backward()
    opt.step()


def test_a_paused_block_records_nothing_and_runs_with_the_users_settings(tmp_path):
    before = bench_recording.settings_now()  # another test's recording in this process may have left them on
    torch.use_deterministic_algorithms(False)
    try:
        _paused_block(tmp_path)
    finally:
        bench_recording.restore_settings(before)


def _paused_block(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    assert not torch.are_deterministic_algorithms_enabled()
    with bench_recording.recorded(tmp_path / "run", "full", True) as stack:
        collector = stack.rec.collector
        _step(net, opt, x)
        assert torch.are_deterministic_algorithms_enabled(), "bitguard's controls are on while recording"
        seq, step = collector._seq, collector.step
        with recording_steady.Paused(stack):
            assert not torch.are_deterministic_algorithms_enabled(), "a paused step runs with the user's settings"
            for _ in range(3):
                _step(net, opt, x)
            assert collector._seq == seq and not collector._queued, "nothing recorded while paused"
            assert collector.step == step
        assert torch.are_deterministic_algorithms_enabled(), "bitguard's settings come back on resuming"
        _step(net, opt, x)
        assert collector._seq > seq, "the recording goes on after the pause"
        assert collector.step == step + 1
        assert not collector.errors
    assert not torch.are_deterministic_algorithms_enabled(), "the user's settings after the recording"
