"""The public digest API the collectors call: (xor, pos) of any tensor, on its own device.

`digest(t)` answers at once. `digest_async(t)` answers at once for host tensors and with a
`Pending` for CUDA tensors, whose kernel is queued on the tensor's current stream without any
host synchronisation; `resolve(items)` turns a list mixing answers and pendings into answers,
reading back each batch of GPU results once. The definition of the two digests is in
docs/DIGESTS.md; `bitguard.cuda.reference` is its plain NumPy transcription.

Host tensors of 128 KiB or more are digested on torch's own OpenMP team (`openmp_team`), the
others on the calling thread; a team digest that ran slower than the calling thread alone would
(a member of the team was not running: the cores are shared) sends the next big digests to the
calling thread for a while (`_TeamWatch`). Tensors on other devices (mps, xpu, ...) are copied to
the host first. A DTensor is digested as its local shard (`local_values`). This module holds
three pieces of state: the process's `CudaDigester`, created on the first CUDA tensor, what it
found of torch's OpenMP runtime, looked up on the first big host tensor, and the team's watch.
Which thread digests never changes a digest: the team's chunks combine into the one-thread value.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Union

import numpy as np
import torch

from bitguard.cuda.cpu_kernel import (digest_addresses, digest_at, digest_buffer, digest_mapped_at, digest_team,
                                      digest_team_at, team_member)
from bitguard.cuda.tensor_bytes import tensor_bytes

if TYPE_CHECKING:
    from bitguard.cuda.cuda_kernel import CudaDigester, Pending

Digest = tuple[int, int]  # (xor, pos), each an unsigned 64-bit value as a Python int

_digester: CudaDigester | None = None
_digester_lock = threading.Lock()
_warmed: set[tuple] = set()  # what warmup() has warmed in this process


def digest(t: torch.Tensor) -> Digest:
    """(xor, pos) of `t`'s logical row-major bytes; waits for a CUDA tensor's kernel."""
    return resolve([digest_async(t)])[0]


_PLAIN = (torch.Tensor, torch.nn.Parameter)

# Host tensors of this size or more are digested by torch's own OpenMP team (see `openmp_team`):
# below it, waking the team costs about what the second thread saves (docs/DIGESTS.md). The
# chunks are what a thread of the team takes at a time.
TEAM_MIN_BYTES = 1 << 17
TEAM_CHUNK_BYTES = 1 << 16
NO_TEAM = np.zeros(0, dtype=np.int64)  # what `openmp_team` answers when there is none
_team: np.ndarray | None = None  # what `digest_team` needs (`openmp_team`); None: not looked up yet


class _TeamWatch:
    """When to digest a big host tensor on the team. A team digest waits, at its end, for every
    member to finish its chunks; a member that is not running (another process holds its core)
    makes it wait for a scheduler slice, milliseconds, where the calling thread alone reads a
    megabyte in about 50 µs: on this project's shared 2-core machine, under a load of 4, a trusted
    step's 304 MB took 423 ms on the team and 16 ms on the calling thread (docs/PERFORMANCE.md).
    So each team digest is timed; one slower than `SLOW_BYTES_PER_NS` (the calling thread is
    several times faster than that even on cold memory) sends the next `backoff` big digests to
    the calling thread, `backoff` doubling (up to `MAX_BACKOFF`) while the team stays slow and
    back to `MIN_BACKOFF` after a team digest that was not. Races between threads only blur when
    the team is tried again, never a digest."""

    SLOW_BYTES_PER_NS = 5.0  # 5 GB/s
    MIN_BACKOFF = 64
    MAX_BACKOFF = 4096

    def __init__(self) -> None:
        self.skip = 0  # big digests still to take on the calling thread
        self.backoff = self.MIN_BACKOFF
        self.slow = 0  # team digests found slow so far (for benchmarks and tests)

    def use(self) -> bool:
        if self.skip:
            self.skip -= 1
            return False
        return True

    def took(self, nbytes: int, ns: int) -> None:
        if ns * self.SLOW_BYTES_PER_NS > nbytes:
            self.slow += 1
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
        else:
            self.backoff = self.MIN_BACKOFF


team_watch = _TeamWatch()


def _no_team_after_fork() -> None:
    """In a forked child the OpenMP runtime still describes the parent's team, whose threads were
    not forked: a parallel region there hangs or crashes. The child digests on its own thread."""
    global _team
    _team = NO_TEAM


os.register_at_fork(after_in_child=_no_team_after_fork)


def openmp_team() -> np.ndarray:
    """The addresses `digest_team` needs to run on torch's intra-op OpenMP team (its OpenMP
    runtime's `GOMP_parallel`, `omp_get_max_threads`, `omp_get_thread_num`, and `team_member`),
    or an empty array when there is none.

    Torch's CPU ops run on an OpenMP team whose workers spin between ops; a digest on that team
    costs the training thread about half its time (or less: see docs/PERFORMANCE.md). Used only
    when torch's parallel backend is OpenMP and the OpenMP runtime found loaded in the process
    is the one torch set up (its thread count is torch's); never loads a runtime itself.
    `BITGUARD_DIGEST_TEAM=0` turns it off (every digest then runs on the calling thread alone)."""
    global _team
    if _team is not None:
        return _team
    _team = NO_TEAM
    if os.environ.get("BITGUARD_DIGEST_TEAM", "1") == "0" or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return _team
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so"):  # GNU, Intel, LLVM: all have GOMP_parallel
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            functions = [runtime.GOMP_parallel, runtime.omp_get_max_threads, runtime.omp_get_thread_num]
        except (OSError, AttributeError):
            continue
        threads = functions[1]
        threads.restype = ctypes.c_int
        if threads() == torch.get_num_threads():
            addresses = [ctypes.cast(f, ctypes.c_void_p).value for f in functions] + [team_member.address]
            _team = np.array(addresses, dtype=np.int64)
        break
    return _team


def _plain_host(t: torch.Tensor) -> bool:
    """Is `t` a host tensor whose own memory holds its logical bytes in order?"""
    return type(t) in _PLAIN and t.layout == torch.strided and in_place_on_host(t)


def digest_many(tensors: list[torch.Tensor]) -> list[Union[Digest, "Pending"]]:
    """`digest_async` of each tensor; the plain contiguous host ones in one kernel call (on torch's
    OpenMP team when they are big enough together)."""
    answers: list = [None] * len(tensors)
    batch = []
    for i, t in enumerate(tensors):
        if _plain_host(t) and t.numel():
            batch.append(i)
        else:
            answers[i] = digest_async(t)
    if batch:
        addresses = np.array([tensors[i].data_ptr() for i in batch], dtype=np.int64)
        sizes = np.array([tensors[i].nbytes for i in batch], dtype=np.int64)
        out = np.empty((len(batch), 2), dtype=np.uint64)
        team = openmp_team()
        total = int(sizes.sum())
        if team.size and total >= TEAM_MIN_BYTES and team_watch.use():
            started = time.perf_counter_ns()
            digest_team(addresses, sizes, out, team, TEAM_CHUNK_BYTES)
            team_watch.took(total, time.perf_counter_ns() - started)
        else:
            digest_addresses(addresses, sizes, out)
        for i, (x, p) in zip(batch, out.tolist()):
            answers[i] = (x, p)
    return answers


def local_values(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes are `t`'s values in this process: a DTensor's local shard (the rank's
    own part; the DTensor itself holds no data), `t` itself otherwise."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # loaded wherever a DTensor exists
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def digest_async(t: torch.Tensor) -> Union[Digest, "Pending"]:
    """(xor, pos) of a host tensor, or a `Pending` for a CUDA tensor; never synchronises CUDA.
    A DTensor is digested as its local shard."""
    if type(t) not in _PLAIN:
        t = local_values(t)
    if t.is_cuda:
        return cuda_digester().submit(t)
    if _plain_host(t):
        # The common case: its own memory, `nbytes` from the first element's address, digested in
        # place (a microsecond a tensor, most of it the checks above).
        return digest_host_at(t.data_ptr(), t.nbytes)
    plan = mapped_plan(t) if type(t) in _PLAIN else None
    if plan is not None:  # a view whose rows are whole words (a transposed q, k or v): read in place
        return digest_mapped_at(t.data_ptr(), *plan)
    b = tensor_bytes(t)
    if b.device.type != "cpu":
        b = b.cpu()
    # b: a contiguous uint8 host tensor (a copy, or a view of t's own memory), alive for the call
    return digest_host_at(b.data_ptr(), b.numel())


MAPPED_MAX_RUN_WORDS = 1 << 14  # words of one run at most (its logical numbers take as many int64s, 128 KiB)
_plans: dict[tuple, tuple | None] = {}  # (shape, strides, element size) -> mapped_plan's answer


def mapped_plan(t: torch.Tensor) -> tuple | None:
    """The arguments after the address for `digest_mapped_at`, for a non-empty host tensor that is
    not contiguous but whose rows (its last dimension, stride 1) are whole words at word-aligned
    places; None for any other (the caller copies it: `tensor_bytes`). Plans are kept by shape,
    strides and element size: a model's views repeat every step."""
    if not t.is_cpu or t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg() or t.dim() == 0 \
            or t.data_ptr() % 8:
        return None
    key = (t.shape, t.stride(), t.element_size())
    plan = _plans.get(key, False)
    if plan is False:
        if len(_plans) >= 1024:
            _plans.clear()
        plan = _plans[key] = _plan(*key)
    return plan


def _plan(shape: tuple, strides: tuple, size: int) -> tuple | None:
    if 0 in shape or strides[-1] != 1 or shape[-1] * size % 8 or any(s * size % 8 for s in strides[:-1]):
        return None
    words = [*shape[:-1], shape[-1] * size // 8]  # the tensor as words: its last dimension in words
    step = [s * size // 8 for s in strides[:-1]] + [1]
    number = [1] * len(words)  # logical (row-major) strides, in words
    for d in range(len(words) - 2, -1, -1):
        number[d] = number[d + 1] * words[d + 1]
    order = sorted(range(len(words)), key=lambda d: (-step[d], -d))  # memory order, outermost first
    run, length = [], 1  # the innermost dimensions in memory that lie contiguous: one run
    for d in reversed(order):
        if (step[d] != length and words[d] != 1) or length * words[d] > MAPPED_MAX_RUN_WORDS:
            break  # (a longer run: the rest of the dimensions step it, as the outer ones do)
        run.insert(0, d)
        length *= words[d]
    if not run:
        return None
    numbers = np.zeros(1, dtype=np.int64)
    for d in run:
        numbers = (numbers[:, None] + np.arange(words[d], dtype=np.int64) * number[d]).reshape(-1)
    outer = [d for d in order if d not in run]
    extent = 1 + sum((n - 1) * s for n, s in zip(words, step))
    return (extent, np.array([words[d] for d in outer], dtype=np.int64),
            np.array([step[d] for d in outer], dtype=np.int64), np.array([number[d] for d in outer], dtype=np.int64),
            numbers)


def in_place_on_host(t: torch.Tensor) -> bool:
    """Can `digest_host_at(t.data_ptr(), t.nbytes)` digest `t`, known to be a plain dense strided
    torch.Tensor or nn.Parameter (`_plain_host`, less the parts such a caller has checked already)?"""
    return t.is_cpu and t.is_contiguous() and not t.is_quantized and not t.is_conj() and not t.is_neg()


def digest_host_at(address: int, nbytes: int) -> Digest:
    """(xor, pos) of the `nbytes` bytes at `address`, host memory the caller keeps alive and
    unwritten for the call: a plain host tensor's own memory (`digest_async`'s common case, and
    `Collector._row`'s, which has read the address and size already); on torch's OpenMP team from
    TEAM_MIN_BYTES on."""
    if nbytes < TEAM_MIN_BYTES:
        return digest_at(address, nbytes) if nbytes else (0, 0)
    team = openmp_team()
    if team.size and team_watch.use():
        started = time.perf_counter_ns()
        got = digest_team_at(address, nbytes, team, TEAM_CHUNK_BYTES)
        team_watch.took(nbytes, time.perf_counter_ns() - started)
        return got
    return digest_at(address, nbytes)


def resolve(items: list[Union[Digest, "Pending"]]) -> list[Digest]:
    """The answers of `digest_async` calls, in order; pendings are read back batch by batch."""
    pending = [x for x in items if not isinstance(x, tuple)]
    answers = iter(cuda_digester().collect(pending) if pending else ())
    return [x if isinstance(x, tuple) else next(answers) for x in items]


def cuda_digester() -> CudaDigester:
    """The process's digester for CUDA tensors (created on first use)."""
    global _digester
    with _digester_lock:
        if _digester is None:
            from bitguard.cuda.cuda_kernel import CudaDigester

            _digester = CudaDigester()
        return _digester


def warmup(team: bool = True) -> None:
    """Compile (or load from Numba's cache) the kernels, so no training step pays for it.
    `team=False` leaves out the kernel that runs on torch's OpenMP team: running it starts the
    team's threads, and a process forked after that hangs in its first parallel op (GNU OpenMP is
    not fork-safe), so a fork server warms up without it. Once a process for each of what it warms (the
    team's size, the device): every recording calls it, and a notebook or a test makes many."""
    done = (team and openmp_team().size, torch.cuda.is_available())
    if done in _warmed:
        return
    digest_buffer(np.zeros(9, dtype=np.uint8))  # whole words and a tail: the one CPU signature
    digest(torch.zeros(3))
    digest(torch.zeros(2, 3, 2).transpose(0, 1))  # a view read in place (digest_mapped_at)
    digest_many([torch.zeros(3)])
    if team and openmp_team().size:
        digest(torch.zeros(TEAM_MIN_BYTES // 4 + 1))
        digest_many([torch.zeros(TEAM_MIN_BYTES // 4 + 1)])
    if torch.cuda.is_available():
        digest(torch.zeros(9, dtype=torch.uint8, device="cuda"))
    _warmed.add(done)
