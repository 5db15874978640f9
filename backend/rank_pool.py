"""Ranks compared in parallel: each rank's comparison is independent of the others (its own two
rank files, its own alignment, digests, rules and pivot), so a process pool compares them at once
and the parent merges what is cross-rank (the rules' fire counts here; the collectives' blame
and the run-level reasons in compare.py, after every rank is back).

`jobs` is how many worker processes: `None` means the machine's cores, but only for a
comparison big enough to pay for starting them (each spawned worker imports polars, DuckDB and
the backend, about a second here): at least two ranks and `AUTO_MIN_EVENTS` events in all. An
explicit `jobs` > 1 always uses the pool; `jobs` 1 never does. Workers are spawned, never forked:
polars and DuckDB keep thread pools that a fork would copy mid-work.

Each worker returns the whole `RankComparison` (its frames travel back pickled, as Arrow), so a
pooled comparison is the same object, field for field, as one made in a single process: the
explorer and the notebook read it the same way. What it does not do: spread ranks over several
machines (every worker reads the run directories from this machine's disk), or bound the memory
of ranks held at once (all of them are, as in one process).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

AUTO_MIN_EVENTS = 400_000  # below this a spawned pool costs more than it saves (docs/PERFORMANCE.md)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def workers_for(jobs: int | None, ranks: list[int], run_a, run_b) -> int:
    """How many worker processes to compare `ranks` with (1: in this process)."""
    if jobs is not None and jobs < 1:
        from bitguard.errors import BadInput

        raise BadInput(f"--jobs {jobs}: give a number of worker processes of 1 or more")
    if len(ranks) < 2:
        return 1
    if jobs is None:
        events = sum(run_a.event_counts.get(r, 0) + run_b.event_counts.get(r, 0) for r in ranks)
        if events < AUTO_MIN_EVENTS:
            return 1
        jobs = cores()
    return max(1, min(jobs, len(ranks)))


def _one(args):
    from bitguard.backend.compare import _compare_rank

    rank, run_a, run_b, rules, band, fingerprint, probes = args
    fired: dict[str, int] = {}
    return rank, _compare_rank(rank, run_a, run_b, rules, fired, band, fingerprint, probes), fired


def compare_ranks(ranks: list[int], run_a, run_b, rules, band: int, fingerprint: str, probes,
                  jobs: int | None = None) -> tuple[dict, dict[str, int]]:
    """{rank: RankComparison} in rank order and the rules' fire counts summed over the ranks."""
    tasks = [(r, run_a, run_b, rules, band, fingerprint, probes) for r in ranks]
    n = workers_for(jobs, ranks, run_a, run_b)
    if n == 1:
        results = map(_one, tasks)
    else:
        pool = ProcessPoolExecutor(max_workers=n, mp_context=get_context("spawn"))
        try:
            results = list(pool.map(_one, tasks))
        finally:
            pool.shutdown(cancel_futures=True)
    out, fired = {}, {}
    for rank, rc, f in results:
        out[rank] = rc
        for rid, count in f.items():
            fired[rid] = fired.get(rid, 0) + count
    return out, fired
