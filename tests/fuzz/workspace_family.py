"""The fuzz family of a workspace damaged on disk: runs that were admitted whole, then broken where
the server keeps them (a disk error, a careless `rm`, a file swapped), and the server restarted.

One server takes a good run and one copy of it per damage; it is stopped, each copy's files are
damaged in place (truncated, bit-flipped, deleted, replaced by garbage, a FIFO, a link to
/etc/passwd, the folder deleted or replaced by a file), and the server is started again. Per damaged
run: the run list must answer 200, the run's own page 200 or 4xx, and a comparison of it with the
good run must end (ready or failed with a named error, never an internal error or a hang) and must
not say "identical". A last case truncates the workspace's catalogue (workspace.duckdb) itself:
the server must then start and answer, or refuse to start with one line, never a traceback; so
must `bitguard serve --demo A B` with A damaged. The
outcome rules are harness.py's; the HTTP helpers are api_family.py's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .api_family import Api, compare_ready, run_parts  # puts tests/ on sys.path
from .families import named
from .harness import Context, Result, first_line

from api.live_server import free_port  # noqa: E402, I001

DAMAGES = {  # name -> what is done to the run's folder in the workspace, the server stopped
    "rank-file-truncated": lambda run: _cut(run / "rank-0.duckdb"),
    "rank-file-header-flipped": lambda run: _flip(run / "rank-0.duckdb", 1000),
    "rank-file-deleted": lambda run: (run / "rank-0.duckdb").unlink(),
    "rank-file-fifo": lambda run: ((run / "rank-0.duckdb").unlink(), os.mkfifo(run / "rank-0.duckdb")),
    "manifest-garbage": lambda run: (run / "manifest.json").write_bytes(b"\x00\xffnot json"),
    "manifest-status-object": lambda run: (run / "manifest.json").write_text(
        (run / "manifest.json").read_text().replace('"status": "complete"', '"status": {}')),
    "manifest-passwd-link": lambda run: ((run / "manifest.json").unlink(),
                                         (run / "manifest.json").symlink_to("/etc/passwd")),
    "folder-deleted": lambda run: shutil.rmtree(run),
    "folder-is-a-file": lambda run: (shutil.rmtree(run), run.write_text("x")),
}


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def workspace(ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    wanted = [name for name in DAMAGES if only is None or only in name]
    results: list[Result] = []
    a = Api(ctx, "damaged")
    try:
        good = a.upload(run_parts(ctx.bases["complete"], "good"))
        ids = {}
        for name in wanted:
            r = a.upload(run_parts(ctx.bases["complete"], name))
            if isinstance(r, Result) or r.status_code != 201:
                results.append(named(name, a.judge(r) if not isinstance(r, Result) else r))
                continue
            ids[name] = r.json()["id"]
        if isinstance(good, Result) or good.status_code != 201:
            return results + [named("setup", a.judge(good) if not isinstance(good, Result) else good)]
        good_id = good.json()["id"]
    finally:
        a.close()
    for name, run_id in ids.items():
        DAMAGES[name](a.ws / "runs" / run_id)
    a = Api(ctx, "damaged")  # the same workspace, restarted
    try:
        for name, run_id in ids.items():
            results.append(named(name, _check(a, good_id, run_id)))
    finally:
        a.close()
    if only is None or only in "catalogue-truncated":
        results.append(named("catalogue-truncated", _catalogue(ctx, a.ws)))
    for damage in ("rank-file-truncated", "manifest-garbage"):
        if only is None or only in f"demo/{damage}":
            results.append(named(f"demo/{damage}", _demo(ctx, damage)))
    return results


def _check(a: Api, good_id: str, run_id: str) -> Result:
    for url in ("/api/runs", f"/api/runs/{run_id}"):
        r = a.judge(a.request("GET", url))
        if r.outcome not in ("ok", "clean_error"):
            return Result("", "", r.outcome, f"GET {url} after the damage: {r.detail}")
    r = compare_ready(a, good_id, run_id)
    if r.outcome == "ok" and r.detail.endswith(": identical"):
        return Result("", "", "false_verdict", f"a run damaged in the workspace compared identical ({r.detail})")
    return r


def _catalogue(ctx: Context, ws: Path) -> Result:
    """`bitguard serve` (the CLI, as a user starts it) on a workspace whose catalogue is cut in half."""
    _cut(ws / "workspace.duckdb")
    return _serve_cli(ctx, ["--workspace", str(ws)], "the damaged catalogue")


def _demo(ctx: Context, damage: str) -> Result:
    """`bitguard serve --demo A B` with A damaged: refused in one line, or served with A's problem named."""
    d = ctx.scratch("demo")
    bad, good = ctx.copy("complete", d / "bad"), ctx.copy("complete", d / "good")
    DAMAGES[damage](bad)
    return _serve_cli(ctx, ["--workspace", str(d / "ws"), "--demo", str(bad), str(good)], f"a demo pair ({damage})")


def _serve_cli(ctx: Context, args: list[str], what: str) -> Result:
    """Start `bitguard serve ARGS`: it answers GET /api/runs (not 5xx), or exits in one line, never a traceback."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bitguard", "serve", *args, "--port", str(port)],
                            cwd=ctx.cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # a fresh Python's start and the demo pair's ingest are part of it: on two cores shared with
        # the suite's other workers that took over ctx.timeout (20 s) once, a case that takes 9 s alone
        deadline = time.monotonic() + ctx.process_timeout
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=2)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            return Result("", "", "http_500" if r.status_code >= 500 else "ok",
                          f"the server started on {what}; GET /api/runs: HTTP {r.status_code}")
        if proc.poll() is None:
            return Result("", "", "hang", f"bitguard serve on {what} neither answered nor exited")
        err = proc.communicate()[1]
        if "Traceback" in err or proc.returncode == 70:
            return Result("", "", "traceback", f"bitguard serve on {what}: exit {proc.returncode}: {first_line(err)}")
        return Result("", "", "clean_error", f"bitguard serve on {what}: exit {proc.returncode}: {first_line(err)}")
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
