"""`bitguard serve`: the explorer's REST API and the browser front end, over one workspace.

`create_app(workspace_dir)` builds the FastAPI app; `serve(workspace, host, port)` runs it
under uvicorn, on 127.0.0.1 unless told otherwise. Uploads stream straight into a temporary
folder inside the workspace, are checked (safe relative paths, size limits, the engine's
`open_run`) and only then renamed into place, so a rejected or interrupted upload leaves
nothing behind. Every `BitguardError` (and every other failure) reaches the browser as
`{"error": {"type": ..., "message": ...}}`.

This module knows HTTP; what a workspace holds is workspace.py, what a comparison finds is the
engine's.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from python_multipart.multipart import parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from bitguard.backend import api_models as m
from bitguard.backend.uploads import UploadLimits, receive_run
from bitguard.backend.timelines import DEFAULT_BINS
from bitguard.backend.workspace import Workspace, validate_rules
from bitguard.errors import BadInput, BitguardError, TooLarge

log = logging.getLogger("bitguard.serve")
MAX_JSON_DEPTH = 64  # deepest nesting a rules file may have (a real one has 4)

FRONTEND = Path(__file__).resolve().parent.parent / "frontend"
GiB = 1 << 30


@dataclass
class ServerConfig:
    max_file_bytes: int = 8 * GiB  # largest single file in a run upload (env BITGUARD_MAX_FILE_BYTES)
    max_run_bytes: int = 32 * GiB  # largest run upload, all files together (env BITGUARD_MAX_RUN_BYTES)
    max_files: int = 4096  # most files in one run upload (env BITGUARD_MAX_FILES)
    raw_event_limit: int = 1500  # a timeline window with at most this many events is sent event by event
    max_bins: int = 4000  # most bins one timeline request may ask for
    max_page: int = 5000  # most rows one events page may hold

    @classmethod
    def from_env(cls, env=os.environ) -> "ServerConfig":
        """Defaults, with the upload limits overridden by BITGUARD_MAX_* environment variables."""
        config = cls()
        for name in ("max_file_bytes", "max_run_bytes", "max_files"):
            raw = env.get(f"BITGUARD_{name.upper()}")
            if raw:
                try:
                    setattr(config, name, int(float(raw)))
                except ValueError:
                    raise BadInput(f"BITGUARD_{name.upper()}={raw!r} is not a number of bytes/files") from None
        return config



def default_workspace() -> str:
    import platformdirs

    return platformdirs.user_data_dir("bitguard")


# -- the app ------------------------------------------------------------------------------------

def _error(status: int, type_: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": type_, "message": message}}, status_code=status)


def _depth(value) -> int:
    """How deeply a parsed JSON value nests (iterative: a deep value cannot exhaust the stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _rules_json(raw: bytes):
    """A rules file's JSON, refused (BadInput) when it is not JSON or nests deeper than any rules file."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadInput(f"the rules file nests deeper than {MAX_JSON_DEPTH} levels: it is not a rules file; "
                       "export one from the rules panel") from None
    except ValueError as exc:
        raise BadInput(f"the rules file is not JSON ({exc}); export one from the rules panel or "
                       "write one as docs describe") from None
    if _depth(body) > MAX_JSON_DEPTH:
        raise BadInput(f"the rules file nests deeper than {MAX_JSON_DEPTH} levels: it is not a rules file; "
                       "export one from the rules panel")
    return body


def create_app(workspace_dir: str | os.PathLike | None = None, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig.from_env()
    ws = Workspace(workspace_dir or default_workspace(), raw_event_limit=config.raw_event_limit)
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        yield
        ws.close()

    app = FastAPI(title="bitguard explorer", version="1", lifespan=lifespan,
                  description="Upload two runs, compare them, walk from the pivot through what it corrupted, "
                              "and curate benign-difference rules.")
    app.state.workspace = ws
    app.state.config = config

    @app.exception_handler(BitguardError)
    async def _bitguard_error(_request: Request, exc: BitguardError):
        return _error(exc.http_status, type(exc).__name__, ws.path_names().text(exc.message))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        problems = [f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'request'}: {e.get('msg')}"
                    for e in exc.errors()[:4]]
        message = "; ".join(problems or ["invalid request"])
        return _error(400, "BadInput", f"{message} (the API is described at /openapi.json)")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return _error(404, "NotFound", f"no such page or API route: {request.url.path}; the API is under /api, "
                                           "described at /openapi.json")
        if exc.status_code == 405:
            return _error(405, "BadInput", f"{request.method} is not allowed on {request.url.path}")
        return _error(exc.status_code, "BadInput", str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception):
        # no input we know of ends here: each one is a BitguardError above; this is for bugs
        text = ws.path_names().text(str(exc).splitlines()[0] if str(exc) else "")
        return _error(500, "InternalError", f"internal error ({type(exc).__name__}: {text}); a bug in bitguard: "
                                            "please report it with the server's log")

    errors = m.ERROR_RESPONSES

    # -- runs ---------------------------------------------------------------------------
    @app.get("/api/health", tags=["meta"])
    def health() -> dict:
        return {"ok": True, "workspace": str(ws.root)}

    @app.get("/api/schema", tags=["meta"])
    def schema() -> dict:
        """The vocabularies the browser offers (phases, roles, rule actions), from their one definition."""
        from bitguard.backend import rules
        from bitguard.backend.timelines import STATUS_CODES
        from bitguard.schema import PHASES, ROLES

        return {"phases": list(PHASES), "roles": list(ROLES), "rule_actions": list(rules.ACTIONS),
                "rule_match_fields": list(rules.MATCH_FIELDS), "rules_schema": rules.RULES_SCHEMA,
                "status_codes": list(STATUS_CODES)}

    @app.get("/api/limits", tags=["runs"], response_model=m.UploadLimits)
    def limits():
        return {k: v for k, v in asdict(config).items() if k in m.UploadLimits.model_fields}

    @app.post("/api/runs", tags=["runs"], response_model=m.RunPublic, status_code=201, responses=errors,
              openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                  "type": "object",
                  "properties": {
                      "name": {"type": "string", "description": "run name (default: the uploaded folder's name)"},
                      "files": {"type": "array", "items": {"type": "string", "format": "binary"},
                                "description": "the run folder's files, each with its relative path as filename"},
                  }}}}}})
    async def upload_run(request: Request, name: str | None = Query(None, description="run name")):
        """Upload a run directory: multipart parts whose filenames are paths relative to the run folder.

        The run is read completely (every rank, as a comparison reads it) before it is kept; a run
        that cannot be read is refused with a message that names the uploaded folder."""
        limits = UploadLimits(config.max_file_bytes, config.max_run_bytes, config.max_files)
        with ws.staging() as staged:
            payload = staged / "payload"
            payload.mkdir()
            got = await receive_run(request, payload, limits)
            run_name = name or got.fields.get("name") or got.folder or "run"
            shown = got.folder or run_name  # how the user's folder reads in messages
            return await run_in_threadpool(ws.commit_run, got.root, run_name, None, shown)

    @app.get("/api/runs", tags=["runs"], response_model=list[m.RunPublic])
    def list_runs():
        return ws.runs()

    @app.get("/api/runs/{run_id}", tags=["runs"], response_model=m.RunPublic, responses=errors)
    def get_run(run_id: str):
        return ws.run(run_id)

    @app.delete("/api/runs/{run_id}", tags=["runs"], status_code=204, responses=errors)
    def delete_run(run_id: str):
        """Delete a run and the comparisons that use it (also one being created or computed meanwhile).
        A second DELETE of the same run, even one sent at the same moment, answers 404 NotFound."""
        ws.delete_run(run_id)
        return Response(status_code=204)

    # -- rule sets ----------------------------------------------------------------------
    def _rules_file(rules: list[dict]) -> dict:
        from bitguard.backend.rules import RULES_SCHEMA

        return {"schema": RULES_SCHEMA, "rules": rules}

    @app.get("/api/rulesets", tags=["rules"], response_model=list[m.RuleSetPublic])
    def list_rule_sets():
        return ws.rule_sets()

    @app.post("/api/rulesets", tags=["rules"], response_model=m.RuleSetPublic, status_code=201, responses=errors)
    def create_rule_set(body: m.RuleSetCreate):
        return ws.create_rule_set(body.name, _rules_file(body.rules))

    @app.post("/api/rulesets/import", tags=["rules"], response_model=m.RuleSetPublic, status_code=201,
              responses=errors)
    async def import_rule_set(request: Request, name: str | None = Query(None, description="name (default: file's)")):
        """Import a rules file (the JSON `compare --rules` reads), as a raw JSON body or a multipart `file`."""
        ctype, _ = parse_options_header(request.headers.get("content-type", ""))
        filename = None
        if ctype == b"multipart/form-data":
            form = await request.form(max_files=1, max_fields=4)
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise BadInput("send the rules file as the multipart part named 'file'")
            raw = await upload.read(1_000_001)
            filename = upload.filename
            name = name or (form.get("name") if isinstance(form.get("name"), str) else None)
        else:
            raw = await request.body()
        if len(raw) > 1_000_000:
            raise TooLarge("a rules file over 1 MB is not a rules file")
        body = _rules_json(raw)
        stem = Path(filename).name.split(".")[0] if filename else None
        return ws.create_rule_set(name or stem or "imported rules", validate_rules(body))

    @app.get("/api/rulesets/{rule_set_id}", tags=["rules"], response_model=m.RuleSetPublic, responses=errors)
    def get_rule_set(rule_set_id: str, version: int | None = Query(None, description="a saved version; latest")):
        return ws.rule_set(rule_set_id, version)

    @app.put("/api/rulesets/{rule_set_id}", tags=["rules"], response_model=m.RuleSetPublic, responses=errors)
    def update_rule_set(rule_set_id: str, body: m.RuleSetUpdate):
        """Rename and/or save the rules as the next version; comparisons using the set rerun."""
        out = ws.update_rule_set(rule_set_id, body.name, None if body.rules is None else _rules_file(body.rules))
        for cid in out.get("comparisons", []):
            ws.rerun(cid)
        return out

    @app.delete("/api/rulesets/{rule_set_id}", tags=["rules"], status_code=204, responses=errors)
    def delete_rule_set(rule_set_id: str):
        ws.delete_rule_set(rule_set_id)
        return Response(status_code=204)

    @app.post("/api/rulesets/{rule_set_id}/copy", tags=["rules"], response_model=m.RuleSetPublic, status_code=201,
              responses=errors)
    def copy_rule_set(rule_set_id: str, body: m.RuleSetCopy):
        """Save a rule set (or one of its versions) under a new name."""
        return ws.create_rule_set(body.name, ws.rules_body(rule_set_id, body.version))

    @app.get("/api/rulesets/{rule_set_id}/export", tags=["rules"], responses=errors)
    def export_rule_set(rule_set_id: str, version: int | None = None):
        """The rules file, as `bitguard compare --rules FILE` reads it."""
        rs = ws.rule_set(rule_set_id, version)
        safe = re.sub(r"[^\w.-]+", "-", rs["name"]).strip("-") or "rules"
        return JSONResponse(rs["file"], headers={
            "Content-Disposition": f'attachment; filename="{safe}.v{rs["version"]}.rules.json"'})

    # -- comparisons --------------------------------------------------------------------
    @app.post("/api/comparisons", tags=["comparisons"], response_model=m.ComparisonPublic, status_code=202,
              responses=errors)
    def create_comparison(body: m.ComparisonCreate):
        """Start comparing two runs; poll GET /api/comparisons/{id} until status is ready."""
        return ws.create_comparison(body.run_a, body.run_b, body.rule_set_id)

    @app.get("/api/comparisons", tags=["comparisons"], response_model=list[m.ComparisonPublic])
    def list_comparisons():
        return ws.comparisons()

    @app.get("/api/comparisons/{cid}", tags=["comparisons"], response_model=m.ComparisonPublic, responses=errors)
    def get_comparison(cid: str):
        """The comparison's status and, once ready, its summary (the `bitguard.compare/1` document)."""
        return ws.comparison(cid)

    @app.delete("/api/comparisons/{cid}", tags=["comparisons"], status_code=204, responses=errors)
    def delete_comparison(cid: str):
        ws.delete_comparison(cid)
        return Response(status_code=204)

    @app.post("/api/comparisons/{cid}/rerun", tags=["comparisons"], response_model=m.ComparisonPublic,
              status_code=202, responses=errors)
    def rerun_comparison(cid: str, body: m.ComparisonRerun | None = None):
        """Recompute with the latest version of its rule set, or attach another rule set first."""
        body = body or m.ComparisonRerun()
        if body.rule_set_id is None and body.keep_rule_set:
            return ws.rerun(cid)
        return ws.rerun(cid, body.rule_set_id)

    @app.get("/api/comparisons/{cid}/pivot", tags=["comparisons"], response_model=m.Pivot, responses=errors)
    def pivot(cid: str):
        """The first divergent event with its blame, blame window, call stack and tensor digests."""
        result = ws.result(cid)
        s = result.summary
        return {"verdict": s.get("verdict"), "first_divergence": s.get("first_divergence"),
                "position": result.pivot_position(), "rules_fired": s.get("rules_fired") or [],
                "inconclusive": s.get("inconclusive")}

    @app.get("/api/comparisons/{cid}/timeline", tags=["comparisons"], response_model=m.Timeline, responses=errors)
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

    @app.get("/api/comparisons/{cid}/events", tags=["comparisons"], response_model=m.EventsPage, responses=errors)
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

    @app.get("/api/comparisons/{cid}/events/{rank}/{side}/{seq}", tags=["comparisons"], response_model=m.EventDetail,
             responses=errors)
    def event_detail(cid: str, rank: int, side: Literal["a", "b"], seq: int):
        """One event: its fields, call stack, and tensor digests on both sides."""
        result = ws.result(cid)
        tl = result.timeline(rank)
        with result.lock:
            detail = result.engine.event_detail(rank, side, seq)
        return {**detail, "pos": tl.locate(side, seq)}

    @app.get("/api/comparisons/{cid}/graph", tags=["comparisons"], responses=errors)
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

    @app.get("/api/comparisons/{cid}/graph/nodes/{node_id}", tags=["comparisons"], response_model=m.Neighbours,
             responses=errors)
    def neighbours(cid: str, node_id: str):
        """A node of the propagation graph with the divergent events it fed (consumers) and was fed by."""
        result = ws.result(cid)
        with result.lock:
            n = result.engine.neighbours(node_id)
        return {"node": result.with_positions(n["node"]),
                "consumers": [result.with_positions(c) for c in n.get("consumers", [])],
                "producers": [result.with_positions(p) for p in n.get("producers", [])]}

    @app.get("/api/comparisons/{cid}/perfetto", tags=["comparisons"], responses=errors)
    def perfetto(cid: str):
        """The comparison as a Perfetto trace (open it at ui.perfetto.dev)."""
        path = ws.perfetto_path(cid)
        c = ws.comparison(cid)
        name = re.sub(r"[^\w.-]+", "-", f"{c['run_a']['name']}-vs-{c['run_b']['name']}").strip("-")
        return FileResponse(path, media_type="application/octet-stream", filename=f"{name}.pftrace")

    # -- the front end ------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    def index():
        return FileResponse(FRONTEND / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/static/vendor/plotly.min.js", include_in_schema=False)
    def plotly_js():
        import plotly

        return FileResponse(Path(plotly.__file__).parent / "package_data" / "plotly.min.js",
                            media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    app.mount("/static", StaticFiles(directory=FRONTEND), name="static")
    return app


def serve(workspace: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          config: ServerConfig | None = None, demo: tuple[str, str] | None = None) -> None:
    """Run the explorer until interrupted. Binds to loopback unless `host` says otherwise.

    `demo`: two run directories on this machine to import (once) and compare; the printed
    address opens that comparison.
    """
    import uvicorn

    app = create_app(workspace, config)
    ws = app.state.workspace
    page = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/"
    if demo:
        run_a, run_b = (ws.import_run(path) for path in demo)
        page += f"#/c/{ws.ensure_comparison(run_a['id'], run_b['id'])['id']}"
    print(f"bitguard explorer: {page}  (workspace {ws.root}; Ctrl-C stops it)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
