"""Comparison jobs: the worker thread that computes comparisons, and the results it keeps in memory.

Comparisons run one at a time on one worker thread through the comparison engine
(`bitguard.compare`). A job is a comparison at one revision: it reads the record and its rule-set
version from the catalogue, runs the engine, and keeps the result, as a `timelines.Result` (the
engine's object plus, per rank, the few numpy columns the timelines are binned from), only if
the record is still at that revision when it finishes (a comparison rerun or deleted meanwhile
keeps nothing). A failure is stored on the record as `error_info` says. Results live in memory
only: after a restart the workspace queues a comparison again when it is asked for.

This module knows nothing about HTTP, and nothing about how runs are aligned or blamed (the engine).
"""

from __future__ import annotations

import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from bitguard.backend import divergences
from bitguard.backend.timelines import Result
from bitguard.backend.user_paths import PathNames
from bitguard.errors import BitguardError, NotFound

if TYPE_CHECKING:
    from bitguard.backend.catalogue import Catalogue


def _engine_compare(dir_a: str, dir_b: str, rules, resumed_at: int = 0):
    import bitguard

    compare = getattr(bitguard, "compare", None)
    if compare is None:  # the package root may not re-export it
        from bitguard.backend.compare import compare
    return compare(dir_a, dir_b, rules=rules, resumed_at=resumed_at)


def _warm_engine() -> None:
    """Import the engine on the worker before the first comparison asks for it (seconds, once)."""
    try:
        import bitguard.backend.compare  # noqa: F401
    except Exception:  # noqa: BLE001 - the first comparison will report the same failure properly
        pass


def error_info(exc: BaseException, names: PathNames) -> dict:
    """What a failed background job (a comparison, a drill) shows: a `BitguardError` as its class and
    message, anything else as an internal error (a bug); paths in the user's terms."""
    if isinstance(exc, BitguardError):
        return {"type": type(exc).__name__, "message": names.text(str(exc))}
    return {"type": "InternalError", "message": f"internal error ({type(exc).__name__}: {names.text(str(exc))}); "
                                                "a bug in bitguard: please report it"}


class ComparisonJobs:
    """The comparison worker of one catalogue, and the results it computed."""

    def __init__(self, catalogue: "Catalogue", raw_event_limit: int | None = None):
        self.catalogue = catalogue
        self.raw_event_limit = raw_event_limit  # when set, overview windows are made with each result
        self.results: dict[str, Result] = {}
        self.pending: dict[str, int] = {}  # comparison id -> revision queued
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitguard-compare")
        self._worker.submit(_warm_engine)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def schedule(self, cid: str, revision: int) -> None:
        with self.catalogue.lock:
            self.pending[cid] = revision
        self._worker.submit(self._compute, cid, revision)

    def forget(self, cid: str) -> None:
        """Drop what is kept of a deleted comparison; a job of it still running keeps nothing."""
        with self.catalogue.lock:
            self.results.pop(cid, None)
            self.pending.pop(cid, None)

    def _compute(self, cid: str, revision: int) -> None:
        cat = self.catalogue
        try:
            rec = cat._record(cid)
        except NotFound:
            self.pending.pop(cid, None)
            return
        if rec["revision"] != revision:
            return  # a newer rerun is queued behind this one
        cat.set_status(cid, "running")
        try:
            rules = cat.rules_body(rec["rule_set"], rec["rule_set_version"]) if rec["rule_set"] else None
            engine_obj = _engine_compare(str(cat.root / "runs" / rec["run_a"]), str(cat.root / "runs" / rec["run_b"]),
                                         rules, int(rec.get("resumed_at") or 0))
            result = Result(engine_obj, revision, self.raw_event_limit, cat.path_names())
            divergences.table_of(result)  # the divergences table is ready with the result, not at its first page
        except Exception as exc:  # noqa: BLE001 - recorded on the comparison and shown to the user
            error = error_info(exc, cat.path_names())
            with cat.lock:
                if cat.is_current(cid, revision):
                    cat.set_status(cid, "failed", error=error)
                    self.pending.pop(cid, None)
                    self.results.pop(cid, None)
            if not isinstance(exc, BitguardError):
                traceback.print_exc()
            return
        with cat.lock:
            if cat.is_current(cid, revision):
                self.results[cid] = result
                cat.set_status(cid, "ready", summary=result.summary)
                self.pending.pop(cid, None)
