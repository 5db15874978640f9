"""Ranks compared on a process pool give the comparison one process gives, field for field, and
find the faults planted on each rank where they were planted; a worker sends back a small
summary of its rank, and the frames it keeps are compared again in the parent when read."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import polars as pl
import pytest

import fixtures_runs as runs
from bitguard.backend import rank_pool
from bitguard.backend.compare import DEFAULT_BAND, FRAMES, compare
from bitguard.backend.ingest import open_run
from bitguard.backend.rules import RuleSet
from bitguard.cli import main
from bitguard.errors import BadInput, BitguardError

PLANTED = {1: (2, "model.layers.3"), 4: (1, "model.layers.0"), 5: (2, "model.layers.1")}  # rank: (step, boundary)


@pytest.fixture(scope="module")
def six_ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pool"))
    taints = tuple(runs.Taint(step, boundary, rank=r) for r, (step, boundary) in PLANTED.items())
    return runs.write_pair(root, "six", runs.RunSpec(layers=4, steps=4, world_size=6, taints=taints,
                                                     drop=frozenset({(3, "model.probe", "forward")})))


@pytest.fixture(scope="module")
def pooled(six_ranks):
    return compare(*six_ranks, jobs=2)  # two spawned workers: seconds


def _same_frames(got, want) -> None:
    """Every frame of rank comparison `got` (read, so compared again where it was compact) is `want`'s."""
    for name in FRAMES:
        g, w = getattr(got, name), getattr(want, name)
        if isinstance(w, pl.DataFrame):
            assert g.equals(w), (got.rank, name)
        elif name == "alignment":
            for field in ("a_idx", "b_idx", "gaps_a", "gaps_b", "reordered"):
                assert np.array_equal(getattr(g, field), getattr(w, field)), (got.rank, field)
            assert (g.anchors, g.max_window) == (w.anchors, w.max_window), got.rank
        else:
            assert g == w, (got.rank, name)


@pytest.mark.slow
def test_the_pool_gives_the_single_process_comparison_field_for_field(six_ranks, pooled, capsys):
    serial = compare(*six_ranks, jobs=1)
    assert json.dumps(pooled.to_dict(), sort_keys=True) == json.dumps(serial.to_dict(), sort_keys=True)
    assert not any(rc.frames_held for rc in pooled.ranks.values())  # the document read no frame
    for r in serial.ranks:  # the frames the explorer reads, compared again on first read
        _same_frames(pooled.ranks[r], serial.ranks[r])
        assert pooled.ranks[r].frames_held
    assert pooled.events().equals(serial.events())
    pivot = serial.ranks[4].pivot
    assert pooled.event_detail(4, "a", pivot["seq"]) == serial.event_detail(4, "a", pivot["seq"])
    documents = []
    for jobs in ("1", "2"):  # the command's document, too
        assert main(["compare", *six_ranks, "--jobs", jobs, "--json"]) == 1
        documents.append(capsys.readouterr().out)
    assert documents[0] == documents[1]


def test_a_worker_sends_back_a_small_summary_without_the_frames(tmp_path):
    a, b = runs.write_pair(str(tmp_path), "long", runs.RunSpec(layers=8, steps=60, taints=(
        runs.Taint(30, "model.layers.2"),), drop=frozenset({(50, "model.probe", "forward")})))
    task = (0, open_run(a), open_run(b), RuleSet.load(None), DEFAULT_BAND, "xor+pos", None)
    _, sent, _ = rank_pool._one(task)  # as a worker returns it
    _, whole, _ = rank_pool._one(task, compact=False)  # as one process keeps it
    assert not sent.frames_held and whole.frames_held
    assert not set(FRAMES) & set(sent.__dict__)
    frames = [f for f in (sent.summary.comm, *sent.summary.checks["a"], *sent.summary.checks["b"])]
    assert max(f.height for f in frames) == 0  # no collective, no recompute: nothing the checks read
    assert (sent.pivot, sent.summary.alignment) == (whole.pivot, whole.summary.alignment)
    small, big = len(pickle.dumps(sent)), len(pickle.dumps(whole))
    assert small < 40_000 and 20 * small < big, (small, big)
    with pytest.raises(AttributeError, match="events_a"):  # no way to compare it again: not made up
        sent.events_a


@pytest.mark.slow
def test_a_rank_file_changed_before_its_frames_are_read_is_refused(tmp_path):
    spec = runs.RunSpec(layers=2, steps=3, world_size=2, taints=(runs.Taint(1, "model.layers.1", rank=1),))
    a, b = runs.write_pair(str(tmp_path), "changed", spec)
    pooled = compare(a, b, jobs=2)
    assert pooled.verdict == "diverged"
    shutil.rmtree(b)  # re-recorded in place: another fault on rank 1
    runs.write_run(b, runs.RunSpec(layers=2, steps=3, world_size=2, taints=(runs.Taint(0, "model.layers.0", rank=1),)))
    with pytest.raises(BitguardError, match="rank 1's files changed since the comparison"):
        pooled.ranks[1].pairs
    assert pooled.ranks[0].pairs.height  # rank 0 still reads the same


@pytest.mark.slow
def test_each_planted_fault_is_the_pivot_of_its_rank_and_the_earliest_is_the_runs(pooled):
    c = pooled
    assert c.verdict == "diverged"
    for r, rc in c.ranks.items():
        if r in PLANTED:
            step, boundary = PLANTED[r]
            assert (rc.pivot["step"], rc.pivot["boundary"], rc.pivot["phase"]) == (step, boundary, "forward"), r
        else:  # the probe's forward missing at step 3 (every rank) is the first difference there
            assert (rc.pivot["step"], rc.pivot["boundary"]) == (3, "model.probe"), r
    first = c.first_divergence
    assert (first["rank"], first["step"], first["boundary"]) == (4, 1, "model.layers.0")


def test_how_many_workers(six_ranks, monkeypatch):
    a, b = (open_run(p) for p in six_ranks)
    ranks = sorted(a.ranks)
    assert rank_pool.workers_for(1, ranks, a, b) == 1
    assert rank_pool.workers_for(4, ranks, a, b) == 4
    assert rank_pool.workers_for(16, ranks, a, b) == 6  # never more workers than ranks
    assert rank_pool.workers_for(4, [0], a, b) == 1  # one rank: nothing to spread
    assert rank_pool.workers_for(None, ranks, a, b) == 1  # a small comparison stays in this process
    big = {r: rank_pool.AUTO_MIN_EVENTS for r in ranks}
    a.event_counts, b.event_counts = big, big
    monkeypatch.setattr(rank_pool, "memory_available", lambda: None)  # (not known: the cores decide)
    for n, want in ((2, 1), (4, 4), (16, 6)):  # on 2 cores one process keeps both busy: the pool is slower there
        monkeypatch.setattr(rank_pool, "cores", lambda n=n: n)
        assert rank_pool.workers_for(None, ranks, a, b) == want, n
    need = rank_pool.rank_bytes(a, b, 0)  # (the ranks' events are equal)
    assert need > 2 * rank_pool.AUTO_MIN_EVENTS * rank_pool.BYTES_PER_EVENT
    for memory, want in ((3 * need + 1, 3), (need // 2, 1), (100 * need, 6)):  # no more at once than memory holds
        monkeypatch.setattr(rank_pool, "memory_available", lambda memory=memory: memory)
        assert rank_pool.workers_for(None, ranks, a, b) == want, memory
    assert rank_pool.workers_for(4, ranks, a, b) == 4  # a number given is taken as given
    a.event_counts = {**big, 3: 10 * rank_pool.AUTO_MIN_EVENTS}  # the biggest rank sizes every worker
    monkeypatch.setattr(rank_pool, "memory_available", lambda: 3 * need)
    assert rank_pool.workers_for(None, ranks, a, b) == 1
    monkeypatch.undo()
    assert rank_pool.memory_available() is None or rank_pool.memory_available() > 0
    with pytest.raises(BadInput, match="--jobs 0"):
        rank_pool.workers_for(0, ranks, a, b)


def test_ranks_compared_in_this_process_let_go_of_their_frames_for_the_cli(six_ranks, monkeypatch, capsys):
    """The command reads no frame: each rank compared here lets go of its frames once compared, so
    a run of many ranks takes the memory of its biggest, not of all (8 ranks of 100 k events a
    side: 1,309 MiB before, 494 MiB after); the document is the same and no rank is compared twice."""
    from bitguard.backend import compare as compare_mod

    serial = compare(*six_ranks, jobs=1)
    compared, inner = [], compare_mod._compare_rank
    monkeypatch.setattr(compare_mod, "_compare_rank", lambda *args: compared.append(args[0]) or inner(*args))
    light = compare(*six_ranks, jobs=1, frames=False)
    assert not any(rc.frames_held for rc in light.ranks.values())
    assert json.dumps(light.to_dict(), sort_keys=True) == json.dumps(serial.to_dict(), sort_keys=True)
    assert sorted(compared) == sorted(serial.ranks)  # the document compared no rank again
    _same_frames(light.ranks[4], serial.ranks[4])  # a frame read later: that rank compared again
    assert compared.count(4) == 2 and light.ranks[4].frames_held
    asked = []
    monkeypatch.setattr(compare_mod, "compare", lambda *args, **kwargs: asked.append(kwargs) or light)
    assert main(["compare", *six_ranks, "--json"]) == 1
    assert asked[0]["frames"] is False and json.loads(capsys.readouterr().out)["verdict"] == "diverged"


def test_the_cli_takes_jobs_and_refuses_nonsense(six_ranks, capsys):
    assert main(["compare", *six_ranks, "--jobs", "1", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "diverged"
    assert main(["compare", *six_ranks, "--jobs", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--jobs 0" in err


# (world size, {rank: (step, boundary) of its planted fault}, the run's first divergence's rank, ranks
# whose frames are read again): 64 ranks took 120 s of the default tiers' time, 16 show the same
RAY_CLUSTERS = [
    pytest.param(16, {5: (1, "model.layers.1"), 9: (0, "model.layers.0"), 15: (2, "model.layers.1")}, 9, (5, 9, 12),
                 id="16-ranks"),
    pytest.param(64, {7: (1, "model.layers.1"), 33: (0, "model.layers.0"), 63: (2, "model.layers.1")}, 33, (7, 33, 40),
                 id="64-ranks", marks=pytest.mark.extended),
]


@pytest.mark.slow
@pytest.mark.parametrize("world, plant, first_rank, reread", RAY_CLUSTERS)
def test_many_ranks_on_a_local_ray_cluster_give_the_single_process_comparison(tmp_path, world, plant, first_rank,
                                                                               reread):
    ray = pytest.importorskip("ray")
    a, b = runs.write_pair(str(tmp_path), f"r{world}", runs.RunSpec(layers=2, steps=3, world_size=world, taints=tuple(
        runs.Taint(step, boundary, rank=r) for r, (step, boundary) in plant.items())))
    serial = compare(a, b, jobs=1)
    ray.init(num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        on_ray = compare(a, b, ray="auto")
    finally:
        ray.shutdown()
    assert json.dumps(on_ray.to_dict(), sort_keys=True) == json.dumps(serial.to_dict(), sort_keys=True)
    assert not any(rc.frames_held for rc in on_ray.ranks.values())
    for r in reread:  # frames read: the rank compared again here
        _same_frames(on_ray.ranks[r], serial.ranks[r])
    assert {r: (rc.pivot["step"], rc.pivot["boundary"]) for r, rc in on_ray.ranks.items() if rc.pivot} == plant
    first = on_ray.first_divergence
    assert (first["rank"], first["step"], first["boundary"]) == (first_rank, 0, "model.layers.0")


def test_ray_without_a_cluster_is_a_clear_error(six_ranks, capsys):
    pytest.importorskip("ray")
    assert main(["compare", *six_ranks, "--ray", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--ray 127.0.0.1:1" in err and "ray start" in err
