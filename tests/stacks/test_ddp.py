"""DistributedDataParallel on two gloo ranks: the stacks tier's four claims (see harness.py), with
DDP's bucketed all-reduce observed as `comm` events (collectors/comm.py), both through DDP's own
reduction and through a user's comm hook."""

import polars as pl
import pytest

from bitguard.backend.ingest import load_rank, open_run

from . import harness as h

MODULE_FAULT = {"STACK_FAULT": "module:rank=1:step=2"}
ALLREDUCE_FAULT = {"STACK_FAULT": "allreduce:rank=0:step=2"}
HOOK = ("--comm-hook",)
PARAMS = {f"{m}.{p}" for m in ("body.0", "body.2", "head") for p in ("weight", "bias")}  # ddp.py's Net


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    got = h.together({
        "plain": lambda: h.plain("ddp.py", tmp, nproc=2),
        "plain_hook": lambda: h.plain("ddp.py", tmp, *HOOK, nproc=2, name="plain-hook"),
        "a": lambda: h.recorded("ddp.py", tmp / "a", nproc=2),
        "b": lambda: h.recorded("ddp.py", tmp / "b", nproc=2),
        "module": lambda: h.recorded("ddp.py", tmp / "module", nproc=2, env=MODULE_FAULT),
        "hook": lambda: h.recorded("ddp.py", tmp / "hook", *HOOK, nproc=2),
        "allreduce": lambda: h.recorded("ddp.py", tmp / "allreduce", *HOOK, nproc=2, env=ALLREDUCE_FAULT)})
    out = {"plain": got["plain"], "plain_hook": got["plain_hook"]}
    out["a"], out["ra"] = got["a"]
    out["b"], _ = got["b"]
    out["module"], _ = got["module"]
    out["hook"], out["rhook"] = got["hook"]
    out["allreduce"], _ = got["allreduce"]
    return out


def _comm(run, rank):
    events, tensors, _ = load_rank(open_run(run), rank)
    return events, tensors, events.filter(pl.col("phase") == "comm")


def test_records_unedited_and_numbers_unchanged(runs):
    h.assert_unchanged(runs["plain"], runs["ra"])  # DDP's own reduction, observed by an equivalent hook
    h.assert_unchanged(runs["plain_hook"], runs["rhook"])  # a user's comm hook, observed around it
    for run in ("a", "hook"):
        m = h.manifest(runs[run])
        assert m["status"] == "complete" and not m["collector_errors"] and m["steps_completed"] == 4, m


def test_buckets_and_collectives_are_comm_events(runs):
    for rank in (0, 1):
        events, tensors, comm = _comm(runs["a"], rank)
        assert set(comm["module_type"]) == {"allreduce_mean"}
        assert {b.rpartition("#")[0] for b in comm["boundary"]} >= {"comm.ddp_bucket0", "comm.ddp_bucket1"}
        assert {b.rpartition("#")[2] for b in comm["boundary"]} == {"0-1"}
        # a bucket: one input and one output row per parameter in it, named by the parameter
        rows = tensors.filter(pl.col("seq").is_in(comm["seq"].implode()))
        per_event = rows.group_by("seq", "role").agg(pl.col("path").sort())
        names = {p.rpartition("@")[0] for p in rows["path"]}
        assert names == {f"['module.{n}']" for n in PARAMS}
        for seq in comm["seq"]:
            mine = per_event.filter(pl.col("seq") == seq).sort("role")
            assert mine["role"].to_list() == ["input", "output"] and mine["path"][0].to_list() == mine["path"][1].to_list()
        # every optimizer step event holds the gradient step() used, after the all-reduce
        steps = events.filter(pl.col("kind") == "step")
        grads = tensors.filter(pl.col("seq").is_in(steps["seq"].implode()) & (pl.col("role") == "grad"))
        assert grads.height == steps.height > 0
        _, _, hooked = _comm(runs["hook"], rank)
        assert {"flipping_allreduce_hook", "sum"} == set(hooked["module_type"])  # the bucket, and the hook's all_reduce


def test_rerun_identical_and_in_run_check_clean(runs):
    code, doc = h.compare(runs["a"], runs["b"])
    assert (code, doc["verdict"]) == (0, "identical"), doc.get("inconclusive") or doc.get("first_divergence")
    returncode, check = h.check(runs["a"])
    crossrank = next(c for c in check["checks"] if c["name"] == "crossrank")
    assert (returncode, check["verdict"]) == (0, "clean") and crossrank["compared"] >= 7, check


def test_module_fault_on_rank_1_is_localized(runs):
    code, doc = h.compare(runs["a"], runs["module"])
    assert code == 1
    h.assert_localized(doc, step=2, rank=1, boundary="module.body.0", blame="source", fault_class="forward")


def test_rank_0_alone_does_not_blame_its_optimizer_or_claim_the_group_matched(runs):
    """Rank 0 sees the fault of rank 1 first in the all-reduce: its own inputs matched, and rank 1
    was not compared; the blame says so instead of the optimizer's 'its gradient matched'."""
    code, doc = h.compare(runs["a"], runs["module"], "--rank", "0")
    fd = h.assert_localized(doc, step=2, rank=0, boundary=("comm.ddp_bucket0#0-1", "comm.ddp_bucket1#0-1"),
                            fault_class="comm")
    detail = fd["blame_window"]["detail"]
    assert "rank(s) 1 of the group were not compared" in detail, detail
    assert "optimizer update computed differently" not in detail


def test_corrupted_allreduce_is_localized_to_the_comm_event(runs):
    code, doc = h.compare(runs["hook"], runs["allreduce"])
    assert code == 1
    fd = h.assert_localized(doc, step=2, rank=0, boundary="comm.ddp_bucket0#0-1", blame="source",
                            fault_class="comm")
    assert "matched on every rank of its group (0, 1)" in fd["blame_window"]["detail"]
    # the flipped first element of bucket 0 is module.head.bias's (DDP buckets the last parameters first)
    assert [(t["role"], t["path"]) for t in fd["tensors"] if t["differs"]] == [("output", "['module.head.bias']@0")]


def test_cross_rank_check_names_rank_0(runs):
    returncode, doc = h.check(runs["allreduce"])
    assert (returncode, doc["verdict"]) == (1, "findings"), doc
    first = doc["findings"][0]
    assert (first["check"], first["rank"], first["step"], first["boundary"]) == \
        ("crossrank", 0, 2, "comm.ddp_bucket0#0-1"), first
    assert first["against"]["rank"] == 1


@pytest.mark.parametrize("nproc,args,observed", [
    pytest.param(3, (), True, marks=pytest.mark.extended),
    pytest.param(2, ("--bucket-view",), True, marks=pytest.mark.extended),
    pytest.param(3, ("--bucket-view",), False, marks=pytest.mark.extended)],
    ids=["3-ranks", "bucket-view", "3-ranks-bucket-view"])
def test_ddp_reduction_observed_only_where_it_is_reproduced_bitwise(tmp_path, nproc, args, observed):
    """The observing hook multiplies by 1/world_size as DDP's reducer does; for a gradient that is a
    view of its bucket the reducer divides instead, the same bitwise only for a power-of-two world
    size: with 3 ranks and gradient_as_bucket_view the reduction is left alone, unobserved."""
    got = h.together({"plain": lambda: h.plain("ddp.py", tmp_path, *args, nproc=nproc),
                      "run": lambda: h.recorded("ddp.py", tmp_path / "run", *args, nproc=nproc)})
    plain, (run, result) = got["plain"], got["run"]
    h.assert_unchanged(plain, result)
    events, tensors, comm = _comm(run, nproc - 1)
    assert (comm.height > 0) == observed and set(comm["module_type"]) <= {"allreduce_mean"}
    steps = events.filter(pl.col("kind") == "step")
    assert tensors.filter(pl.col("seq").is_in(steps["seq"].implode()) & (pl.col("role") == "grad")).height == \
        steps.height > 0  # the reduced gradients, as step() used them, either way
