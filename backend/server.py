"""`bitguard serve`: the explorer's REST API and the browser front end, over one workspace.

`create_app(workspace_dir)` builds the FastAPI app from one router per resource (api_runs.py,
api_rule_sets.py, api_comparisons.py) and the front end; `serve(workspace, host, port)` runs it
under uvicorn, on 127.0.0.1 unless told otherwise. Uploads stream straight into a temporary
folder inside the workspace, are read whole (run_admission.py) and only then renamed into
place, so a rejected or interrupted upload leaves nothing behind. Every `BitguardError` reaches
the browser as `{"error": {"type": ..., "message": ...}}` with its status and its paths in the
user's terms (user_paths.py); anything else is a bug and a 500 "internal error" in that shape.

This module knows HTTP; what a workspace holds is workspace.py, what a comparison finds is the
engine's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from bitguard.backend import api_alerts, api_comparisons, api_drills, api_panels, api_rule_sets, api_runs, api_search
from bitguard.backend import api_violations
from bitguard.backend.drills import Drills
from bitguard.backend.workspace import Workspace
from bitguard.errors import BadInput, BitguardError

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


def _error_handlers(app: FastAPI, ws: Workspace) -> None:
    """The one error shape for every failure, its paths in the user's terms."""
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


def create_app(workspace_dir: str | os.PathLike | None = None, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig.from_env()
    ws = Workspace(workspace_dir or default_workspace(), raw_event_limit=config.raw_event_limit)
    drills = Drills(ws)
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        yield
        drills.close()
        ws.close()

    app = FastAPI(title="bitguard explorer", version="1", lifespan=lifespan,
                  description="Upload two runs, compare them, walk from the pivot through what it corrupted, "
                              "and curate benign-difference rules.")
    app.state.workspace = ws
    app.state.drills = drills
    app.state.config = config

    _error_handlers(app, ws)

    # -- meta ---------------------------------------------------------------------------
    @app.get("/api/health", tags=["meta"])
    def health() -> dict:
        return {"ok": True, "workspace": str(ws.root)}

    @app.get("/api/schema", tags=["meta"])
    def schema() -> dict:
        """The vocabularies the browser offers (phases, roles, rule actions) and the timeline's statuses
        (least to most severe) with the code each event status is drawn as, from their one definition."""
        from bitguard.backend import rules
        from bitguard.backend.statuses import STATUS_CODES, STATUS_OF_EVENT
        from bitguard.schema import PHASES, ROLES

        return {"phases": list(PHASES), "rule_phases": [*PHASES, rules.READ], "roles": list(ROLES),
                "rule_actions": list(rules.ACTIONS),
                "rule_match_fields": list(rules.MATCH_FIELDS), "rules_schema": rules.RULES_SCHEMA,
                "status_codes": list(STATUS_CODES), "status_of_event": dict(STATUS_OF_EVENT)}

    app.include_router(api_runs.routes(ws, config))
    app.include_router(api_alerts.routes(ws))
    app.include_router(api_violations.routes(ws))
    app.include_router(api_rule_sets.routes(ws))
    app.include_router(api_comparisons.routes(ws, config))
    app.include_router(api_search.routes(ws, config))
    app.include_router(api_panels.routes(ws))
    app.include_router(api_drills.routes(drills))

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
