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

`digest_team` and `digest_team_at` run the same kernel on torch's own OpenMP team, whose workers
spin idle between torch's ops (the section below, and docs/DIGESTS.md).

Chunks combine because both digests are sums in a group: XOR for `xor`, addition mod 2^64 for
`pos` (each chunk's terms already carry their global word index).

This module knows bytes and words only; turning a tensor into bytes is `tensor_bytes`' job.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import reduce

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
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
def digest_bytes(raw, start_index=0):
    """(xor, pos) of a 1-d contiguous uint8 array whose first byte starts word number
    `start_index`, in one call: whole words in place, then the 1..7 tail bytes zero-padded into the
    word after them. The per-call cost is what a recorded step pays for each of its hundreds of
    small tensors, so nothing here is Python."""
    n_words = raw.size // 8
    x, p = digest_words(raw[: n_words * 8].view(np.uint64), start_index)
    rest = raw.size - n_words * 8
    if rest:
        w = _U(0)
        for k in range(rest):
            w |= _U(raw[n_words * 8 + k]) << _U(8 * k)
        tx, tp = digest_words(np.full(1, w, dtype=np.uint64), start_index + n_words)
        x ^= tx
        p += tp
    return x, p


def _pointer_cast(item):
    """An intrinsic that turns an int64 address into a pointer to `item`s (for `carray`)."""

    @intrinsic
    def cast(typingctx, address):
        sig = types.CPointer(item)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return cast


_bytes_at = _pointer_cast(types.uint8)
_words_at = _pointer_cast(types.uint64)


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


@njit(cache=True, nogil=True)
def digest_mapped_at(address, extent_words, outer_shape, outer_step, outer_number, numbers):
    """`digest_bytes` of a strided tensor's logical row-major bytes, read in place in the order of
    its memory (both digests are sums over words, each word's term carrying its logical number, so
    the order of reading is free). The tensor is seen as words: runs of `numbers.size` words lie
    contiguous in memory, `numbers[k]` the logical number of a run's word k relative to the run's
    first; the outer dimensions (`outer_shape`, in memory order) move a run's first word by
    `outer_step` words in memory and by `outer_number` in logical number. Every word sits within
    `extent_words` of `address`, a multiple of 8, which the caller keeps alive and unwritten. A
    transposed attention input (batch, heads, sequence, head width) is read at the cost of one
    contiguous read this way, where a contiguous copy first cost an allocation, a write and a read;
    and the loop over a run is long (all heads of a row), where one run per head would pay
    `digest_words`' fixed cost per 32 words."""
    whole = carray(_words_at(address), extent_words)
    outer = outer_shape.size
    runs = 1
    for d in range(outer):
        runs *= outer_shape[d]
    n = numbers.size
    x = _U(0)
    p = _U(0)
    index = np.zeros(outer, dtype=np.int64)
    at = 0  # the run's first word in memory
    first = 0  # and its logical number
    for _ in range(runs):
        run = whole[at:at + n]
        odd = _U(2) * _U(first) + _U(1)
        for k in range(n):
            w = run[k]
            x ^= w
            m = (w ^ (w >> _S)) * _M1
            m = (m ^ (m >> _S)) * _M2
            p += (m ^ (m >> _S)) * (odd + _U(2) * _U(numbers[k]))
        d = outer - 1
        while d >= 0:  # the next run: the outer index counted up, innermost dimension fastest
            index[d] += 1
            at += outer_step[d]
            first += outer_number[d]
            if index[d] < outer_shape[d]:
                break
            at -= outer_step[d] * outer_shape[d]
            first -= outer_number[d] * outer_shape[d]
            index[d] = 0
            d -= 1
    return x, p


# -- a team of torch's own OpenMP threads -----------------------------------------------------
# Between two of torch's parallel ops its OpenMP workers spin, waiting for the next one; a digest
# run on the training thread leaves them spinning. `digest_team` hands the work to that same team
# (`GOMP_parallel` of the runtime torch loaded, called by its address). The buffers are cut into
# chunks, and the chunks into one contiguous range per thread of the team, in thread order: a
# tensor that torch's op just wrote in halves (thread 0 the first) is mostly read back by the
# thread whose cache holds it. A thread that has finished its range takes chunks from the others'
# (each range's next chunk is claimed with an atomic counter), so a worker slow to wake costs only
# its share; the chunks' digests combine in any order into exactly the one-thread digest.


@intrinsic
def _claim(typingctx, address):
    """Atomically add one to the int64 at `address`; its value before."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        counter = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", counter, ir.Constant(ir.IntType(64), 1), "monotonic")

    return sig, codegen


@intrinsic
def _call_int(typingctx, function):
    """Call the C function `int f(void)` at address `function` (omp_get_thread_num, ...)."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        fn_type = ir.FunctionType(ir.IntType(32), [])
        return builder.sext(builder.call(builder.inttoptr(args[0], fn_type.as_pointer()), []), ir.IntType(64))

    return sig, codegen


@intrinsic
def _run_team(typingctx, parallel, member, block):
    """`GOMP_parallel(member, block, 0, 0)`, the first two given by address: `member(block)` runs
    on every thread of the calling thread's OpenMP team (0 threads: the team size the runtime is
    set to, which is torch's `get_num_threads()`), and returns when all of them are done."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        byte_ptr = ir.IntType(8).as_pointer()
        member_type = ir.FunctionType(ir.VoidType(), [byte_ptr])
        parallel_type = ir.FunctionType(ir.VoidType(), [member_type.as_pointer(), byte_ptr, ir.IntType(32), ir.IntType(32)])
        zero = ir.Constant(ir.IntType(32), 0)
        builder.call(builder.inttoptr(args[0], parallel_type.as_pointer()),
                     [builder.inttoptr(args[1], member_type.as_pointer()), builder.inttoptr(args[2], byte_ptr), zero, zero])
        return context.get_dummy_value()

    return sig, codegen


_HEAD = 5  # int64 slots before the ranges' counters in a team block
_CHUNK = 4  # int64 slots per chunk: address, bytes, number of its first word, the buffer it belongs to


@njit(cache=True, nogil=True)
def _take_chunks(block):
    """Digest chunks until none is left: those of this thread's own range first, then the others'.
    `block` is the address of int64 slots: the number of ranges R, of chunks, the addresses of the
    chunks (address, bytes, number of its first word, its buffer; `_CHUNK` int64 each), of their
    results (xor, pos; 2 uint64 each) and of `omp_get_thread_num`; then each range's next chunk
    (R counters) and its end (R more)."""
    head = carray(_words_at(block), _HEAD)
    ranges, n = np.int64(head[0]), np.int64(head[1])
    chunks = carray(_words_at(np.int64(head[2])), _CHUNK * n)
    results = carray(_words_at(np.int64(head[3])), 2 * n)
    ends = carray(_words_at(block + 8 * (_HEAD + ranges)), ranges)
    me = _call_int(np.int64(head[4]))
    for k in range(ranges):
        r = (me + k) % ranges
        while True:
            i = _claim(block + 8 * (_HEAD + r))
            if i >= np.int64(ends[r]):
                break
            c = _CHUNK * i
            address, size, first = np.int64(chunks[c]), np.int64(chunks[c + 1]), np.int64(chunks[c + 2])
            x, p = digest_bytes(carray(_bytes_at(address), size), first)
            results[2 * i] = x
            results[2 * i + 1] = p


@cfunc(types.void(types.int64), nogil=True, cache=True)
def team_member(block):
    """What each thread of the team runs (`_take_chunks`), as a C function for `GOMP_parallel`."""
    _take_chunks(block)


@njit(cache=True, nogil=True)
def digest_team(addresses, sizes, out, team, chunk_bytes):
    """`digest_addresses` on the calling thread's OpenMP team: buffer i (sizes[i] bytes at
    addresses[i]) is cut into chunks of `chunk_bytes` (a multiple of 8) and the chunks' digests are
    combined into out[i]. `team`: the addresses of the runtime's `GOMP_parallel`,
    `omp_get_max_threads` and `omp_get_thread_num`, and of `team_member` (int64[4]).

    The team reads `chunks` and `block` by address only: Numba frees an array after its last use
    as an array, so both are read again below, after the parallel region (the chunks' buffers in
    the combining loop, the ranges' counters in the check), which keeps them alive through it.
    Freed before it (as `chunks` once was), another thread's allocation could overwrite the chunk
    table while the team read it: digests of the wrong bytes, or of none (xor 0)."""
    n = 0
    for b in range(addresses.size):
        n += max(1, (sizes[b] + chunk_bytes - 1) // chunk_bytes)
    chunks = np.empty(_CHUNK * n, dtype=np.int64)
    i = 0
    for b in range(addresses.size):
        lo = 0
        while True:
            chunks[_CHUNK * i] = addresses[b] + lo
            chunks[_CHUNK * i + 1] = min(chunk_bytes, sizes[b] - lo)
            chunks[_CHUNK * i + 2] = lo // 8
            chunks[_CHUNK * i + 3] = b
            i += 1
            lo += chunk_bytes
            if lo >= sizes[b]:
                break
    results = np.empty(2 * n, dtype=np.uint64)
    ranges = max(1, _call_int(team[1]))  # the team's size: omp_get_max_threads()
    block = np.empty(_HEAD + 2 * ranges, dtype=np.int64)
    block[0], block[1], block[2], block[3], block[4] = ranges, n, chunks.ctypes.data, results.ctypes.data, team[2]
    for r in range(ranges):
        block[_HEAD + r] = n * r // ranges
        block[_HEAD + ranges + r] = n * (r + 1) // ranges
    if ranges > 1:
        _run_team(team[0], team[3], block.ctypes.data)
    else:  # a team of one (torch set to one thread): no parallel region at all, as torch does then
        _take_chunks(block.ctypes.data)
    for r in range(ranges):
        if block[_HEAD + r] < block[_HEAD + ranges + r]:
            raise RuntimeError("a range of the team digest's chunks was left undone")
    out[:] = 0
    for i in range(n):
        b = chunks[_CHUNK * i + 3]
        out[b, 0] ^= results[2 * i]
        out[b, 1] += results[2 * i + 1]


@njit(cache=True, nogil=True)
def digest_team_at(address, size, team, chunk_bytes):
    """`digest_at` on the team: `digest_team` of one buffer (building NumPy arrays in Python
    would cost more than the team saves on a megabyte)."""
    out = np.empty((1, 2), dtype=np.uint64)
    digest_team(np.full(1, address, dtype=np.int64), np.full(1, size, dtype=np.int64), out, team, chunk_bytes)
    return out[0, 0], out[0, 1]


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
