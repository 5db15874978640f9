"""The Numba CPU kernel against the NumPy reference, and the reference against Python integers."""

import numpy as np
import pytest

from bitguard.cuda import cpu_kernel
from bitguard.cuda.cpu_kernel import combine, digest_buffer, digest_words
from bitguard.cuda.reference import digest_bytes_reference

MASK = (1 << 64) - 1


def digest_by_integers(buf: bytes) -> tuple[int, int]:
    """The definition once more, in Python integers: the reference's own check."""
    buf = buf + b"\0" * (-len(buf) % 8)
    xor = pos = 0
    for i in range(len(buf) // 8):
        w = int.from_bytes(buf[8 * i : 8 * i + 8], "little")
        xor ^= w
        m = ((w ^ (w >> 33)) * 0xFF51AFD7ED558CCD) & MASK
        m = ((m ^ (m >> 33)) * 0xC4CEB9FE1A85EC53) & MASK
        pos = (pos + (m ^ (m >> 33)) * (2 * i + 1)) & MASK
    return xor, pos


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1001])
def test_reference_follows_the_definition(n, same_digest):
    buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    same_digest(digest_bytes_reference(buf), digest_by_integers(buf), f"reference, {n} bytes")


@pytest.mark.parametrize("n", [0, 1, 3, 7, 8, 9, 15, 16, 17, 4096, 1000003])
@pytest.mark.parametrize("offset", [0, 1, 4])
def test_buffer_equals_reference(n, offset, same_digest):
    raw = np.random.default_rng(n).integers(0, 256, n + offset, dtype=np.uint8)[offset:]  # misaligned views too
    same_digest(digest_buffer(raw), digest_bytes_reference(raw), f"{n} bytes at offset {offset}")


def test_words_numbered_from_start_index_combine(same_digest):
    words = np.random.default_rng(1).integers(0, 2**64 - 1, 1000, dtype=np.uint64, endpoint=True)
    whole = tuple(map(int, digest_words(words, 0)))
    halves = combine(tuple(map(int, digest_words(words[:377], 0))), tuple(map(int, digest_words(words[377:], 377))))
    same_digest(halves, whole, "two halves combined")


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("n", [8 * 1000, 8 * 1024 + 3])
def test_threads_give_the_same_digest(threads, n, monkeypatch, same_digest):
    monkeypatch.setattr(cpu_kernel, "CHUNK_WORDS", 100)  # many chunks, the last one short
    raw = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    same_digest(digest_buffer(raw, threads=threads), digest_bytes_reference(raw), f"{n} bytes on {threads} threads")
