"""The explorer's panels beside the timelines, as routes of a ready comparison: the divergences
table and the loss curve.

`routes(ws)` is the router server.py mounts. What each answer holds is the document of its module
(divergences.py: `bitguard.divergences/1`, loss_curve.py: `bitguard.loss_curve/1`); this module
only maps them onto routes and reads the query.
"""

from __future__ import annotations

from fastapi import APIRouter, Query

from bitguard.backend import api_models as m
from bitguard.backend import divergences, loss_curve


def routes(ws) -> APIRouter:
    router = APIRouter()
    errors = m.ERROR_RESPONSES

    @router.get("/api/comparisons/{cid}/divergences", tags=["comparisons"], responses=errors)
    def divergence_table(cid: str, rank: int | None = None,
                         phase: str | None = Query(None, description="forward | backward | optimizer | ..."),
                         module_type: str | None = Query(None, description="a module type, e.g. Linear"),
                         status: str | None = Query(None, description="comma-separated: diverged, only_a, only_b, "
                                                                      "benign, follows, unobserved"),
                         offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=divergences.MAX_LIMIT)):
        """Every event that is not identical, one row per rank, step, phase, boundary, module type and
        status, with its count and first event (`first_pos`, `side`, `seq`: what the timeline selects),
        in rank then position order; filtered and paged (`bitguard.divergences/1`)."""
        return divergences.page(ws.result(cid), rank=rank, phase=phase, module_type=module_type, status=status,
                                offset=offset, limit=limit)

    @router.get("/api/comparisons/{cid}/loss", tags=["comparisons"], responses=errors)
    def loss(cid: str, rank: int | None = Query(None, description="default: the pivot's rank")):
        """Each run's per-step loss read from a root module's one-element float output, the first step
        where the losses differ and where they differ by more than 1e-3, and the pivot's step; or why no
        loss is known (`unknown`) (`bitguard.loss_curve/1`)."""
        return loss_curve.curve_of(ws.result(cid), rank)

    return router
