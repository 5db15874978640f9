"""Imported once by the recording pool's fork server (see recordings.py): a warm recorder.

Importing this module loads what every recording needs before its first step (torch, DuckDB,
bitguard's collectors), loads the digest kernels from Numba's cache and reads which installed
distribution provides which module (the manifest's versions), so that each job forked
from the server starts with all of it in place. Nothing here runs on torch's OpenMP team: its
threads would not survive the fork, and a job's first parallel op would hang. Importing it is
its whole purpose; it defines nothing.
"""

import duckdb  # noqa: F401
import pyarrow  # noqa: F401
import torch  # noqa: F401

import bitguard.collectors.determinism  # noqa: F401
import bitguard.collectors.hooks  # noqa: F401
import bitguard.collectors.store  # noqa: F401
import bitguard.recording  # noqa: F401
from bitguard.cuda.fingerprint import warmup
from bitguard.manifest import distribution_owners

warmup(team=False)  # not the OpenMP team's kernel: a fork of a process whose team ran hangs
distribution_owners()  # (the manifest's versions at each recording's end: read once, here)
