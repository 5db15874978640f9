"""The explorer's workspace: the catalogue (catalogue.py) joined with the comparison jobs (comparison_jobs.py).

`Workspace` is what the API's routers and the drills use: a `Catalogue` of runs, rule sets and
comparison records whose comparison operations also schedule, find and drop the computed results.
A comparison is queued when created or rerun; a ready one whose result is not in memory (after a
restart) is queued again the first time it is asked for; deleting one (or its run) drops its
result. `validate_rules`, `error_info` and `KEEP` are re-exported for the modules that import
them from here.

This module knows nothing about HTTP, SQL (catalogue.py) or the engine (comparison_jobs.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from pathlib import Path

from bitguard.backend.catalogue import KEEP, Catalogue, validate_rules
from bitguard.backend.comparison_jobs import ComparisonJobs, error_info
from bitguard.backend.timelines import Result
from bitguard.errors import ComparisonNotReady, NotFound

__all__ = ["KEEP", "Workspace", "error_info", "validate_rules"]


class Workspace(Catalogue):
    def __init__(self, root: str | os.PathLike, raw_event_limit: int | None = None):
        super().__init__(root)
        self.jobs = ComparisonJobs(self, raw_event_limit)

    def close(self) -> None:
        self.jobs.close()
        super().close()

    def delete_rule_set(self, rule_set_id: str) -> None:
        """Delete a rule set; the comparisons that used it are recomputed without rules."""
        for cid in super().delete_rule_set(rule_set_id):
            with contextlib.suppress(NotFound):  # deleted meanwhile: nothing to rerun
                self.rerun(cid)

    # -- comparisons ---------------------------------------------------------------------
    def create_comparison(self, run_a: str, run_b: str, rule_set_id: str | None = None, resumed_at: int = 0) -> dict:
        """Queue a comparison (see Catalogue.add_comparison)."""
        with self.lock:
            cid = self.add_comparison(run_a, run_b, rule_set_id, resumed_at)
            self.jobs.schedule(cid, 1)
            return self.comparison(cid)

    def ensure_comparison(self, run_a: str, run_b: str) -> dict:
        """The latest comparison of these two runs without rules, made if there is none."""
        with self.lock:
            cid = self.latest_comparison(run_a, run_b)
            return self.comparison(cid) if cid else self.create_comparison(run_a, run_b)

    def comparisons(self) -> list[dict]:
        # listing does not recompute: after a restart a comparison is recomputed when opened
        return [self.comparison_listed(r, self.jobs.results.get(r["id"])) for r in self.comparison_records()]

    def comparison(self, cid: str) -> dict:
        """The comparison's record; a ready one not in memory (after a restart) is recomputed."""
        rec = self._record(cid)
        if rec["status"] in ("ready", "stale") and cid not in self.jobs.results and cid not in self.jobs.pending:
            self._exec("UPDATE comparisons SET status = 'queued' WHERE id = ?", (cid,))
            self.jobs.schedule(cid, rec["revision"])
            rec = self._record(cid)
        return self.comparison_listed(rec, self.jobs.results.get(cid))

    def rerun(self, cid: str, rule_set_id: str | None | object = KEEP, version: int | None = None) -> dict:
        """Recompute with the latest version of the comparison's rule set (or its saved `version`), or
        with `rule_set_id` (None: no rules) attached instead."""
        self.jobs.schedule(cid, self.requeue(cid, rule_set_id, version))
        return self.comparison(cid)

    def delete_comparison(self, cid: str) -> None:
        """Delete a comparison and its result; a computation of it still running keeps nothing."""
        with self.lock:
            super().delete_comparison(cid)
            self.jobs.forget(cid)

    def result(self, cid: str) -> Result:
        rec = self._record(cid)
        result = self.jobs.results.get(cid)
        if result is None or rec["status"] != "ready":
            if rec["status"] == "failed":
                err = json.loads(rec["error"])
                raise ComparisonNotReady(f"comparison {cid} failed: {err['message']}")
            if cid not in self.jobs.pending and result is None:
                self.comparison(cid)  # schedules the recomputation
            raise ComparisonNotReady(f"comparison {cid} is {rec['status']}; poll GET /api/comparisons/{cid} "
                                     "until its status is ready")
        return result

    def perfetto_path(self, cid: str) -> Path:
        result = self.result(cid)
        folder = self.root / "comparisons" / cid
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"r{result.revision}.pftrace"
        if not path.exists():
            tmp = folder / f".{secrets.token_hex(4)}.tmp"
            with result.lock:
                result.engine.export_perfetto(str(tmp))
            os.replace(tmp, path)
        return path

    def wait(self, cid: str, timeout: float = 60.0) -> dict:
        """Block until the comparison is ready or failed (for scripts and tests)."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.comparison(cid)
            if c["status"] in ("ready", "failed") or time.monotonic() > deadline:
                return c
            time.sleep(0.02)
