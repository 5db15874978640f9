"""The (xor, pos) digests of a host buffer, computed by a Numba kernel at memory bandwidth.

`digest_words` is the whole kernel: one pass over a slice of uint64 words, numbered from
`start_index`, that LLVM vectorises (AVX-512 `vpmullq` where the CPU has it). One thread reads
memory as fast as `np.sum` does (see docs/PERFORMANCE.md), so `digest_buffer` runs on the
calling thread unless asked for more; with `threads > 1` it splits the words into chunks on a
short-lived thread pool. The kernel releases the GIL (`nogil=True`), so plain Python threads
run it in parallel; Numba's own parallel layers are avoided on purpose: the default OpenMP layer
halves throughput on two cores and the workqueue layer aborts when two Python threads (say the
training loop and autograd's) enter it at once (and, with `prange` over two halves, took 343 µs
for a cached 4 MiB buffer that one thread digests in 117 µs). `digest_bytes` and
`digest_addresses` wrap the kernel for a whole buffer, tail included, in one call (`digest_at`
for one buffer given by its address): a recorded step digests hundreds of small tensors, so the
Python cost per call matters as much as the loop.

Chunks combine because both digests are sums in a group: XOR for `xor`, addition mod 2^64 for
`pos` (each chunk's terms already carry their global word index).

This module knows bytes and words only; turning a tensor into bytes is `tensor_bytes`' job.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import reduce

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

CHUNK_WORDS = 1 << 21  # words per task when threads > 1 (16 MiB: big enough to hide the pool)
_U = np.uint64
_MASK = (1 << 64) - 1
_M1 = np.uint64(0xFF51AFD7ED558CCD)  # murmur3 fmix64 multipliers (docs/DIGESTS.md)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S = np.uint64(33)


@njit(cache=True, nogil=True)
def digest_words(words, start_index):
    """(xor, pos) of `words` (1-d uint64), the first being word number `start_index`."""
    x = _U(0)
    p = _U(0)
    odd = _U(2) * _U(start_index) + _U(1)  # 2i+1, kept in uint64: mixing in int64 gives float64
    for k in range(words.size):
        w = words[k]
        x ^= w
        m = (w ^ (w >> _S)) * _M1
        m = (m ^ (m >> _S)) * _M2
        p += (m ^ (m >> _S)) * odd
        odd += _U(2)
    return x, p


@njit(cache=True, nogil=True)
def digest_bytes(raw):
    """(xor, pos) of a 1-d contiguous uint8 array in one call: whole words in place, then the
    1..7 tail bytes zero-padded into word number len(raw) // 8. The per-call cost is what a
    recorded step pays for each of its hundreds of small tensors, so nothing here is Python."""
    n_words = raw.size // 8
    x, p = digest_words(raw[: n_words * 8].view(np.uint64), 0)
    rest = raw.size - n_words * 8
    if rest:
        w = _U(0)
        for k in range(rest):
            w |= _U(raw[n_words * 8 + k]) << _U(8 * k)
        tx, tp = digest_words(np.full(1, w, dtype=np.uint64), n_words)
        x ^= tx
        p += tp
    return x, p


@intrinsic
def _bytes_at(typingctx, address):
    """The int64 `address` as a uint8 pointer (for `carray`)."""
    sig = types.CPointer(types.uint8)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@njit(cache=True, nogil=True)
def digest_at(address, size):
    """`digest_bytes` of the `size` bytes at `address` (ints), which the caller keeps alive and
    unwritten for the call. Integers are the cheapest arguments to hand to a compiled function:
    this costs half a microsecond a call, against three for building a NumPy view of a tensor."""
    return digest_bytes(carray(_bytes_at(address), size))


@njit(cache=True, nogil=True)
def digest_addresses(addresses, sizes, out):
    """`digest_bytes` of many buffers in one call: buffer i is sizes[i] bytes at addresses[i]
    (int64 arrays); its (xor, pos) go to out[i]. The caller keeps every buffer alive and unwritten
    for the call: an optimizer's hundreds of parameters cost one dispatch instead of hundreds."""
    for i in range(addresses.size):
        x, p = digest_at(addresses[i], sizes[i])
        out[i, 0] = x
        out[i, 1] = p


def combine(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The digests of two disjoint word ranges, joined: XOR the xors, add the pos mod 2^64."""
    return a[0] ^ b[0], (a[1] + b[1]) & _MASK


def digest_words_chunked(words: np.ndarray, start_index: int = 0, threads: int = 1) -> tuple[int, int]:
    """`digest_words` as Python ints, over `threads` threads when the buffer is big enough."""
    if threads <= 1 or words.size <= CHUNK_WORDS:
        x, p = digest_words(words, start_index)
        return int(x), int(p)

    def part(lo: int) -> tuple[int, int]:
        x, p = digest_words(words[lo : lo + CHUNK_WORDS], start_index + lo)
        return int(x), int(p)

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bitguard-digest") as pool:
        return reduce(combine, pool.map(part, range(0, words.size, CHUNK_WORDS)), (0, 0))


def digest_buffer(raw: np.ndarray, threads: int = 1) -> tuple[int, int]:
    """(xor, pos) of a 1-d contiguous uint8 array, zero-padding its last word.

    One thread (or a buffer too small to split): `digest_bytes`, in place. Split over threads:
    whole words are read in place when the buffer starts on an 8-byte boundary and copied once
    when it does not; the 1..7 tail bytes go through a padded 8-byte copy as word number
    len(raw) // 8.
    """
    if threads <= 1 or raw.size <= CHUNK_WORDS * 8:
        x, p = digest_bytes(raw)
        return int(x), int(p)
    n_words, n_tail = divmod(raw.size, 8)
    words = raw[: n_words * 8].view(np.uint64)  # native order: x86 and ARM are little-endian
    if not words.flags.aligned:
        words = words.copy()  # NumPy allocates at 16-byte (or wider) boundaries
    acc = digest_words_chunked(words, 0, threads)
    if n_tail:
        last = np.zeros(1, dtype=np.uint64)
        last.view(np.uint8)[:n_tail] = raw[n_words * 8 :]
        acc = combine(acc, digest_words_chunked(last, n_words))
    return acc
