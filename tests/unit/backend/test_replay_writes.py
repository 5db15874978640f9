"""A drill's replays run the training's script again in its folder: what it writes there (checkpoints, a
`latest` pointer) it writes again, over what the training left. The drill says which files (helper 59:
mmengine's `last_checkpoint` pointed back at epoch 1 after a drill, and a resume from that folder would
have restarted there)."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

from bitguard.backend import replay


def test_the_files_a_replay_wrote_in_the_training_s_folder_are_named(tmp_path):
    work = tmp_path / "work"
    (work / "ckpt").mkdir(parents=True)
    (work / "ckpt" / "latest").write_text("step_5.pt\n")
    (work / "data.txt").write_text("kept\n")
    os.utime(work / "ckpt" / "latest", ns=(1, 1))
    code = "import pathlib; pathlib.Path('ckpt/latest').write_text('step_1.pt\\n'); pathlib.Path('ckpt/step_1.pt').write_text('x')"
    r = replay.Replay("a", types.SimpleNamespace(manifest={}), tmp_path / "drill" / "a", [sys.executable, "-c", code],
                      str(work), dict(os.environ))
    replay.run([r], timeout=60)
    assert r.exit_status == 0
    said = [n for n in r.notes if "wrote there" in n]
    assert len(said) == 1 and "ckpt/latest, ckpt/step_1.pt;" in said[0], r.notes
    assert "data.txt" not in said[0]


def test_a_folder_of_too_many_files_is_not_looked_through(tmp_path, monkeypatch):
    monkeypatch.setattr(replay, "FILES_LOOKED_AT", 3)
    for i in range(5):
        Path(tmp_path, f"f{i}").write_text("")
    assert replay._files(str(tmp_path)) is None and replay._written(None, {}) == []


def test_the_drill_s_own_records_inside_the_training_s_folder_are_not_named(tmp_path):
    """Helper 65: `bitguard drill A B --out found` run in the script's folder listed the replays' own records
    (found/a/step-0-rank-0/manifest.json) as files the training wrote."""
    work = tmp_path / "work"
    work.mkdir()
    out = work / "found" / "a" / "step-0-rank-0"
    code = (f"import pathlib; p = pathlib.Path({str(out)!r}); p.mkdir(parents=True, exist_ok=True); "
            "(p / 'manifest.json').write_text('{}'); (p / 'ops-rank-0.json').write_text('[]'); "
            "pathlib.Path('ckpt.pt').write_text('x')")
    r = replay.Replay("a", types.SimpleNamespace(manifest={}), out, [sys.executable, "-c", code], str(work),
                      dict(os.environ))
    replay.run([r], timeout=60)
    assert r.exit_status == 0
    said = [n for n in r.notes if "wrote there" in n]
    assert len(said) == 1 and "ckpt.pt;" in said[0] and "found" not in said[0], r.notes


def test_a_replay_of_a_transformer_layer_s_fast_path_is_said_to_differ_by_the_tracing(tmp_path):
    """Helper 71: a TransformerEncoderLayer evaluated under no_grad takes its fast path, which any torch
    function mode (the drill's op tracer) turns off: the replay then computed it another way, and the
    drill said "nondeterminism or a changed environment". The check names the fast path."""
    import torch
    from torch.overrides import TorchFunctionMode

    import bitguard
    from bitguard.backend.ingest import open_run

    class Passing(TorchFunctionMode):  # (a mode that changes nothing but being on)
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def evaluate(out, traced):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True).eval()
        x = torch.randn(2, 5, 8)
        with bitguard.record(out, determinism=False), torch.no_grad():
            if traced:
                with Passing():
                    layer(x)
            else:
                layer(x)

    evaluate(tmp_path / "record", False)
    evaluate(tmp_path / "replay", True)
    got = replay.check(open_run(tmp_path / "record"), tmp_path / "replay", 0, 0, None)
    assert not got["reproduced"] and got["first"]["module_type"] == "TransformerEncoderLayer", got
    assert "takes its inference fast path" in got["detail"], got["detail"]
