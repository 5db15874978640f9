"""The drill resource of the explorer's API: start a comparison's drill-down and poll it.

`routes(drills)` is the router server.py mounts; the drills themselves (worker, state, storage)
are backend/drills.py and what a drill finds is the engine's (`bitguard.drill/1`).
"""

from __future__ import annotations

from fastapi import APIRouter

from bitguard.backend import api_models as m


def routes(drills) -> APIRouter:
    router = APIRouter()
    errors = m.ERROR_RESPONSES

    @router.post("/api/comparisons/{cid}/drill", tags=["comparisons"], response_model=m.DrillState, status_code=202,
                 responses=errors)
    def start_drill(cid: str, body: m.DrillCreate | None = None):
        """Drill down from the pivot to the operation: replay both runs' pivot step and trace the blame window
        op by op (seconds to minutes); poll GET .../drill. While a drill runs, this returns that one."""
        return drills.start(cid, (body or m.DrillCreate()).rank)

    @router.get("/api/comparisons/{cid}/drill", tags=["comparisons"], response_model=m.DrillState, responses=errors)
    def get_drill(cid: str):
        """The comparison's latest drill: running, done (with its `bitguard.drill/1` document) or failed."""
        return drills.state(cid)

    return router
