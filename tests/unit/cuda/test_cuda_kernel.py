"""The CUDA digest kernel against the CPU kernel: under Numba's simulator here, on a GPU when lent.

The simulator runs each GPU thread as a Python thread, so its buffers stay under 2k words.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bitguard.cuda.cpu_kernel import digest_buffer
from bitguard.cuda.fingerprint import digest, digest_async, resolve, warmup
from bitguard.cuda.reference import digest_tensor_reference

SIMULATOR_SCRIPT = Path(__file__).with_name("simulator_cases.py")

# (bytes, blocks, threads): one thread; power-of-two and odd block sizes; more threads than
# words; a grid whose stride leaves some threads a word fewer; tail-only; whole words only.
LAUNCHES = [
    (2003, 1, 1),
    (2003, 2, 32),
    (1999, 3, 100),
    (77, 4, 64),
    (8 * 1000 + 5, 5, 37),
    (5, 2, 8),
    (8 * 129, 1, 33),
    (1, 1, 1),
]
DIGESTER_SIZES = [1, 7, 8, 9, 100, 3, 64, 17, 250, 1000, 15]  # batches of 4: rotation and a partial collect


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_simulated_kernel_equals_cpu_kernel(same_digest):
    launches = [random_bytes(n, seed) for seed, (n, _, _) in enumerate(LAUNCHES)]
    digested = [random_bytes(n, 100 + seed) for seed, n in enumerate(DIGESTER_SIZES)]
    job = {
        "launches": [{"hex": b.hex(), "blocks": bl, "threads": th} for b, (_, bl, th) in zip(launches, LAUNCHES)],
        "digester": {"hex": [b.hex() for b in digested], "batch_size": 4, "blocks": 2, "threads": 32, "collect_after": 6},
    }
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    run = subprocess.run(
        [sys.executable, str(SIMULATOR_SCRIPT)], input=json.dumps(job), env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    for b, (n, blocks, threads), answer in zip(launches, LAUNCHES, got["launches"]):
        want = digest_buffer(np.frombuffer(b, dtype=np.uint8))
        same_digest(answer, want, f"{n} bytes on {blocks} blocks x {threads} threads")
    for k, (b, answer) in enumerate(zip(digested, got["digester"])):
        same_digest(answer, digest_buffer(np.frombuffer(b, dtype=np.uint8)), f"digester submission {k} ({len(b)} bytes)")


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.complex64]


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_tensors_equal_reference(dtype, same_digest):
    g = torch.Generator(device="cuda").manual_seed(0)
    base = (torch.randn(257, 131, device="cuda", generator=g) * 8).to(dtype)
    views = {
        "contiguous": base,
        "transposed": base.t(),
        "stepped": base[1::3, ::2],
        "expanded": base[:1].expand(5, -1),
        "odd offset": base.reshape(-1)[3:1000],
        "0-dim": base[2, 3],
        "empty": base[:0],
    }
    for name, t in views.items():
        same_digest(digest(t), digest_tensor_reference(t), f"{dtype} {name} {tuple(t.shape)}")


@pytest.mark.cuda
@cuda_only
def test_cuda_batches_across_streams(same_digest):
    tensors = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in range(1, 3000, 2)]  # > one batch
    side = torch.cuda.Stream()
    items = []
    for k, t in enumerate(tensors):
        if k % 3:
            items.append(digest_async(t))
        else:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                items.append(digest_async(t))
        if k == 100:  # answers[101]
            items.append(digest_async(torch.ones(3)))  # host tensors resolve at once
    answers = resolve(items)
    answers.pop(101)
    for t, answer in zip(tensors, answers):
        same_digest(answer, digest_tensor_reference(t), f"bf16 tensor of {t.numel()} elements")


@pytest.mark.cuda
@cuda_only
def test_cuda_digest_keeps_autograd_state():
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    y = (x * 2).t()
    before = (y.grad_fn, y._version, y.requires_grad)
    resolve([digest_async(y), digest_async(torch.nn.Parameter(x.detach()))])
    assert (y.grad_fn, y._version, y.requires_grad) == before
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


@pytest.mark.cuda
@cuda_only
def test_cuda_digest_async_does_not_wait_for_the_gpu(same_digest):
    warmup()
    t = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # about half a second of GPU time queued ahead of the digest
    start = time.perf_counter()
    pending = digest_async(t)
    queued = time.perf_counter() - start
    answer = resolve([pending])[0]
    waited = time.perf_counter() - start
    assert queued < 0.1 < waited, f"digest_async took {queued:.3f} s, resolve {waited:.3f} s"
    same_digest(answer, digest_tensor_reference(t), "float32 tensor behind a sleeping kernel")
