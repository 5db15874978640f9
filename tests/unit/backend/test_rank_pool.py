"""Ranks compared on a process pool give the comparison one process gives, field for field, and
find the faults planted on each rank where they were planted."""

from __future__ import annotations

import json

import pytest

import fixtures_runs as runs
from bitguard.backend import rank_pool
from bitguard.backend.compare import compare
from bitguard.backend.ingest import open_run
from bitguard.cli import main
from bitguard.errors import BadInput

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


@pytest.mark.slow
def test_the_pool_gives_the_single_process_comparison_field_for_field(six_ranks, pooled):
    serial = compare(*six_ranks, jobs=1)
    assert json.dumps(pooled.to_dict(), sort_keys=True) == json.dumps(serial.to_dict(), sort_keys=True)
    for r in serial.ranks:  # the frames the explorer reads, too
        assert pooled.ranks[r].pairs.equals(serial.ranks[r].pairs)
        assert pooled.ranks[r].diffs.equals(serial.ranks[r].diffs)
        assert pooled.ranks[r].gaps.equals(serial.ranks[r].gaps)


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
    for n, want in ((2, 1), (4, 4), (16, 6)):  # on 2 cores one process keeps both busy: the pool is slower there
        monkeypatch.setattr(rank_pool, "cores", lambda n=n: n)
        assert rank_pool.workers_for(None, ranks, a, b) == want, n
    with pytest.raises(BadInput, match="--jobs 0"):
        rank_pool.workers_for(0, ranks, a, b)


def test_the_cli_takes_jobs_and_refuses_nonsense(six_ranks, capsys):
    assert main(["compare", *six_ranks, "--jobs", "1", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "diverged"
    assert main(["compare", *six_ranks, "--jobs", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--jobs 0" in err


@pytest.mark.slow
def test_64_ranks_on_a_local_ray_cluster_give_the_single_process_comparison(tmp_path):
    ray = pytest.importorskip("ray")
    plant = {7: (1, "model.layers.1"), 33: (0, "model.layers.0"), 63: (2, "model.layers.1")}
    a, b = runs.write_pair(str(tmp_path), "r64", runs.RunSpec(layers=2, steps=3, world_size=64, taints=tuple(
        runs.Taint(step, boundary, rank=r) for r, (step, boundary) in plant.items())))
    serial = compare(a, b, jobs=1)
    ray.init(num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        on_ray = compare(a, b, ray="auto")
    finally:
        ray.shutdown()
    assert json.dumps(on_ray.to_dict(), sort_keys=True) == json.dumps(serial.to_dict(), sort_keys=True)
    assert {r: (rc.pivot["step"], rc.pivot["boundary"]) for r, rc in on_ray.ranks.items() if rc.pivot} == plant
    first = on_ray.first_divergence
    assert (first["rank"], first["step"], first["boundary"]) == (33, 0, "model.layers.0")


def test_ray_without_a_cluster_is_a_clear_error(six_ranks, capsys):
    pytest.importorskip("ray")
    assert main(["compare", *six_ranks, "--ray", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--ray 127.0.0.1:1" in err and "ray start" in err
