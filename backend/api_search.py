"""The search resource of the explorer's API: find events of a ready comparison by boundary glob,
module type, phase, step and status, a page at a time, and the next or previous match from a
position (what the timeline's "next divergence", "next gap" and search box ask for).

`routes(ws, config)` is the router server.py mounts; the finding is backend/search.py's.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query

from bitguard.backend import api_models as m
from bitguard.backend.search import STATUS_FILTERS, finder
from bitguard.backend.search import Query as Find

SCHEMA = "bitguard.search/1"  # the answer of GET /api/comparisons/{id}/search


def routes(ws, config) -> APIRouter:
    router = APIRouter()

    @router.get("/api/comparisons/{cid}/search", tags=["comparisons"], response_model=m.SearchPage,
                responses=m.ERROR_RESPONSES)
    def search(cid: str, rank: int = 0,
               boundary: str | None = Query(None, description="glob over dotted names, from any part "
                                                              "(`blocks.5.mlp*`); plain text: a substring"),
               module_type: str | None = Query(None, description="exact name or glob (`*Norm`)"),
               phase: str | None = Query(None, description="forward, backward, optimizer...; comma-separated"),
               step_min: int | None = Query(None, description="first step, inclusive"),
               step_max: int | None = Query(None, description="last step, inclusive"),
               status: str | None = Query(None, description=f"one of {', '.join(STATUS_FILTERS)} (gap: only_a "
                                                            "or only_b; difference: diverged or a gap)"),
               at: int | None = Query(None, alias="from", description="a position: the hit is the next match "
                                                                      "after it, or the previous one before it"),
               direction: Literal["next", "prev"] = "next",
               offset: int = Query(0, ge=0), limit: int = Query(50, ge=0)):
        """Events of one rank matching every filter given, in aligned order, a page at a time, with
        the next (or previous) match from position `from` as `hit` ({index, event}, null past the
        end). Next divergence: `?status=diverged&from=POS&limit=0`; next gap: `status=gap`.

        Answered from sorted arrays of positions kept per query (bitguard.backend.search), so a
        step to the next match costs a binary search at any size; the first use of a query scans
        the rank's columns once, vectorised."""
        tl = ws.result(cid).timeline(rank)
        q = Find(boundary=boundary or None, module_type=module_type or None, phase=phase or None,
                 step_min=step_min, step_max=step_max, status=status or None)
        return {"schema": SCHEMA, "rank": rank, **finder(tl).search(q, offset, min(limit, config.max_page), at, direction)}

    return router
