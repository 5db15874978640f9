"""The explorer's catalogue: which runs, rule sets (with their versions) and comparisons a workspace holds.

A workspace is a folder:

    workspace.duckdb     the catalogue: runs, rule sets and their versions, comparisons
    runs/<id>/           run directories, byte for byte as uploaded
    comparisons/<id>/    files made from a comparison (its Perfetto trace)
    tmp/                 uploads being received; whatever is left there at start-up is a dead upload

One DuckDB connection serves the catalogue, guarded by a lock. A run enters only once
`run_admission.admit` has read it whole; messages name folders as the user knows them
(`user_paths`). A comparison here is its record (runs, rule-set version, revision, status, the
summary once computed); computing it and keeping its result in memory is comparison_jobs.py's,
and workspace.py joins the two. Only the catalogue survives a restart.

This module knows nothing about HTTP (the api_*.py routers), about how a comparison is computed
(the engine, through comparison_jobs.py) or about timelines (timelines.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from bitguard.backend.run_admission import admit, listing
from bitguard.backend.user_paths import PathNames
from bitguard.db import connect, is_lock_error
from bitguard.errors import BadInput, NotFound
from bitguard.schema import MANIFEST_NAME

if TYPE_CHECKING:
    from bitguard.backend.timelines import Result

log = logging.getLogger("bitguard.serve")


_CATALOGUE = """
CREATE TABLE IF NOT EXISTS runs (
  id VARCHAR PRIMARY KEY, name VARCHAR, created DOUBLE, world_size INTEGER, ranks INTEGER[],
  files INTEGER, bytes BIGINT, info VARCHAR);
CREATE TABLE IF NOT EXISTS rule_sets (
  id VARCHAR PRIMARY KEY, name VARCHAR, created DOUBLE, updated DOUBLE, version INTEGER);
CREATE TABLE IF NOT EXISTS rule_set_versions (
  rule_set VARCHAR, version INTEGER, created DOUBLE, body VARCHAR, PRIMARY KEY (rule_set, version));
CREATE TABLE IF NOT EXISTS comparisons (
  id VARCHAR PRIMARY KEY, run_a VARCHAR, run_b VARCHAR, rule_set VARCHAR, rule_set_version INTEGER,
  created DOUBLE, updated DOUBLE, revision INTEGER, status VARCHAR, error VARCHAR, summary VARCHAR);
ALTER TABLE comparisons ADD COLUMN IF NOT EXISTS resumed_at INTEGER DEFAULT 0;
"""

_NAME_RE = re.compile(r"^[\w .,:+()@#-]{1,80}$")
KEEP = object()  # rerun(): keep the comparison's rule set
MAX_STEP = 2**31 - 1  # a step number, as rank files store it (INTEGER)


def _new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(4)}"


def _now() -> float:
    return time.time()


def _check_name(name: str, what: str) -> str:
    name = (name or "").strip()
    if not _NAME_RE.match(name):
        raise BadInput(f"{what} name {name!r} is not usable; use 1-80 letters, digits, spaces or . , : + ( ) @ # - _")
    return name


def validate_rules(body: dict) -> dict:
    """A rules file (`bitguard.rules/1`) as the engine reads it, normalised; raises RulesError."""
    from bitguard.backend.rules import RuleSet

    if not isinstance(body, dict):
        raise BadInput("a rules file is a JSON object with \"schema\" and \"rules\"; got " + type(body).__name__)
    return RuleSet.from_dict(body).to_dict()


def _connect(path: Path) -> duckdb.DuckDBPyConnection:
    """The catalogue's connection, bitguard's one safe kind (bitguard.db: no extension fetched or
    loaded, no file access from SQL). Every query below passes user strings as parameters; none is
    formatted into SQL."""
    return connect(path)


class Catalogue:
    """The catalogue of one workspace folder (created if missing)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        for sub in ("runs", "comparisons", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        db = self.root / "workspace.duckdb"
        self._lock = threading.RLock()
        try:
            self._con = _connect(db)
            self._con.execute(_CATALOGUE)
            self._sweep()  # reads every table: a catalogue damaged anywhere is found now, not mid-request
        except duckdb.Error as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if is_lock_error(exc):
                raise BadInput(f"workspace {self.root} is in use by another process ({first}); stop the other "
                               "`bitguard serve` or pass --workspace with another folder") from None
            raise BadInput(f"the workspace catalogue {db} cannot be read ({first}): it is damaged; move it aside "
                           f"(the run folders in {self.root / 'runs'} stay) or pass --workspace with another "
                           f"folder") from None

    @property
    def lock(self) -> threading.RLock:
        """Held across catalogue reads and writes that must be one step (comparison_jobs.py uses it too)."""
        return self._lock

    def close(self) -> None:
        with self._lock:
            self._con.close()

    # -- catalogue helpers ------------------------------------------------------------------
    def _query(self, sql: str, params: list | tuple = ()) -> list[dict]:
        with self._lock:
            cur = self._con.execute(sql, params)
            cols = [d[0] for d in cur.description] if cur.description else []
            return [dict(zip(cols, row)) for row in cur.fetchall()]

    def _exec(self, sql: str, params: list | tuple = ()) -> None:
        with self._lock:
            self._con.execute(sql, params).fetchall()

    def _sweep(self) -> None:
        """Remove dead uploads, and run and comparison folders the catalogue does not know (a crash
        mid-commit, a trace written while its comparison was deleted)."""
        for child in (self.root / "tmp").iterdir():
            shutil.rmtree(child, ignore_errors=True)
        for folder, query in (("runs", "SELECT id FROM runs"), ("comparisons", "SELECT id FROM comparisons")):
            known = {r["id"] for r in self._query(query)}
            for child in (self.root / folder).iterdir():
                if child.name not in known:
                    shutil.rmtree(child, ignore_errors=True)
        self._exec("UPDATE comparisons SET status = 'stale' WHERE status IN ('queued', 'running')")

    # -- runs ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def staging(self):
        """A fresh folder inside the workspace for an upload; removed unless committed."""
        path = self.root / "tmp" / secrets.token_hex(8)
        path.mkdir()
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def import_run(self, path: str | os.PathLike, name: str | None = None) -> dict:
        """Copy a run directory on this machine into the workspace, as an upload would, once:
        a run already imported from the same folder with the same manifest is reused."""
        source = Path(path).expanduser().resolve()
        if not source.is_dir():
            raise BadInput(f"{source} is not a folder; give the run directory `bitguard record --out` wrote")
        try:
            manifest = json.loads((source / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            manifest = None
        for row in self._query("SELECT id, info FROM runs ORDER BY created DESC"):
            details = json.loads(row["info"] or "{}")
            if details.get("source") == str(source) and details.get("manifest") == manifest:
                return self.run(row["id"])
        with self.staging() as staged:
            shutil.copytree(source, staged / "run", symlinks=True)  # links stay links: commit refuses them
            return self.commit_run(staged / "run", name or source.name, source=str(source), shown=str(source))

    def path_names(self, staged: Path | None = None, shown: str | None = None) -> PathNames:
        """How this workspace's folders read in messages: a staged run as the user's folder name,
        each stored run as its name, anything else inside the workspace as "the workspace"."""
        names = PathNames({self.root: "<workspace>"})
        for row in self._query("SELECT id, name FROM runs"):
            names.add(self.root / "runs" / row["id"], row["name"] or row["id"])
        if staged is not None:
            names.add(staged, shown or staged.name)
        return names

    def commit_run(self, staged: Path, name: str, source: str | None = None, shown: str | None = None) -> dict:
        """Read a staged run directory completely (run_admission.admit) and move it into runs/ in one
        rename; a run that cannot be read never enters the workspace. `shown`: the folder's name as the
        user knows it, used in every message instead of the staging path."""
        name = re.sub(r"[^\w .,:+()@#-]+", "-", name or "").strip(" -")[:80] or "run"  # a folder name, tidied
        shown = shown or name
        for p in staged.rglob("*"):
            if p.is_symlink():
                raise BadInput(f"{shown}/{p.relative_to(staged).as_posix()} is a link; upload the files themselves")
        names = self.path_names(staged, shown)
        admitted = admit(staged, names, shown)
        files = [p for p in staged.rglob("*") if p.is_file()]
        nbytes = sum(p.stat().st_size for p in files)
        plain = _plain(admitted.info)
        if isinstance(plain, dict):  # the staging path and a second copy of the manifest say nothing
            plain = {k: v for k, v in plain.items() if k not in ("path", "manifest")}
        rel = PathNames({staged: "."})  # file paths inside the run, relative to it
        details = {"manifest": admitted.info.manifest, "info": rel.value(plain), "source": source}
        run_id = _new_id("r")
        os.rename(staged, self.root / "runs" / run_id)  # atomic: a run is all there or not there
        try:
            self._exec("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                       (run_id, name, _now(), admitted.world_size, admitted.ranks, len(files), nbytes,
                        json.dumps(details, default=str)))
        except Exception:
            shutil.rmtree(self.root / "runs" / run_id, ignore_errors=True)
            raise
        return self.run(run_id)

    def runs(self) -> list[dict]:
        """Every run; one whose record cannot be read is listed with its problem, never an error."""
        return [self._run_public(r) for r in self._query("SELECT * FROM runs ORDER BY created DESC")]

    def run(self, run_id: str) -> dict:
        rows = self._query("SELECT * FROM runs WHERE id = ?", (run_id,))
        if not rows:
            raise NotFound(f"no run {run_id!r} in this workspace; GET /api/runs lists them")
        return self._run_public(rows[0])

    def _run_public(self, row: dict) -> dict:
        try:
            out = _run_public(row)
        except Exception as exc:  # noqa: BLE001 - one unreadable record never breaks the list
            log.warning("run %s: its catalogue record cannot be read", row.get("id"), exc_info=exc)
            out = {"id": row["id"], "name": str(row.get("name") or row["id"]), "created": row.get("created") or 0.0,
                   "world_size": row.get("world_size") or 0, "ranks": [], "files": row.get("files") or 0,
                   "bytes": row.get("bytes") or 0, "status": None, "command": None, "mode": None,
                   "start_time": None, "info": None,
                   "problem": f"its catalogue record cannot be read ({type(exc).__name__}); delete it and upload "
                              "the run again"}
        if not (self.root / "runs" / row["id"]).is_dir():
            out["problem"] = "its folder is missing from the workspace; delete it and upload the run again"
        return out

    def run_path(self, run_id: str) -> str:
        self.run(run_id)
        return str(self.root / "runs" / run_id)

    def delete_run(self, run_id: str) -> None:
        """Delete a run and every comparison that uses it, as one step under the catalogue lock: a
        comparison created, rerun or computed meanwhile either sees the run and is deleted with it,
        or does not see it (NotFound). Of two DELETEs of one run, the second finds no run: NotFound
        (HTTP 404), as a DELETE of any other missing object."""
        trash = self.root / "tmp" / f"deleted-{run_id}-{secrets.token_hex(4)}"
        with self._lock:
            self.run(run_id)
            for c in self._query("SELECT id FROM comparisons WHERE run_a = ? OR run_b = ?", (run_id, run_id)):
                self.delete_comparison(c["id"])
            self._exec("DELETE FROM runs WHERE id = ?", (run_id,))
            try:
                os.rename(self.root / "runs" / run_id, trash)  # gone from runs/ at once, erased below
            except FileNotFoundError:  # a record without its folder (see _run_public)
                return
        shutil.rmtree(trash, ignore_errors=True)

    # -- rule sets -----------------------------------------------------------------------
    def rule_sets(self) -> list[dict]:
        rows = self._query("SELECT s.*, v.body FROM rule_sets s JOIN rule_set_versions v "
                           "ON v.rule_set = s.id AND v.version = s.version ORDER BY s.name")
        return [_rule_set_public(r, versions=None) for r in rows]

    def rule_set(self, rule_set_id: str, version: int | None = None) -> dict:
        rows = self._query("SELECT * FROM rule_sets WHERE id = ?", (rule_set_id,))
        if not rows:
            raise NotFound(f"no rule set {rule_set_id!r}; GET /api/rulesets lists them")
        head = rows[0]
        versions = self._query("SELECT version, created, body FROM rule_set_versions WHERE rule_set = ? "
                               "ORDER BY version", (rule_set_id,))
        version = head["version"] if version is None else int(version)
        chosen = [v for v in versions if v["version"] == version]
        if not chosen:
            raise NotFound(f"rule set {head['name']!r} has no version {version}; it has 1..{head['version']}")
        return _rule_set_public({**head, "body": chosen[0]["body"]}, versions=versions, version=version)

    def rules_body(self, rule_set_id: str, version: int | None = None) -> dict:
        return self.rule_set(rule_set_id, version)["file"]

    def _name_free(self, name: str, except_id: str | None = None) -> None:
        clash = self._query("SELECT id FROM rule_sets WHERE name = ? AND id IS DISTINCT FROM ?", (name, except_id))
        if clash:
            raise BadInput(f"a rule set named {name!r} exists already; pick another name or edit that one")

    def create_rule_set(self, name: str, body: dict) -> dict:
        name = _check_name(name, "rule set")
        body = validate_rules(body)
        with self._lock:
            self._name_free(name)
            rs_id, now = _new_id("rs"), _now()
            self._exec("INSERT INTO rule_sets VALUES (?, ?, ?, ?, 1)", (rs_id, name, now, now))
            self._exec("INSERT INTO rule_set_versions VALUES (?, 1, ?, ?)", (rs_id, now, json.dumps(body)))
        return self.rule_set(rs_id)

    def update_rule_set(self, rule_set_id: str, name: str | None, body: dict | None) -> dict:
        """Rename and/or save new rules as the next version (earlier versions are kept)."""
        with self._lock:
            current = self.rule_set(rule_set_id)
            if name is not None:
                name = _check_name(name, "rule set")
                self._name_free(name, except_id=rule_set_id)
                self._exec("UPDATE rule_sets SET name = ?, updated = ? WHERE id = ?", (name, _now(), rule_set_id))
            if body is not None:
                body = validate_rules(body)
                if body != current["file"]:
                    version = current["latest_version"] + 1
                    self._exec("INSERT INTO rule_set_versions VALUES (?, ?, ?, ?)",
                               (rule_set_id, version, _now(), json.dumps(body)))
                    self._exec("UPDATE rule_sets SET version = ?, updated = ? WHERE id = ?",
                               (version, _now(), rule_set_id))
            users = self._query("SELECT id FROM comparisons WHERE rule_set = ?", (rule_set_id,))
        return self.rule_set(rule_set_id) | {"comparisons": [u["id"] for u in users]}

    def delete_rule_set(self, rule_set_id: str) -> list[str]:
        """Delete a rule set; the comparisons that used it are left without rules (their ids are
        returned: the workspace recomputes them)."""
        with self._lock:
            self.rule_set(rule_set_id)
            users = self._query("SELECT id FROM comparisons WHERE rule_set = ?", (rule_set_id,))
            self._exec("UPDATE comparisons SET rule_set = NULL, rule_set_version = NULL WHERE rule_set = ?",
                       (rule_set_id,))
            self._exec("DELETE FROM rule_set_versions WHERE rule_set = ?", (rule_set_id,))
            self._exec("DELETE FROM rule_sets WHERE id = ?", (rule_set_id,))
        return [u["id"] for u in users]

    # -- comparison records ------------------------------------------------------------------
    def add_comparison(self, run_a: str, run_b: str, rule_set_id: str | None = None, resumed_at: int = 0) -> str:
        """A new comparison record at revision 1, queued; the runs are checked and the record written
        in one step under the catalogue lock, so a run deleted meanwhile leaves no comparison behind
        (see delete_run). `resumed_at`: run B resumed A's training at that step (`compare --resumed-at`)."""
        if isinstance(resumed_at, bool) or not isinstance(resumed_at, int) or not 0 <= resumed_at <= MAX_STEP:
            raise BadInput(f"resumed_at must be a step number from 0 to {MAX_STEP} (0: step for step), not {resumed_at!r}")
        with self._lock:
            for run in (self.run(run_a), self.run(run_b)):
                if run["problem"]:
                    raise BadInput(f"run {run['name']!r} cannot be compared: {run['problem']}")
            version = self.rule_set(rule_set_id)["version"] if rule_set_id else None
            cid, now = _new_id("c"), _now()
            self._exec("INSERT INTO comparisons (id, run_a, run_b, rule_set, rule_set_version, created, updated, "
                       "revision, status, resumed_at) VALUES (?, ?, ?, ?, ?, ?, ?, 1, 'queued', ?)",
                       (cid, run_a, run_b, rule_set_id, version, now, now, resumed_at))
            return cid

    def latest_comparison(self, run_a: str, run_b: str) -> str | None:
        """The latest comparison of these two runs without rules, step for step, if any."""
        rows = self._query("SELECT id FROM comparisons WHERE run_a = ? AND run_b = ? AND rule_set IS NULL "
                           "AND coalesce(resumed_at, 0) = 0 ORDER BY created DESC LIMIT 1", (run_a, run_b))
        return rows[0]["id"] if rows else None

    def comparison_records(self) -> list[dict]:
        return self._query("SELECT * FROM comparisons ORDER BY created DESC")

    def comparison_listed(self, rec: dict, result: Result | None = None) -> dict:
        """A comparison as listed; one whose stored record cannot be read is listed as failed, saying so."""
        try:
            return self._comparison_public(rec, result)
        except Exception as exc:  # noqa: BLE001 - one unreadable record never breaks the list
            log.warning("comparison %s: its catalogue record cannot be read", rec.get("id"), exc_info=exc)
            unknown = {"id": "", "name": "?"}
            return {"id": rec["id"], "run_a": {**unknown, "id": str(rec.get("run_a"))},
                    "run_b": {**unknown, "id": str(rec.get("run_b"))}, "rule_set": None, "resumed_at": 0,
                    "status": "failed",
                    "revision": int(rec.get("revision") or 1),
                    "error": {"type": "CorruptRun", "message": f"its catalogue record cannot be read "
                                                               f"({type(exc).__name__}); delete it and compare again"},
                    "created": rec.get("created") or 0.0, "updated": rec.get("updated") or 0.0, "verdict": None,
                    "summary": None, "ranks": None, "pivot_position": None}

    def _record(self, cid: str) -> dict:
        rows = self._query("SELECT * FROM comparisons WHERE id = ?", (cid,))
        if not rows:
            raise NotFound(f"no comparison {cid!r}; GET /api/comparisons lists them")
        return rows[0]

    def _comparison_public(self, rec: dict, result: Result | None) -> dict:
        runs = {r: self._query("SELECT id, name FROM runs WHERE id = ?", (rec[r],)) for r in ("run_a", "run_b")}
        rule_set = None
        if rec["rule_set"]:
            rows = self._query("SELECT id, name, version FROM rule_sets WHERE id = ?", (rec["rule_set"],))
            if rows:
                rule_set = {"id": rows[0]["id"], "name": rows[0]["name"], "version": rec["rule_set_version"],
                            "latest_version": rows[0]["version"]}
        summary = json.loads(rec["summary"]) if rec["summary"] else None
        if rec["status"] not in ("queued", "running", "ready", "failed", "stale"):
            raise ValueError(f"unknown status {rec['status']!r}")
        return {
            "id": rec["id"],
            "run_a": runs["run_a"][0] if runs["run_a"] else {"id": rec["run_a"], "name": "?"},
            "run_b": runs["run_b"][0] if runs["run_b"] else {"id": rec["run_b"], "name": "?"},
            "rule_set": rule_set,
            "resumed_at": int(rec.get("resumed_at") or 0),
            "status": rec["status"],
            "revision": rec["revision"],
            "error": json.loads(rec["error"]) if rec["error"] else None,
            "created": rec["created"],
            "updated": rec["updated"],
            "verdict": summary.get("verdict") if summary else None,
            "summary": summary,
            "ranks": result.ranks if result else None,
            "pivot_position": result.pivot_position() if result else None,
        }

    def requeue(self, cid: str, rule_set_id: str | None | object = KEEP, version: int | None = None) -> int:
        """Queue the comparison again, at its next revision, with the latest version of its rule set
        or with `rule_set_id` (None: no rules) attached instead, or with its saved `version` (an
        earlier version's result reopened); returns that revision."""
        with self._lock:
            rec = self._record(cid)
            rule_set = rec["rule_set"] if rule_set_id is KEEP else rule_set_id
            if version is not None and not rule_set:
                raise BadInput("a rule-set version needs a rule set: give rule_set_id, or rerun one that has a rule set")
            version = self.rule_set(rule_set, version)["version"] if rule_set else None
            revision = rec["revision"] + 1
            self._exec("UPDATE comparisons SET rule_set = ?, rule_set_version = ?, revision = ?, status = 'queued', "
                       "error = NULL, updated = ? WHERE id = ?", (rule_set, version, revision, _now(), cid))
        return revision

    def set_status(self, cid: str, status: str, *, error: dict | None = None, summary: dict | None = None) -> None:
        """Set a comparison's status; a failed one with its `error`, a ready one with its `summary`."""
        if error is not None:
            self._exec("UPDATE comparisons SET status = ?, error = ?, updated = ? WHERE id = ?",
                       (status, json.dumps(error), _now(), cid))
        elif summary is not None:
            self._exec("UPDATE comparisons SET status = ?, summary = ?, updated = ? WHERE id = ?",
                       (status, json.dumps(summary, default=str), _now(), cid))
        else:
            self._exec("UPDATE comparisons SET status = ?, updated = ? WHERE id = ?", (status, _now(), cid))

    def delete_comparison(self, cid: str) -> None:
        """Delete a comparison's record and its files."""
        with self._lock:
            self._record(cid)
            self._exec("DELETE FROM comparisons WHERE id = ?", (cid,))
        shutil.rmtree(self.root / "comparisons" / cid, ignore_errors=True)

    def is_current(self, cid: str, revision: int) -> bool:
        """Whether the comparison still exists at this revision (not deleted, not rerun since)."""
        rows = self._query("SELECT revision FROM comparisons WHERE id = ?", (cid,))
        return bool(rows) and rows[0]["revision"] == revision


def _plain(obj):
    """A JSON-able view of an engine value (dataclass, object or plain)."""
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _run_public(row: dict) -> dict:
    """A catalogue row as the API lists it; manifest fields of the wrong shape (a run kept by an
    older version) are listed as None and named in `problem`."""
    details = json.loads(row["info"] or "{}")
    fields, problems = listing(details.get("manifest") if isinstance(details, dict) else None)
    return {
        "id": row["id"], "name": row["name"], "created": row["created"], "world_size": row["world_size"],
        "ranks": list(row["ranks"] or []), "files": row["files"], "bytes": row["bytes"], **fields,
        "info": details.get("info") if isinstance(details, dict) else None,
        "problem": ("; ".join(problems) + "; delete this run and record it again") if problems else None,
    }


def _rule_set_public(row: dict, versions: list[dict] | None, version: int | None = None) -> dict:
    body = json.loads(row["body"])
    out = {
        "id": row["id"], "name": row["name"], "created": row["created"], "updated": row["updated"],
        "version": version if version is not None else row["version"], "latest_version": row["version"],
        "rules": body.get("rules", []), "file": body,
    }
    if versions is not None:
        out["versions"] = [{"version": v["version"], "created": v["created"],
                            "rules": len(json.loads(v["body"]).get("rules", []))} for v in versions]
    return out
