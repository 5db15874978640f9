"""The (xor, pos) digests of device buffers, computed on the GPU without stopping the host.

`_digest_kernel` reads a buffer's whole words with a grid-stride loop, keeps per-thread partial
digests, reduces them per block in shared memory and folds each block's result into one slot
of a device-side result buffer with `cuda.atomic.xor` / `cuda.atomic.add` (both digests are
sums in a group, so the order in which blocks land does not matter). The 1..7 bytes of a tail
are folded in by thread 0 as one zero-padded word.

`CudaDigester` hands out result slots in fixed-size batches. `submit` launches the kernel on
the stream that produced the tensor and returns a `Pending`; nothing waits. `collect` reads a
batch back once: the copy stream waits on one event per stream that wrote into the batch,
copies the whole result buffer, and the host waits for that copy alone. The buffer then goes
back to a pool and is cleared on the stream of the next batch that takes it.

The kernel and the batch logic see only Numba device arrays and streams, so the simulator
(NUMBA_ENABLE_CUDASIM=1, NumPy arrays) runs them; `CudaDigester.submit` is the thin torch glue.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from numba import cuda, uint64

from bitguard.cuda.tensor_bytes import tensor_bytes
from bitguard.errors import NotSupported

MAX_THREADS = 1024  # threads per block the shared-memory reduction has room for
BATCH_SIZE = 1024  # result slots per batch: one 16 KiB buffer, read back in one copy
THREADS = 256  # threads per block
BLOCKS_PER_SM = 8  # most blocks launched per multiprocessor; the loop strides over the rest


@cuda.jit(device=True)
def _mix(w):  # murmur3 fmix64: a bijection whose output bits all depend on every input bit
    m = (w ^ (w >> uint64(33))) * uint64(0xFF51AFD7ED558CCD)
    m = (m ^ (m >> uint64(33))) * uint64(0xC4CEB9FE1A85EC53)
    return m ^ (m >> uint64(33))


@cuda.jit
def _digest_kernel(words, n_words, tail, n_tail, out, slot):
    xs = cuda.shared.array(MAX_THREADS, uint64)
    ps = cuda.shared.array(MAX_THREADS, uint64)
    t = cuda.threadIdx.x
    first = uint64(cuda.grid(1))
    i = first
    stride = uint64(cuda.gridsize(1))
    n = uint64(n_words)
    x = uint64(0)
    p = uint64(0)
    while i < n:  # all uint64: numba turns mixed signed/unsigned arithmetic into float64
        w = words[i]
        x ^= w
        p += _mix(w) * (uint64(2) * i + uint64(1))
        i += stride
    if first == uint64(0) and n_tail > 0:
        w = uint64(0)
        for k in range(n_tail):
            w |= uint64(tail[k]) << uint64(8 * k)
        x ^= w
        p += _mix(w) * (uint64(2) * n + uint64(1))
    xs[t] = x
    ps[t] = p
    cuda.syncthreads()
    width = cuda.blockDim.x
    half = 1
    while half < width:
        half *= 2
    half //= 2  # largest power of two below the block size: any block size reduces
    while half > 0:
        if t < half and t + half < width:
            xs[t] ^= xs[t + half]
            ps[t] += ps[t + half]
        cuda.syncthreads()
        half //= 2
    if t == 0:
        cuda.atomic.xor(out, (slot, 0), xs[0])
        cuda.atomic.add(out, (slot, 1), ps[0])


@cuda.jit
def _clear_kernel(out):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i, 0] = uint64(0)
        out[i, 1] = uint64(0)


def launch_digest(words, tail, out, slot: int, stream, blocks: int, threads: int = THREADS) -> None:
    """Queue the digest of `words` (uint64) then `tail` (uint8, < 8 bytes) into zeroed `out[slot]`.

    Either array may be None (no whole words, or no tail). Device arrays of any kind Numba
    launches with (NumPy arrays under the simulator); nothing is synchronised.
    """
    if not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads={threads}: a block must have 1..{MAX_THREADS} threads")
    n_words = 0 if words is None else words.size
    n_tail = 0 if tail is None else tail.size
    # No zero-size device array is ever passed (a corner of Numba's argument marshalling not worth
    # depending on): the kernel reads nothing past n_words / n_tail, so the result row stands in
    # for whichever part is absent.
    row = out[slot]
    try:
        _digest_kernel[blocks, threads, stream](
            row if words is None else words, n_words, row.view(np.uint8) if tail is None else tail, n_tail, out, slot
        )
    except ImportError as e:  # NvvmSupportError and friends: no CUDA toolkit to compile with
        raise NotSupported(
            f"cannot compile the CUDA digest kernel ({e}); install the CUDA compiler for Numba "
            "(pip install 'nvidia-cuda-nvcc-cu12' or set CUDA_HOME to a CUDA toolkit)"
        ) from e


@dataclass
class _Batch:
    """One result buffer and what writes to it, until it is read back."""

    device: int
    out: Any  # device array (BATCH_SIZE, 2) uint64, cleared when the batch opened
    host: Any  # pinned host array of the same shape, target of the read-back
    cleared: Any  # event recorded after the clear, on the opening stream
    used: int = 0  # slots handed out
    done: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # id(stream) -> (stream, event after its last launch)
    keep: list[Any] = field(default_factory=list)  # buffers the queued kernels read
    copied: Any = None  # event after the read-back copy; once set, the batch takes no new slots
    results: np.ndarray | None = None  # (used, 2) copy of the results, once read back


@dataclass(frozen=True)
class Pending:
    """A digest queued on the GPU: slot `slot` of `batch`. Resolve it with `collect`."""

    batch: _Batch
    slot: int


_EMPTY = _Batch(device=-1, out=None, host=None, cleared=None, results=np.zeros((1, 2), np.uint64))


class CudaDigester:
    """Queues digests of device buffers and reads their results back in batches.

    `copy_stream(device)` gives the stream results are copied back on. It must not be a
    blocking stream when training uses the legacy default stream, or each read-back would wait
    for all queued training work; the default takes a non-blocking stream from torch.
    `blocks` fixes the grid size (tests); by default it is BLOCKS_PER_SM per multiprocessor,
    fewer for small buffers.
    """

    def __init__(
        self,
        batch_size: int = BATCH_SIZE,
        threads: int = THREADS,
        blocks: int | None = None,
        copy_stream: Callable[[int], Any] | None = None,
    ):
        self.batch_size = batch_size
        self.threads = threads
        self.blocks = blocks
        self._copy_stream_factory = copy_stream or _torch_copy_stream
        self._copy_streams: dict[int, Any] = {}
        self._external: dict[int, Any] = {}  # torch stream handle -> numba stream
        self._open: dict[int, _Batch] = {}  # device -> batch taking new slots
        self._free: dict[int, list[tuple[Any, Any]]] = {}  # device -> (out, host) buffers to reuse
        self._max_blocks: dict[int, int] = {}
        self._lock = threading.Lock()  # training and autograd threads submit concurrently

    def submit(self, t) -> Pending:
        """Queue the digest of a CUDA tensor on its device's current stream; returns at once."""
        import torch

        b = tensor_bytes(t)
        if b.numel() == 0:
            return Pending(_EMPTY, 0)
        if b.data_ptr() % 8:
            b = b.clone()  # a view at an odd offset: whole words must be 8-byte aligned
        device = b.device.index
        handle = torch.cuda.current_stream(b.device).cuda_stream
        n_words = b.numel() // 8
        with cuda.gpus[device]:
            stream = self._external.get(handle)
            if stream is None:
                stream = self._external[handle] = cuda.external_stream(handle)
            raw = cuda.as_cuda_array(b, sync=False)  # sync=True would wait for the stream
            words = raw[: n_words * 8].view(np.uint64) if n_words else None
            tail = raw[n_words * 8 :] if b.numel() % 8 else None
            return self.submit_words(words, tail, stream, device, keep=b)

    def submit_words(self, words, tail, stream, device: int = 0, keep: Any = None) -> Pending:
        """Queue the digest of `words` then `tail` (see `launch_digest`) on `stream`.

        `keep` is held until the batch is read back: the buffer the kernel reads must not be
        freed (and its memory reused by another stream) before the kernel has run.
        """
        with self._lock, cuda.gpus[device]:
            batch = self._open.get(device)
            if batch is None or batch.used == self.batch_size or batch.copied is not None:
                batch = self._open[device] = self._new_batch(device, stream)
            slot = batch.used
            batch.used += 1
            key = id(stream)
            if key in batch.done:
                event = batch.done[key][1]
            else:
                batch.cleared.wait(stream)  # order this stream's atomics after the clear
                event = cuda.event()
                batch.done[key] = (stream, event)
            n = 0 if words is None else words.size
            launch_digest(words, tail, batch.out, slot, stream, self._grid(device, n), self.threads)
            event.record(stream)
            if keep is not None:
                batch.keep.append(keep)
        return Pending(batch, slot)

    def collect(self, pendings: list[Pending]) -> list[tuple[int, int]]:
        """(xor, pos) of each pending digest; reads back each batch involved once.

        The host waits with the lock released, so other threads keep submitting meanwhile.
        """
        batches = [b for b in {id(p.batch): p.batch for p in pendings}.values() if b.results is None]
        with self._lock:
            for batch in batches:
                self._start_read_back(batch)
        for batch in batches:
            batch.copied.synchronize()  # the one host wait: this copy, after this batch's kernels
        with self._lock:
            for batch in batches:
                self._finish_read_back(batch)
        return [(int(p.batch.results[p.slot, 0]), int(p.batch.results[p.slot, 1])) for p in pendings]

    def _grid(self, device: int, n_words: int) -> int:
        if self.blocks is not None:
            return self.blocks
        if device not in self._max_blocks:
            sms = getattr(cuda.gpus[device], "MULTIPROCESSOR_COUNT", 1)  # the simulator has no count
            self._max_blocks[device] = sms * BLOCKS_PER_SM
        return max(1, min(self._max_blocks[device], math.ceil(n_words / self.threads)))

    def _new_batch(self, device: int, stream) -> _Batch:
        free = self._free.setdefault(device, [])
        if free:
            out, host = free.pop()
        else:
            out = cuda.device_array((self.batch_size, 2), dtype=np.uint64)
            host = cuda.pinned_array((self.batch_size, 2), dtype=np.uint64)
        _clear_kernel[math.ceil(self.batch_size / self.threads), self.threads, stream](out)
        cleared = cuda.event()
        cleared.record(stream)
        return _Batch(device, out, host, cleared)

    def _start_read_back(self, batch: _Batch) -> None:
        """Close the batch to new slots and queue its copy to the host (once)."""
        if batch.copied is not None:
            return
        if self._open.get(batch.device) is batch:
            del self._open[batch.device]
        with cuda.gpus[batch.device]:
            copy = self._copy_streams.get(batch.device)
            if copy is None:
                copy = self._copy_streams[batch.device] = self._copy_stream_factory(batch.device)
            for _, event in batch.done.values():
                event.wait(copy)
            batch.out.copy_to_host(ary=batch.host, stream=copy)
            batch.copied = cuda.event()
            batch.copied.record(copy)

    def _finish_read_back(self, batch: _Batch) -> None:
        """Keep the batch's results and return its buffers to the pool (once)."""
        if batch.results is not None:
            return
        batch.results = batch.host[: batch.used].copy()
        self._free[batch.device].append((batch.out, batch.host))
        batch.out = batch.host = None
        batch.done.clear()
        batch.keep.clear()


def _torch_copy_stream(device: int):
    """A non-blocking, high-priority stream on `device`.

    torch creates its pool streams non-blocking and never destroys them, so the Numba view of
    one stays valid without holding the torch object. A pool stream may be shared with other
    code's side streams; a read-back then waits behind their queued work, never the reverse.
    """
    import torch

    return cuda.external_stream(torch.cuda.Stream(device=device, priority=-1).cuda_stream)
