"""Runs the CUDA digest kernel under Numba's simulator; driven by test_cuda_kernel.py.

The simulator must be switched on before Numba is imported, so this runs in its own process.
Reads a JSON job on stdin, writes JSON answers on stdout, every digest as [xor, pos]:
  {"launches": [{"hex": ..., "blocks": b, "threads": t}, ...],
   "digester": {"hex": [...], "batch_size": n, "blocks": b, "threads": t, "collect_after": k}}
Launches share one result buffer (each in its own slot, after other slots were written). The
digester alternates two streams and collects the first k pendings before submitting the rest.
"""

import json
import os
import sys
import warnings

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)  # uint64 scalars wrap

import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from bitguard.cuda.cuda_kernel import CudaDigester, launch_digest  # noqa: E402


def parts(raw: np.ndarray):
    """(whole words, tail bytes) as device arrays, None where empty."""
    n = raw.size // 8
    words = cuda.to_device(raw[: n * 8].view(np.uint64)) if n else None
    tail = cuda.to_device(raw[n * 8 :]) if raw.size % 8 else None
    return words, tail


def main() -> None:
    job = json.load(sys.stdin)
    answers = {"launches": [], "digester": []}
    launches = job["launches"]
    out = cuda.to_device(np.zeros((len(launches) + 1, 2), dtype=np.uint64))
    stream = cuda.stream()
    for slot, case in enumerate(launches, start=1):
        words, tail = parts(np.frombuffer(bytes.fromhex(case["hex"]), dtype=np.uint8))
        launch_digest(words, tail, out, slot, stream, case["blocks"], case["threads"])
    host = out.copy_to_host()
    answers["launches"] = [[int(x), int(p)] for x, p in host[1:]]

    spec = job["digester"]
    digester = CudaDigester(spec["batch_size"], spec["threads"], spec["blocks"], copy_stream=lambda device: cuda.stream())
    streams = (cuda.stream(), cuda.stream())
    pendings = []
    for k, h in enumerate(spec["hex"]):
        if k == spec["collect_after"]:
            answers["digester"] += digester.collect(pendings)
            pendings = []
        pendings.append(digester.submit_words(*parts(np.frombuffer(bytes.fromhex(h), dtype=np.uint8)), streams[k % 2]))
    answers["digester"] += digester.collect(pendings)
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()
