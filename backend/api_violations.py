"""The violations resource of the explorer's API: a run's training-invariant violations.

`routes(ws)` is the router server.py mounts:
- `GET /api/runs/{run_id}/violations`: `bitguard.violations/1`, what the run recorded while it
  trained with `--check` (backend/invariants/recorded.py reads the table);
- `POST /api/runs/{run_id}/violations` with a `bitguard.invariants/1` document as the body: the
  `bitguard.invariant-check/1` of the run checked offline against it (backend/invariants/check.py),
  with the applied and skipped invariants. A run without API events, or a body that is not an
  invariants document, is bad input in the one error shape. Nothing here reads a table itself.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body

from bitguard.backend import api_models as m


def routes(ws) -> APIRouter:
    router = APIRouter()

    @router.get("/api/runs/{run_id}/violations", tags=["runs"], responses=m.ERROR_RESPONSES)
    def run_violations(run_id: str) -> dict:
        """The invariant violations the run recorded while training with `bitguard record --check`
        (`bitguard.violations/1`): each with its step, rank, invariant, template, message and
        evidence, counts per invariant with the first step, and notes (a run not recorded with
        --check: an empty list then says nothing)."""
        from bitguard.backend.invariants.recorded import read_violations

        return read_violations(ws.run_path(run_id))

    @router.post("/api/runs/{run_id}/violations", tags=["runs"], responses=m.ERROR_RESPONSES)
    def check_run_violations(run_id: str, invariants: dict[str, Any] = Body(...)) -> dict:
        """Check the run offline against the `bitguard.invariants/1` document in the body
        (`bitguard.invariant-check/1`: violations, applied and skipped invariants with why, verdict)."""
        from bitguard.backend.invariants.check import parse_invariants
        from bitguard.backend.invariants.commands import check_doc

        return check_doc(ws.run_path(run_id), parse_invariants(invariants, "the request body"))

    return router
