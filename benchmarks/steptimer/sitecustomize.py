"""Benchmark-only: time every optimizer step of whatever Python runs with this folder on PYTHONPATH.

`benchmarks/bench_stacks.py` puts this folder first on PYTHONPATH and sets BITGUARD_BENCH_STEPS
to a file prefix: each process registers a global optimizer step post-hook that takes a
timestamp, and at exit writes them to PREFIX.<pid> (one line of JSON: rank and timestamps).
Plain and recorded runs of a stack script are timed the same way, without the script's help.
Nothing happens when the variable is unset.
"""

import atexit
import json
import os
import time

_prefix = os.environ.get("BITGUARD_BENCH_STEPS")
if _prefix:
    _stamps: list[int] = []

    def _stamp(*_args, **_kwargs):
        _stamps.append(time.perf_counter_ns())

    def _write():
        if _stamps:
            with open(f"{_prefix}.{os.getpid()}", "w") as f:
                json.dump({"rank": int(os.environ.get("RANK", "0")), "stamps": _stamps}, f)

    try:
        from torch.optim import optimizer as _optimizer

        _optimizer.register_optimizer_step_post_hook(_stamp)
        atexit.register(_write)
    except Exception:  # noqa: BLE001 - not a torch process (a launcher): nothing to time
        pass
