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


def test_the_headline_of_an_incomplete_op_trace_says_the_replays_reproduced(tmp_path):
    """Helper 92 (selective activation checkpointing, which the op tracer cannot follow): the headline read
    "not reproduced" over a detail saying both replays reproduced their records."""
    from bitguard.backend.report import render_drill

    doc = {"verdict": "not_reproduced", "window": {"boundary": "b", "module_type": "Block", "call": 0, "why": "w"},
           "boundary_pivot": {"step": 2, "rank": 0, "phase": "backward", "boundary": "b", "blame": "source"},
           "replay": _not_reproduced(_replays(tmp_path), _checks(True), ["run A's op trace is incomplete: x"]),
           "records": {"a": "ra", "b": "rb"}, "op_pivot": None}
    headline = render_drill(doc).splitlines()[1]
    assert headline == ("bitguard drill: not reproduced — the op trace is incomplete; both replays reproduced their "
                        "records"), headline
