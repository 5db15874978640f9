"""The explorer's drills: the operator-level drill-down of a comparison's pivot, off the request thread.

A drill (`bitguard.backend.drill.drill`, the engine of `bitguard drill A B`) replays each run's
recorded command for the pivot's step and traces the blame window op by op: seconds to minutes of
training, so it runs on a worker thread of its own, one drill at a time, never on the request
thread and never on the comparisons' worker (a drill does not hold up a comparison). Each
comparison has at most one drill, the latest asked for; asking again while it is queued or running
gives that one. A finished drill (done or failed) is kept as `comparisons/<id>/drill.json`, so it
survives a restart and is deleted with its comparison; one still running when the server stops is
lost (ask again). Its state is the `bitguard.drill-state/1` document; when done it carries the
engine's `bitguard.drill/1` document as it is, its paths in the user's terms (user_paths).

The replay writes its records beside the workspace's copy of each run (`runs/<id>/drill/step-K/`),
never into the record. It runs the recorded script, which must be on this machine where it was
recorded: a run uploaded from elsewhere cannot be replayed, and the drill's own error says so (shown
as it is, in the one error shape).

This module knows nothing about HTTP (api_drills.py) and nothing about how a drill replays, traces
or classifies (the engine does that).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bitguard.backend.workspace import Workspace, error_info
from bitguard.errors import BadInput, BitguardError, NotFound

DRILL_STATE_SCHEMA = "bitguard.drill-state/1"
STATES = ("queued", "running", "done", "failed")  # queued: waiting for another comparison's drill
FILE_NAME = "drill.json"
log = logging.getLogger("bitguard.serve")


def _engine_drill(dir_a: str, dir_b: str, rank: int | None, rules: dict | None):
    """The engine's drill (tests put a fake in its place); returns its report."""
    from bitguard.backend.drill import drill

    return drill(dir_a, dir_b, rank=rank, rules=rules)


@dataclass
class _Job:
    comparison: str
    revision: int  # the comparison's revision whose pivot is drilled
    rank: int | None  # the rank asked for; None: the pivot's
    dirs: tuple[str, str]
    rules: dict | None
    created: float = field(default_factory=time.time)
    state: str = "queued"
    started: float | None = None
    finished: float | None = None
    error: dict | None = None
    document: dict | None = None
    exit_status: int | None = None

    def public(self) -> dict:
        end = self.finished if self.finished is not None else time.time()
        return {"schema": DRILL_STATE_SCHEMA, "comparison": self.comparison, "revision": self.revision,
                "rank": self.rank, "state": self.state, "created": self.created, "started": self.started,
                "finished": self.finished, "elapsed_s": None if self.started is None else round(end - self.started, 3),
                "error": self.error, "exit_status": self.exit_status, "document": self.document}


class Drills:
    """The drills of one workspace's comparisons."""

    def __init__(self, ws: Workspace):
        self.ws = ws
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitguard-drill")

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def start(self, cid: str, rank: int | None = None) -> dict:
        """Queue a drill of the comparison's pivot (on `rank`, else the pivot's own); the one queued or
        running already, if there is one. The comparison must be ready and have a pivot."""
        comparison = self.ws.comparison(cid)  # NotFound
        result = self.ws.result(cid)  # ComparisonNotReady while it is computed, or when it failed
        if not result.summary.get("first_divergence"):
            raise BadInput(f"comparison {cid} has no pivot (verdict {comparison['verdict']}): there is nothing to "
                           "drill down into")
        if comparison["resumed_at"]:
            from bitguard.backend.drill import resumed_refusal  # (the engine, imported only when a drill is asked for)

            raise resumed_refusal(comparison["resumed_at"])
        if rank is not None and rank not in (result.ranks or []):
            raise BadInput(f"rank {rank} is not one of the compared ranks {result.ranks}; leave rank out to "
                           "drill the pivot's rank")
        rule_set = comparison["rule_set"]
        rules = self.ws.rules_body(rule_set["id"], rule_set["version"]) if rule_set else None
        dirs = (self.ws.run_path(comparison["run_a"]["id"]), self.ws.run_path(comparison["run_b"]["id"]))
        with self._lock:
            job = self._jobs.get(cid)
            if job is not None and job.state in ("queued", "running"):
                return job.public()
            job = _Job(cid, comparison["revision"], rank, dirs, rules)
            self._jobs[cid] = job
        self._worker.submit(self._run, job)
        return job.public()

    def state(self, cid: str) -> dict:
        """The comparison's latest drill, as `bitguard.drill-state/1`."""
        self.ws.comparison(cid)  # NotFound
        with self._lock:
            job = self._jobs.get(cid)
            if job is not None:
                return job.public()
        stored = self._stored(cid)
        if stored is None:
            raise NotFound(f"comparison {cid} has not been drilled yet; POST /api/comparisons/{cid}/drill starts a "
                           "drill")
        return stored

    def _run(self, job: _Job) -> None:
        try:
            self.ws.comparison(job.comparison)
        except NotFound:  # deleted while the drill was queued
            self._forget(job)
            return
        with self._lock:
            job.state, job.started = "running", time.time()
        try:
            report = _engine_drill(job.dirs[0], job.dirs[1], job.rank, job.rules)
            document = self.ws.path_names().value(json.loads(json.dumps(report.to_dict(), default=str)))
            exit_status = int(report.exit_status)
        except Exception as exc:  # noqa: BLE001 - recorded on the drill and shown to the user
            if not isinstance(exc, BitguardError):
                log.exception("drill of comparison %s failed", job.comparison)
            with self._lock:
                job.state, job.error, job.finished = "failed", error_info(exc, self.ws.path_names()), time.time()
        else:
            with self._lock:
                job.state, job.document, job.exit_status, job.finished = "done", document, exit_status, time.time()
        self._store(job)

    def _forget(self, job: _Job) -> None:
        """Drop a deleted comparison's drill (its file went with the comparison's folder)."""
        with self._lock:
            if self._jobs.get(job.comparison) is job:
                del self._jobs[job.comparison]

    def _folder(self, cid: str) -> Path:
        return self.ws.root / "comparisons" / cid

    def _store(self, job: _Job) -> None:
        try:
            self.ws.comparison(job.comparison)
        except NotFound:
            self._forget(job)
            return
        folder = self._folder(job.comparison)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{secrets.token_hex(4)}.tmp"
        tmp.write_text(json.dumps(job.public(), default=str))
        os.replace(tmp, folder / FILE_NAME)

    def _stored(self, cid: str) -> dict | None:
        path = self._folder(cid) / FILE_NAME
        try:
            stored = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            stored, why = None, f"{type(exc).__name__}"
        else:
            why = "not a bitguard.drill-state/1 document of a finished drill"
        if isinstance(stored, dict) and stored.get("schema") == DRILL_STATE_SCHEMA and \
                stored.get("state") in ("done", "failed"):
            return stored
        log.warning("comparison %s: its stored drill cannot be read (%s)", cid, why)
        return {"schema": DRILL_STATE_SCHEMA, "comparison": cid, "revision": None, "rank": None, "state": "failed",
                "created": None, "started": None, "finished": None, "elapsed_s": None, "exit_status": None,
                "document": None, "error": {"type": "CorruptRun", "message": f"this comparison's stored drill cannot "
                                                                             f"be read ({why}); drill it again"}}
