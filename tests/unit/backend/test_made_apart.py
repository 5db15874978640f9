"""params_blame.made_apart: a consumer or data pivot whose step's optimizer holds parameters that already differ
before its first update, no params event before the pivot, is blamed on how the weights were made."""

import polars as pl

from bitguard.backend.params_blame import made_apart

BLAME = {"blame": "consumer", "fault_class": "backward", "differing_roles": ["grad_output"],
         "blame_window": {"module": None, "detail": "by the loss"}}


def _events(first_params_seq: int | None) -> pl.DataFrame:
    rows = [(4, 0, "backward", "module", "transform"), (10, 0, "optimizer", "params", "Adam (before its first step)")]
    if first_params_seq is not None:
        rows.append((first_params_seq, 0, "optimizer", "params", "GP"))
    return pl.DataFrame(rows, schema=["seq", "step", "phase", "kind", "boundary"], orient="row")


def _diffs(differs: bool) -> pl.DataFrame:
    return pl.DataFrame({"a_seq": [10, 10], "role": ["param", "param"], "path": [".raw", ".constant"],
                         "differs": [False, differs], "ignored": [False, False]})


def test_weights_no_module_call_observed_made_apart_are_blamed_there():
    """Helper 83 (gpytorch: a model called past nn.Module's call, its mean's constant set to 0.3): the pivot, the
    backward of a Softplus the model calls, said the gradient came "by the loss"."""
    pivot = {"seq": 4, "step": 0}
    got = made_apart(BLAME, pivot, _events(None), _diffs(True))
    assert (got["blame"], got["fault_class"], got["blame_window"]["module"]) == \
        ("source", "params", "Adam (before its first step)"), got
    assert "the parameters Adam holds (constant) already differ before its first update" in got["blame_window"]["detail"]
    assert "(consumer: by the loss)" in got["blame_window"]["detail"]
    assert made_apart(BLAME, pivot, _events(None), _diffs(False)) is BLAME  # (equal weights)
    assert made_apart(BLAME, pivot, _events(2), _diffs(True)) is BLAME  # (a params event saw them)
