"""Ranks compared in parallel: each rank's comparison is independent of the others (its own two
rank files, its own alignment, digests, rules and pivot), so a process pool compares them at once
and the parent merges what is cross-rank (the rules' fire counts here; the collectives' blame
and the run-level reasons in compare.py, after every rank is back).

`jobs` is how many worker processes: `None` means the machine's cores, but only for a
comparison big enough to pay for starting them (each spawned worker imports polars, DuckDB and
the backend, about a second here): at least two ranks and `AUTO_MIN_EVENTS` events in all, on a
machine of at least `AUTO_MIN_CORES` cores (one process already reads a rank's two files on two
threads and polars spreads its work: on 2 cores the pool measured 1.40x slower than one process,
docs/PERFORMANCE.md "Ranks in parallel"). An explicit `jobs` > 1 always uses the pool; `jobs` 1
never does. Workers are spawned, never forked:
polars and DuckDB keep thread pools that a fork would copy mid-work.

Beyond one machine the same per-rank tasks run on Ray (`ray`: a cluster's address, or "auto"
for the one `ray start` left running; a Ray already initialised in this process is used as it
is). The workers open the run directories by their paths, so the runs must sit on storage every
node sees at the same path. Ray is an optional extra (`pip install bitguard[ray]`).

Each worker returns the whole `RankComparison` (its frames travel back pickled, as Arrow), so a
pooled comparison is the same object, field for field, as one made in a single process: the
explorer and the notebook read it the same way. What it does not do yet: send back only a small
per-rank summary (the frames of every rank travel back and are held at once, as in one process;
on Ray through its object store).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

AUTO_MIN_EVENTS = 400_000  # below this a spawned pool costs more than it saves (docs/PERFORMANCE.md)
AUTO_MIN_CORES = 4  # below this one process keeps the cores busy itself (measured on 2; 4 not measured)


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
        if events < AUTO_MIN_EVENTS or cores() < AUTO_MIN_CORES:
            return 1
        jobs = cores()
    return max(1, min(jobs, len(ranks)))


def _one(args):
    from bitguard.backend.compare import _compare_rank

    rank, run_a, run_b, rules, band, fingerprint, probes = args
    fired: dict[str, int] = {}
    return rank, _compare_rank(rank, run_a, run_b, rules, fired, band, fingerprint, probes), fired


def _reachable(address: str) -> None:
    """A host:port that takes no connection fails here in seconds (ray.init would retry for minutes)."""
    import socket

    from bitguard.errors import BadInput

    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as exc:
        raise BadInput(f"--ray {address}: no Ray cluster reached ({exc.strerror or exc}); start one with "
                       f"'ray start --head' or give its address (host:port)") from None


def _on_ray(address: str, tasks: list) -> list:
    from bitguard.errors import BadInput, NotSupported

    try:
        import ray
    except ImportError:
        raise NotSupported("--ray needs Ray, an optional extra: pip install 'bitguard[ray]' (or pip install ray)") \
            from None
    if not ray.is_initialized():
        _reachable(address)
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise BadInput(f"--ray {address}: no Ray cluster reached ({str(exc).splitlines()[0][:200]}); start one "
                           f"with 'ray start --head' or give its address (host:port)") from None
    remote = ray.remote(_one)
    return ray.get([remote.remote(t) for t in tasks])


def compare_ranks(ranks: list[int], run_a, run_b, rules, band: int, fingerprint: str, probes,
                  jobs: int | None = None, ray: str | None = None) -> tuple[dict, dict[str, int]]:
    """{rank: RankComparison} in rank order and the rules' fire counts summed over the ranks."""
    tasks = [(r, run_a, run_b, rules, band, fingerprint, probes) for r in ranks]
    n = workers_for(jobs, ranks, run_a, run_b)
    if ray is not None:
        results = _on_ray(ray, tasks)
    elif n == 1:
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
