"""Imported once by the recording pool's fork server (see recordings.py): a warm recorder.

Importing this module loads what every recording needs before its first step (torch and the
torch._dynamo its optimizers import, DuckDB, bitguard's collectors), loads the digest kernels from
Numba's cache, reads which installed distribution provides which module (the manifest's
versions) and resolves where the modules imported so far are (its sources), so that each job
forked from the server starts with all of it in place. Nothing here runs on torch's OpenMP team:
its threads would not survive the fork, and a job's first parallel op would hang. Importing it is
its whole purpose; it defines nothing.
"""

import gc

import duckdb  # noqa: F401
import pyarrow  # noqa: F401
import torch  # noqa: F401

# torch.optim's Optimizer.__init__ imports torch._dynamo (its `_disable_dynamo`): 0.7 s of CPU in every
# job that makes an optimizer, against 0.2 s for the rest of a three-step recording (measured here)
import torch._dynamo  # noqa: F401, E402

import bitguard.collectors.determinism  # noqa: F401
import bitguard.collectors.drill  # noqa: F401  (every recording's start imports it)
import bitguard.collectors.hooks  # noqa: F401
import bitguard.collectors.store  # noqa: F401
import bitguard.recording  # noqa: F401
from bitguard.cuda.fingerprint import warmup
from bitguard.manifest import sources, versions

warmup(team=False)  # not the OpenMP team's kernel: a fork of a process whose team ran hangs
versions()  # (the manifest's versions at each recording's end: the installed ones read once, here)
sources(None, [])  # (and where the modules imported so far are: resolved once, here)
# What the server holds now (torch, the collectors: about 260,000 objects) is out of the cyclic garbage
# collector's reach in every job: the full collection that ends each recording (collectors/weights.py
# `_finals`) walks only what the job made (0.26 s a recording less here); nothing here is garbage.
gc.collect()
gc.freeze()
