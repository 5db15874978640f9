"""The comparisons resource of the explorer's API: start, poll, rerun and delete comparisons, and
read a ready one: pivot, timeline windows, events, one event's detail, the propagation graph and
its neighbours, the Perfetto trace.

`routes(ws, config)` is the router server.py mounts. The workspace computes and keeps the
results (workspace.py, timelines.py); this module maps them onto routes and limits what one
request may ask for.
"""

from __future__ import annotations

import re
from typing import Literal

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, Response

from bitguard.backend import api_models as m
from bitguard.backend.timelines import DEFAULT_BINS


def routes(ws, config) -> APIRouter:
    router = APIRouter()
    errors = m.ERROR_RESPONSES

    @router.post("/api/comparisons", tags=["comparisons"], response_model=m.ComparisonPublic, status_code=202,
              responses=errors)
    def create_comparison(body: m.ComparisonCreate):
        """Start comparing two runs; poll GET /api/comparisons/{id} until status is ready."""
        return ws.create_comparison(body.run_a, body.run_b, body.rule_set_id, body.resumed_at)

    @router.get("/api/comparisons", tags=["comparisons"], response_model=list[m.ComparisonPublic])
    def list_comparisons():
        return ws.comparisons()

    @router.get("/api/comparisons/{cid}", tags=["comparisons"], response_model=m.ComparisonPublic, responses=errors)
    def get_comparison(cid: str):
        """The comparison's status and, once ready, its summary (the `bitguard.compare/1` document)."""
        return ws.comparison(cid)

    @router.delete("/api/comparisons/{cid}", tags=["comparisons"], status_code=204, responses=errors)
    def delete_comparison(cid: str):
        ws.delete_comparison(cid)
        return Response(status_code=204)

    @router.post("/api/comparisons/{cid}/rerun", tags=["comparisons"], response_model=m.ComparisonPublic,
              status_code=202, responses=errors)
    def rerun_comparison(cid: str, body: m.ComparisonRerun | None = None):
        """Recompute with the latest version of its rule set (or its saved `rule_set_version`: an earlier
        version's result reopened), or attach another rule set first."""
        body = body or m.ComparisonRerun()
        if body.rule_set_id is None and body.keep_rule_set:
            return ws.rerun(cid, version=body.rule_set_version)
        return ws.rerun(cid, body.rule_set_id, body.rule_set_version)

    @router.get("/api/comparisons/{cid}/pivot", tags=["comparisons"], response_model=m.Pivot, responses=errors)
    def pivot(cid: str):
        """The first divergent event with its blame, blame window, call stack and tensor digests."""
        result = ws.result(cid)
        s = result.summary
        return {"verdict": s.get("verdict"), "first_divergence": s.get("first_divergence"),
                "position": result.pivot_position(), "rules_fired": s.get("rules_fired") or [],
                "inconclusive": s.get("inconclusive")}

    @router.get("/api/comparisons/{cid}/timeline", tags=["comparisons"], response_model=m.Timeline, responses=errors)
    def timeline(cid: str, rank: int = 0, axis: Literal["seq", "time"] = "seq",
                 start: float | None = Query(None, allow_inf_nan=False,
                                             description="window start (position, or ns for axis=time)"),
                 end: float | None = Query(None, allow_inf_nan=False, description="window end, exclusive"),
                 bins: int = Query(DEFAULT_BINS, ge=1, description="bins across the window"),
                 around: int | None = Query(None, description="instead of start/end: a window around this position"),
                 span: int = Query(240, ge=1, description="with around: about how many events the window holds")):
        """One rank's two timelines over a window: per-phase binned status counts, or raw events when few."""
        tl = ws.result(cid).timeline(rank)
        if around is not None:
            start, end = tl.around(axis, around, span)
        out = tl.window(axis, start, end, min(bins, config.max_bins), config.raw_event_limit)
        return {"rank": rank, **out}

    @router.get("/api/comparisons/{cid}/events", tags=["comparisons"], response_model=m.EventsPage, responses=errors)
    def events(cid: str, rank: int | None = None,
               status: str | None = Query(None, description="identical | diverged | benign | only_a | only_b"),
               offset: int = Query(0, ge=0), limit: int = Query(200, ge=1)):
        """Aligned events with their alignment status, a page at a time."""
        import polars as pl

        result = ws.result(cid)
        ranks = [rank] if rank is not None else result.ranks
        frames = [result.timeline(r).frame for r in ranks]
        frame = pl.concat(frames) if frames else pl.DataFrame()
        if status and frame.height:
            frame = frame.filter(pl.col("status") == status)
        limit = min(limit, config.max_page)
        offset = min(offset, frame.height)
        return {"rank": rank, "total": frame.height, "offset": offset, "limit": limit,
                "rows": frame.slice(offset, limit).to_dicts() if frame.height else []}

    @router.get("/api/comparisons/{cid}/events/{rank}/{side}/{seq}", tags=["comparisons"], response_model=m.EventDetail,
             responses=errors)
    def event_detail(cid: str, rank: int, side: Literal["a", "b"], seq: int):
        """One event: its fields, call stack, and tensor digests on both sides."""
        result = ws.result(cid)
        tl = result.timeline(rank)
        with result.lock:
            detail = result.engine.event_detail(rank, side, seq)
        return {**detail, "pos": tl.locate(side, seq)}

    @router.get("/api/comparisons/{cid}/graph", tags=["comparisons"], responses=errors)
    def graph(cid: str, limit: int = Query(2000, ge=1)):
        """The propagation graph (nodes and edges), cut to `limit` nodes."""
        result = ws.result(cid)
        with result.lock:
            g = result.engine.propagation_graph()
        nodes = g.get("nodes", [])
        keep = {n["id"] for n in nodes[:limit]}
        return {"nodes": [result.with_positions(n) for n in nodes[:limit]],
                "edges": [e for e in g.get("edges", []) if e["source"] in keep and e["target"] in keep],
                "total_nodes": len(nodes)}

    # node ids hold a boundary, which may hold "/": the id is the rest of the path
    @router.get("/api/comparisons/{cid}/graph/nodes/{node_id:path}", tags=["comparisons"], response_model=m.Neighbours,
             responses=errors)
    def neighbours(cid: str, node_id: str):
        """A node of the propagation graph with the divergent events it fed (consumers) and was fed by."""
        result = ws.result(cid)
        with result.lock:
            n = result.engine.neighbours(node_id)
        return {"node": result.with_positions(n["node"]),
                "consumers": [result.with_positions(c) for c in n.get("consumers", [])],
                "producers": [result.with_positions(p) for p in n.get("producers", [])]}

    @router.get("/api/comparisons/{cid}/perfetto", tags=["comparisons"], responses=errors)
    def perfetto(cid: str):
        """The comparison as a Perfetto trace (open it at ui.perfetto.dev)."""
        path = ws.perfetto_path(cid)
        c = ws.comparison(cid)
        name = re.sub(r"[^\w.-]+", "-", f"{c['run_a']['name']}-vs-{c['run_b']['name']}").strip("-")
        return FileResponse(path, media_type="application/octet-stream", filename=f"{name}.pftrace")

    return router
