"""The alerts resource of the explorer's API: an online-mode run's alerts, as `bitguard alerts` gives them.

`routes(ws)` is the router server.py mounts: `GET /api/runs/{run_id}/alerts` answers the
`bitguard.alerts/1` document of a run in the workspace (backend/alerts.py reads it); a run recorded
in another mode is a `NotSupported` in the one error shape. Nothing here reads a table itself.
"""

from __future__ import annotations

from fastapi import APIRouter

from bitguard.backend import api_models as m
from bitguard.backend.alerts import read_alerts


def routes(ws) -> APIRouter:
    router = APIRouter()

    @router.get("/api/runs/{run_id}/alerts", tags=["runs"], responses=m.ERROR_RESPONSES)
    def run_alerts(run_id: str) -> dict:
        """The run's online alerts (`bitguard.alerts/1`): each alert in its latest state with the row
        that raised it and the verifier's verdict, counts by state, what each sensor saw and checked,
        the verifier's queue and latency, and for a confirmed alert how to replay its step offline.
        A run not recorded with --mode online is refused (400 NotSupported)."""
        return read_alerts(ws.run_path(run_id)).to_dict()

    return router
