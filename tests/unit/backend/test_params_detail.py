"""What a `params` pivot says of its parameters: new ones (never stepped) apart from those an
optimizer stepped before, whatever the root they are named from (backend/pivot.py)."""

from __future__ import annotations

import polars as pl

from bitguard.backend.pivot import _params_detail


def _detail(stepped: list[str], differing: str) -> str:
    events = pl.DataFrame({"seq": list(range(len(stepped))) + [9], "phase": ["optimizer"] * (len(stepped) + 1),
                           "kind": ["step"] * len(stepped) + ["params"], "boundary": stepped + ["actor"]})
    diffs = pl.DataFrame({"a_seq": [9, 9], "role": ["param", "param"], "path": [f".{differing}", ".other"],
                          "differs": [True, False]})
    return _params_detail({"seq": 9, "call": 0, "step": 3}, events, diffs)


def test_a_parameter_stepped_under_its_model_s_name_is_not_new():
    """Helper 18: PPO calls `agent.actor` alone: its params event names `2.weight`, its optimizer events
    `actor.2.weight`, and a weight Adam had stepped every step was said to be new to the training."""
    assert _detail(["actor.2.weight"], "2.weight").startswith("the parameters differ at the start of this step "
                                                             "although every optimizer step before matched")
    assert _detail(["actor.0.weight"], "2.weight").startswith("2.weight differs at the start of this step, and no "
                                                             "optimizer step before updated them")
