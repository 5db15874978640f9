"""The rule sets resource of the explorer's API: benign-difference rules with their versions,
imported and exported as the file `bitguard compare --rules` reads.

`routes(ws)` is the router server.py mounts. What a rule means is `bitguard.backend.rules`;
this module only refuses what is not a rules file before the engine reads it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from python_multipart.multipart import parse_options_header

from bitguard.backend import api_models as m
from bitguard.backend.workspace import validate_rules
from bitguard.errors import BadInput, TooLarge

MAX_JSON_DEPTH = 64  # deepest nesting a rules file may have (a real one has 4)


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


def routes(ws) -> APIRouter:
    router = APIRouter()
    errors = m.ERROR_RESPONSES

    def _rules_file(rules: list[dict]) -> dict:
        from bitguard.backend.rules import RULES_SCHEMA

        return {"schema": RULES_SCHEMA, "rules": rules}

    @router.get("/api/rulesets", tags=["rules"], response_model=list[m.RuleSetPublic])
    def list_rule_sets():
        return ws.rule_sets()

    @router.post("/api/rulesets", tags=["rules"], response_model=m.RuleSetPublic, status_code=201, responses=errors)
    def create_rule_set(body: m.RuleSetCreate):
        return ws.create_rule_set(body.name, _rules_file(body.rules))

    @router.post("/api/rulesets/import", tags=["rules"], response_model=m.RuleSetPublic, status_code=201,
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

    @router.get("/api/rulesets/{rule_set_id}", tags=["rules"], response_model=m.RuleSetPublic, responses=errors)
    def get_rule_set(rule_set_id: str, version: int | None = Query(None, description="a saved version; latest")):
        return ws.rule_set(rule_set_id, version)

    @router.put("/api/rulesets/{rule_set_id}", tags=["rules"], response_model=m.RuleSetPublic, responses=errors)
    def update_rule_set(rule_set_id: str, body: m.RuleSetUpdate):
        """Rename and/or save the rules as the next version; comparisons using the set rerun."""
        out = ws.update_rule_set(rule_set_id, body.name, None if body.rules is None else _rules_file(body.rules))
        for cid in out.get("comparisons", []):
            ws.rerun(cid)
        return out

    @router.delete("/api/rulesets/{rule_set_id}", tags=["rules"], status_code=204, responses=errors)
    def delete_rule_set(rule_set_id: str):
        ws.delete_rule_set(rule_set_id)
        return Response(status_code=204)

    @router.post("/api/rulesets/{rule_set_id}/copy", tags=["rules"], response_model=m.RuleSetPublic, status_code=201,
              responses=errors)
    def copy_rule_set(rule_set_id: str, body: m.RuleSetCopy):
        """Save a rule set (or one of its versions) under a new name."""
        return ws.create_rule_set(body.name, ws.rules_body(rule_set_id, body.version))

    @router.get("/api/rulesets/{rule_set_id}/export", tags=["rules"], responses=errors)
    def export_rule_set(rule_set_id: str, version: int | None = None):
        """The rules file, as `bitguard compare --rules FILE` reads it."""
        rs = ws.rule_set(rule_set_id, version)
        safe = re.sub(r"[^\w.-]+", "-", rs["name"]).strip("-") or "rules"
        return JSONResponse(rs["file"], headers={
            "Content-Disposition": f'attachment; filename="{safe}.v{rs["version"]}.rules.json"'})

    return router
