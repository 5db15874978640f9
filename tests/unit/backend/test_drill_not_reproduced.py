"""backend/drill.py `_not_reproduced`: a drill whose replays both reproduced their records, and whose op trace
alone is incomplete, says the tracer failed, not that the runs are nondeterministic (helper 87: torchvision's
roi_heads, whose calls the op tracer could not follow, read "nondeterminism or a changed environment")."""

from __future__ import annotations

from types import SimpleNamespace

from bitguard.backend.drill import NOT_REPRODUCED, TRACE_INCOMPLETE, _not_reproduced


def _checks(reproduced_b: bool) -> dict:
    side = {"reproduced": True, "compared": 7, "notes": [], "detail": ""}
    return {"a": dict(side), "b": {**side, "reproduced": reproduced_b, "detail": "event 4 differs"}}


def _replays(tmp_path) -> list:
    return [SimpleNamespace(side=s, exit_status=0, timed_out=False, out=tmp_path / s, log=None) for s in ("a", "b")]


def test_an_incomplete_op_trace_of_reproduced_replays_is_the_tracers_failure(tmp_path):
    problem = "run A's op trace is incomplete: op tracer at torch.Tensor.__getitem__: RuntimeError: ..."
    doc = _not_reproduced(_replays(tmp_path), _checks(True), [problem])
    assert doc["cause"] == "op_trace" and doc["reproduced"] is False, doc
    assert doc["detail"].startswith(TRACE_INCOMPLETE) and problem in doc["detail"], doc["detail"]
    assert "nondeterminism or a changed environment" not in doc["detail"]


def test_a_replay_that_differs_from_its_record_is_still_not_reproduced(tmp_path, monkeypatch):
    monkeypatch.setattr("bitguard.backend.replay.log_tail", lambda r: "")
    doc = _not_reproduced(_replays(tmp_path), _checks(False), [])
    assert doc["cause"] == "replay" and doc["detail"].startswith(NOT_REPRODUCED), doc
