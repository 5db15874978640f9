"""bitguard's CLI run in the test's own process: `bitguard.cli.main(ARGV)`, the same parser, exit
status and printed text as `python -m bitguard ARGV`, without the 1.5 to 2 s a fresh Python takes
here to import bitguard, polars, DuckDB and Numba (a comparison of two tiny runs is 0.2 s of that).

For the commands that read run directories (compare, check, export-perfetto, ...). What needs a
process of its own goes through a subprocess: recording (the launcher, torchrun), a replay, a
server, and the process's own start and end, which the fuzz tier's `cli` family runs as a user's shell would.
"""

from __future__ import annotations

import io
import json
import subprocess
from contextlib import redirect_stderr, redirect_stdout


def run_cli(*argv) -> subprocess.CompletedProcess:
    """`bitguard ARGV` in this process, as `subprocess.run(..., capture_output=True, text=True)` gives it."""
    from bitguard.cli import main

    args = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["bitguard", *args], code, out.getvalue(), err.getvalue())


def cli_json(*argv) -> tuple[int, dict]:
    """`bitguard ARGV` (ending in --json) in this process: its exit code and printed document
    ({"error": stderr} when it printed no JSON, e.g. exit 2)."""
    done = run_cli(*argv)
    try:
        return done.returncode, json.loads(done.stdout)
    except json.JSONDecodeError:
        return done.returncode, {"error": done.stderr[-4000:]}
