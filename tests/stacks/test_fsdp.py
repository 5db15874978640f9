"""FSDP1 (both parameter modes) and FSDP2 on two gloo ranks: the stacks tier's four claims (see
harness.py), plus what sharding asks of the recorder: steps advance, and gradient and optimizer
events exist under the original parameters' names, each row saying which part of the tensor
this rank holds."""

import polars as pl
import pytest

from bitguard.backend.ingest import load_rank, open_run

from . import harness as h

FAULT = {"STACK_FAULT": "module:rank=1:step=2"}
PARAMS = {f"{m}.{p}" for m in ("body.0", "body.2", "head") for p in ("weight", "bias")}
STACKS = {"fsdp1": ("fsdp1.py",), "fsdp1-orig-params": ("fsdp1.py", "--orig-params"), "fsdp2": ("fsdp2.py",)}


# FSDP2 in the default tiers; FSDP1 (both parameter modes, one flat-parameter split) is extended
@pytest.fixture(scope="module", params=[pytest.param(s, marks=pytest.mark.extended) if s.startswith("fsdp1") else s
                                        for s in STACKS])
def runs(request, tmp_path_factory):
    script, *args = STACKS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    got = h.together({"plain": lambda: h.plain(script, tmp, *args, nproc=2),
                      "a": lambda: h.recorded(script, tmp / "a", *args, nproc=2),
                      "b": lambda: h.recorded(script, tmp / "b", *args, nproc=2),
                      "fault": lambda: h.recorded(script, tmp / "fault", *args, env=FAULT, nproc=2)})
    plain, (a, ra), (b, _), (fault, _) = (got[k] for k in ("plain", "a", "b", "fault"))
    return {"stack": request.param, "plain": plain, "a": a, "ra": ra, "b": b, "fault": fault}


def _events(run, rank: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    events, tensors, _ = load_rank(open_run(run), rank)
    return events, tensors


def test_records_unedited_and_numbers_unchanged(runs):
    h.assert_unchanged(runs["plain"], runs["ra"])
    m = h.manifest(runs["a"])
    assert m["status"] == "complete" and not m["collector_errors"], m["collector_errors"]
    assert m["steps_completed"] == 4 and m["world_size"] == 2


def test_steps_advance_and_sharded_parameters_have_gradient_and_step_events_under_their_names(runs):
    stepped = {s: set() for s in range(4)}  # parameters some rank holds a part of: a step event there
    for rank in (0, 1):
        events, tensors = _events(runs["a"], rank)
        assert sorted(events.filter(pl.col("phase") != "optimizer")["step"].unique().to_list()) == [0, 1, 2, 3]
        wrapped = pl.col("boundary").cast(pl.String).str.contains("_flat_param|_fsdp_wrapped_module")
        assert not events.filter(wrapped).height
        grads = events.filter(pl.col("kind") == "grad").group_by("step").agg(pl.col("boundary"))
        assert {r["step"]: set(r["boundary"]) for r in grads.iter_rows(named=True)} == {s: PARAMS for s in range(4)}
        steps = events.filter(pl.col("kind") == "step")
        for r in steps.group_by("step").agg(pl.col("boundary")).iter_rows(named=True):
            stepped[r["step"]] |= set(r["boundary"])
        # the post-step parameter rows say which part of the parameter this rank holds
        params = tensors.filter(pl.col("role") == "param").join(steps.select("seq", "boundary"), on="seq")
        head = params.filter(pl.col("boundary") == "head.weight")
        assert head.height == 4 and set(map(tuple, head["shape"].to_list())) == {(5, 32)}
        expected = "DTensor Shard(dim=0) on mesh (2,) at " if runs["stack"] == "fsdp2" else "FSDP FlatParameter shard: "
        assert all(s.startswith(expected) for s in head["shard"].to_list()), head["shard"].to_list()
    assert stepped == {s: PARAMS for s in range(4)}


def test_rerun_identical(runs):
    h.assert_identical(runs["a"], runs["b"])


def test_fault_localized(runs):
    h.assert_compare_localizes(runs["a"], runs["fault"], step=2, rank=1, boundary="body.0", blame="source",
                               fault_class="forward")


@pytest.mark.extended
def test_explicit_prefetching_compares_identical(runs, tmp_path):
    """FSDP2 with each unit prefetching the next ones' weights issues the same all-gathers in
    another order: it computed the same. (This model's units differ in size, so their gathers'
    keys already tell them apart; gathers of one size, paired by content, and gathers counted in
    the step before are tests/unit/backend/test_content_pairs.py's.)"""
    if runs["stack"] != "fsdp2":
        pytest.skip("explicit prefetching is FSDP2's")
    prefetched, _ = h.recorded("fsdp2.py", tmp_path / "prefetch", "--prefetch", nproc=2)
    h.assert_identical(runs["a"], prefetched)
