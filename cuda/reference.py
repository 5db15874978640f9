"""The tensor digests written the plain way, in NumPy: ground truth for the kernels' tests.

Each line follows docs/DIGESTS.md: bytes in logical row-major order, zero-padded to whole
little-endian 64-bit words w_0..w_{n-1}; `xor` is the XOR of all w_i and `pos` is
sum(mix(w_i) * (2i+1)) mod 2^64 with mix the murmur3 64-bit finalizer (fmix64). NumPy's uint64 array
arithmetic wraps mod 2^64, which is exactly the arithmetic the definition asks for.

Nothing here is fast or shared with the kernels, on purpose: not the kernels' byte handling
(`digest_tensor_reference` reads a fresh copy's memory instead of viewing the tensor as uint8),
not their word loop. Collectors must use `bitguard.cuda.fingerprint`, never this module.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch


def digest_bytes_reference(buf: bytes | bytearray | memoryview | np.ndarray) -> tuple[int, int]:
    """(xor, pos) of a byte string, or of a NumPy array's bytes in C order."""
    if isinstance(buf, np.ndarray):
        raw = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    else:
        raw = np.frombuffer(bytes(buf), dtype=np.uint8)
    if raw.size == 0:
        return 0, 0
    padded = np.zeros(-(-raw.size // 8) * 8, dtype=np.uint8)
    padded[: raw.size] = raw
    words = padded.view("<u8")
    s33 = np.uint64(33)
    mixed = (words ^ (words >> s33)) * np.uint64(0xFF51AFD7ED558CCD)
    mixed = (mixed ^ (mixed >> s33)) * np.uint64(0xC4CEB9FE1A85EC53)
    mixed = mixed ^ (mixed >> s33)
    odd = np.arange(words.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    xor = np.bitwise_xor.reduce(words)
    pos = np.sum(mixed * odd, dtype=np.uint64)
    return int(xor), int(pos)


def digest_tensor_reference(t: torch.Tensor) -> tuple[int, int]:
    """(xor, pos) of a tensor's logical row-major bytes, any dtype, layout or device."""
    fresh = torch.empty(tuple(t.shape), dtype=t.dtype)  # contiguous, on the CPU, owns its memory
    with torch.no_grad():
        fresh.copy_(t.detach())
    nbytes = fresh.numel() * fresh.element_size()
    return digest_bytes_reference(ctypes.string_at(fresh.data_ptr(), nbytes) if nbytes else b"")
