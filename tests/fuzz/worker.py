"""The fuzz harness's worker: a long-lived child Python that runs `bitguard` calls in-process.

The harness (harness.py) sends one JSON request per line on stdin and reads one JSON answer per
line from the file descriptor it passed; the child keeps bitguard imported, so a case costs a
tenth of a second instead of an interpreter start. A case that hangs or kills this process
(a FIFO, a crash inside DuckDB) costs only this process: the harness kills and restarts it.

Requests:
  {"op": "cli", "argv": [...]}  `bitguard.cli.main(argv)` with stdout/stderr captured; an exception
                                that escapes main() is written to stderr as Python would print it.
  {"op": "read", "path": DIR}   the run as the ingest reads it (open_run, then load_rank of every
                                rank): a hash and the step of each event row and a hash per
                                tensor row of those events, over what a verdict rests on
                                (EVENT_FACTS, TENSOR_FACTS), the manifest's verdict-relevant fields, or
                                the error the ingest raised.

This file is started as a script (`python worker.py FD`), not imported: it knows nothing of the
harness's cases or outcomes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import traceback

LIMIT = 20_000  # characters of stdout/stderr sent back per case
# What a verdict rests on: which event it is (pairing) and what its tensors held (digests). When an
# event ran, on which thread, its call stack or a tensor's strides describe it and are left out.
EVENT_FACTS = ("seq", "step", "phase", "kind", "boundary")  # a rank is its file (meta rank)
# dtype is content: the same bytes as another dtype are other values (compare counts them differing)
TENSOR_FACTS = ("seq", "role", "idx", "shape", "dtype", "xor", "pos", "unobserved")


def _cli(argv: list[str]) -> dict:
    from bitguard import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - what the user would see, as a traceback
            traceback.print_exc()
            rc = "exception"
    return {"rc": rc, "stdout": out.getvalue()[-LIMIT:], "stderr": err.getvalue()[-LIMIT:]}


def _row_hashes(frame, facts) -> list[str]:
    cols = [c for c in facts if c in frame.columns]
    return [hashlib.blake2b(repr(row).encode(), digest_size=8).hexdigest() for row in frame.select(cols).iter_rows()]


def _read(path: str) -> dict:
    from bitguard.backend import ingest

    try:
        run = ingest.open_run(path)
        events, tensors, steps = [], [], []
        for rank in run.ranks:
            ev, ts, _stacks = ingest.load_rank(run, rank)
            events += [f"{rank}:{h}" for h in _row_hashes(ev, EVENT_FACTS)]
            steps += ev["step"].to_list()
            ts = ts.filter(ts["seq"].is_in(ev["seq"].implode()))  # rows of no event are part of no verdict
            tensors += [f"{rank}:{h}" for h in _row_hashes(ts, TENSOR_FACTS)]
    except BaseException as exc:  # noqa: BLE001 - the oracle reports any failure to read as "unreadable"
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    m = run.manifest
    facts = {k: m.get(k) for k in ("tool", "schema_version", "world_size", "status", "complete")}
    return {"ok": True, "events": events, "steps": steps, "tensors": tensors, "facts": json.loads(json.dumps(facts, default=str)),
            "ranks": sorted(run.ranks)}


def main() -> None:
    answers = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "cli":
            answer = _cli(req["argv"])
        elif req["op"] == "read":
            answer = _read(req["path"])
        else:
            answer = {"error": f"unknown op {req['op']!r}"}
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
