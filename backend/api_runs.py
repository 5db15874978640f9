"""The runs resource of the explorer's API: upload a run folder, list, read and delete runs.

`routes(ws, config)` is the router server.py mounts. An upload streams into a staging folder
(uploads.py) and the workspace admits it only once it has read it whole (run_admission.py).
Nothing here knows how a run is read or compared.
"""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from bitguard.backend import api_models as m
from bitguard.backend.uploads import UploadLimits, receive_run


def routes(ws, config) -> APIRouter:
    router = APIRouter()
    errors = m.ERROR_RESPONSES

    @router.get("/api/limits", tags=["runs"], response_model=m.UploadLimits)
    def limits():
        return {k: v for k, v in asdict(config).items() if k in m.UploadLimits.model_fields}

    @router.post("/api/runs", tags=["runs"], response_model=m.RunPublic, status_code=201, responses=errors,
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

    @router.get("/api/runs", tags=["runs"], response_model=list[m.RunPublic])
    def list_runs():
        return ws.runs()

    @router.get("/api/runs/{run_id}", tags=["runs"], response_model=m.RunPublic, responses=errors)
    def get_run(run_id: str):
        return ws.run(run_id)

    @router.delete("/api/runs/{run_id}", tags=["runs"], status_code=204, responses=errors)
    def delete_run(run_id: str):
        """Delete a run and the comparisons that use it (also one being created or computed meanwhile).
        A second DELETE of the same run, even one sent at the same moment, answers 404 NotFound."""
        ws.delete_run(run_id)
        return Response(status_code=204)

    return router
