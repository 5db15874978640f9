"""Imported once by the recording pool's fork server (see recordings.py): a warm recorder.

Importing this module loads what every recording needs before its first step (torch with the
modules `torch.use_deterministic_algorithms` pulls in, DuckDB, bitguard's collectors) and loads
the digest kernel from Numba's cache, so that each job forked from the server starts with all
of it in place. Importing it is its whole purpose; it defines nothing.
"""

import duckdb  # noqa: F401
import pyarrow  # noqa: F401
import torch  # noqa: F401
import torch._inductor  # noqa: F401  (torch.use_deterministic_algorithms imports it: seconds)

import bitguard.collectors.determinism  # noqa: F401
import bitguard.collectors.hooks  # noqa: F401
import bitguard.collectors.store  # noqa: F401
import bitguard.recording  # noqa: F401
from bitguard.cuda.fingerprint import warmup

warmup()
