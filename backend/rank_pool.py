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

Each worker returns its rank compact (`RankComparison.compact()`): the pivot, blame,
propagation, reasons, scope, regions and `summary` (rank_summary.py: what the document and the
cross-rank merge read of a rank), not the frames: a few kB a rank instead of the whole
comparison (docs/PERFORMANCE.md "Ranks in parallel"). The document is made of the same summary
in one process and in the pool, so it is the same, field for field. A frame of a pooled rank
(events, tensors, pairs, diffs, gaps, alignment, stacks: what the explorer and the notebook read)
is made on first read by comparing that rank again in the parent, from the same rank files: the
same frames as one process gives (checked against the summary; a rank file changed since is an
error). Why not have workers write their frames to files the parent maps: on Ray the worker's
disk is another machine's, the files would outlive or vanish under a long-lived Comparison (the
server keeps them), and the CLI reads no frame at all. The price: the first read of a pooled
rank's frames costs that rank's comparison again, in the parent (`Comparison.events()` of every
rank: all of them, one after another).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

AUTO_MIN_EVENTS = 400_000  # below this a spawned pool costs more than it saves (docs/PERFORMANCE.md)
AUTO_MIN_CORES = 4  # below this one process keeps the cores busy itself (measured on 2; 4 not measured)
# A rank's comparison at its peak, by the events of its two sides together (docs/PERFORMANCE.md "Whole
# comparison": 680-750 bytes an event from 100 k to 10 M a side, over a fixed 320 MiB of imports and
# kernels). Rounded up: a pool sized by it must not run the machine out of memory.
BYTES_PER_EVENT = 800
BASE_BYTES = 320 << 20


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def memory_available() -> int | None:
    """Bytes this process may still take: the system's available memory, less where a cgroup (a
    container's limit) allows less; None where neither can be read (not Linux)."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) << 10)
                    break
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def rank_bytes(run_a, run_b, rank: int) -> int:
    """About the peak memory of comparing `rank` (BYTES_PER_EVENT)."""
    return BASE_BYTES + BYTES_PER_EVENT * (run_a.event_counts.get(rank, 0) + run_b.event_counts.get(rank, 0))


def workers_for(jobs: int | None, ranks: list[int], run_a, run_b) -> int:
    """How many worker processes to compare `ranks` with (1: in this process). Left unset, no more
    than the available memory holds at once, each worker taking the biggest rank's peak: the cores
    of a machine can outnumber the ranks its memory compares at a time."""
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
        available = memory_available()
        if available is not None:
            jobs = min(jobs, available // max(rank_bytes(run_a, run_b, r) for r in ranks))
    return max(1, min(jobs, len(ranks)))


def _one(args, compact: bool = True):
    """One rank compared: in a worker, compact (its summary and small fields, no frames)."""
    from bitguard.backend.compare import _compare_rank

    rank, run_a, run_b, rules, band, fingerprint, probes = args
    fired: dict[str, int] = {}
    rc = _compare_rank(rank, run_a, run_b, rules, fired, band, fingerprint, probes)
    return rank, rc.compact() if compact else rc, fired


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
                  jobs: int | None = None, ray: str | None = None, frames: bool = True) -> tuple[dict, dict[str, int]]:
    """{rank: RankComparison} in rank order and the rules' fire counts summed over the ranks.
    `frames` False: a rank compared in this process lets go of its frames as soon as it is
    compared, as a worker's does (read again on first use), so that the memory of comparing many
    ranks one after another is that of the biggest, not of them all."""
    tasks = [(r, run_a, run_b, rules, band, fingerprint, probes) for r in ranks]
    n = workers_for(jobs, ranks, run_a, run_b)
    if ray is not None:
        results = _on_ray(ray, tasks)
    elif n == 1:
        results = (_one(t, compact=not frames) for t in tasks)
    else:
        pool = ProcessPoolExecutor(max_workers=n, mp_context=get_context("spawn"))
        try:
            results = list(pool.map(_one, tasks))
        finally:
            pool.shutdown(cancel_futures=True)
    out, fired = {}, {}
    again = (run_a, run_b, rules, band, fingerprint, probes)  # a compact rank's frames: compared again here
    for rank, rc, f in results:
        if not rc.frames_held:
            rc.again = again
        out[rank] = rc
        for rid, count in f.items():
            fired[rid] = fired.get(rid, 0) + count
    return out, fired
