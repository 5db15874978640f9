"""A stand-in for Hugging Face datasets' `map(..., num_proc=N)` (tests/scripts/child_processes.py
`prepared`): its worker processes are started by the `multiprocess` package, whose forks happen
outside multiprocessing's Process.start (os.fork as the recorder sees it), or by a pool."""

import multiprocessing as mp
import os
import pickle


def map_forked(fn, items: list, num_proc: int) -> list:
    """`fn` over `items` in `num_proc` forked children, as `multiprocess` forks them."""
    chunks = [items[i::num_proc] for i in range(num_proc)]
    children = []
    for chunk in chunks:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.write(write, pickle.dumps([fn(x) for x in chunk]))
            os._exit(0)
        os.close(write)
        children.append((pid, read))
    results = []
    for pid, read in children:
        data = b""
        while chunk := os.read(read, 1 << 16):
            data += chunk
        os.close(read)
        os.waitpid(pid, 0)
        results.append(pickle.loads(data))
    return [r for i in range(len(items)) for r in [results[i % num_proc][i // num_proc]]]


def map_pooled(fn, items: list, num_proc: int) -> list:
    with mp.get_context("fork").Pool(num_proc) as pool:
        return pool.map(fn, items)
