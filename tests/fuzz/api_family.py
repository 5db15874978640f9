"""The fuzz family of the upload API: a live `bitguard serve` on loopback, fed hostile requests.

Mutated runs, hostile manifests and hostile rank files are uploaded (a run the CLI's ingest
cannot read must be refused with a 4xx, never committed; `cases` bounds the mutated uploads and,
times three, the hostile manifests and rank files, drawn by the seed when fewer than all), then malformed multipart bodies, concurrent uploads and
deletes of one run, and hostile query parameters. After every case `GET /api/runs` must still
answer 200. The server runs in a subprocess (tests/api/live_server.py) with the harness's
working directory, so a pwned.csv written by an injected statement is seen. The outcome rules
are harness.py's; this module knows only the HTTP side.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from .harness import PASSWD, TESTS, Context, Result
from .mutations import HOSTILE_MANIFESTS, INJECTION, OPS, apply, plan
from .rankfiles import EDITS, LEAKS, make

if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
from api.live_server import start_server  # noqa: E402

LIMITS = {"max_file_bytes": 4 << 20, "max_run_bytes": 6 << 20, "max_files": 50, "raw_event_limit": 30}
Part = tuple[str, str | None, bytes]  # (form field name, filename or None for a plain field, content)


def multipart(parts: list[Part], boundary: str = "bitguard-fuzz-boundary") -> tuple[bytes, dict]:
    body = b""
    for field, filename, content in parts:
        disp = f'form-data; name="{field}"' + (f'; filename="{filename}"' if filename is not None else "")
        body += (f"--{boundary}\r\nContent-Disposition: {disp}\r\n"
                 f"Content-Type: application/octet-stream\r\n\r\n").encode("utf-8", "surrogateescape")
        body += content + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return body, {"content-type": f"multipart/form-data; boundary={boundary}"}


def run_parts(run: Path, top: str = "run") -> list[Part]:
    return [("files", f"{top}/{p.relative_to(run).as_posix()}", p.read_bytes())
            for p in sorted(run.rglob("*")) if p.is_file()]


class Api:
    """The live server and the judging of its answers."""

    def __init__(self, ctx: Context, folder: str = "api"):
        self.ctx = ctx
        self.servers = ctx.root / "server"  # every family's workspaces: no reply may name a path in here
        self.ws = self.servers / folder / "workspace"
        self._start()

    def _start(self) -> None:
        here = os.getcwd()
        os.chdir(self.ctx.cwd)  # the server inherits it: relative writes land where ctx.pwned() looks
        try:
            self.server = start_server(str(self.ws), LIMITS)
        finally:
            os.chdir(here)
        self.http = httpx.Client(base_url=self.server.url, timeout=self.ctx.timeout)

    def close(self) -> None:
        self.http.close()
        self.server.stop()

    def request(self, method: str, url: str, **kw) -> httpx.Response | Result:
        try:
            return self.http.request(method, url, **kw)
        except httpx.TimeoutException:
            return Result("", "", "hang", f"{method} {url}: no answer before the timeout")
        except httpx.TransportError as exc:
            return Result("", "", "http_500", f"{method} {url}: connection dropped ({type(exc).__name__}: {exc})")

    def judge(self, r: httpx.Response | Result, refuse: bool = False) -> Result:
        """2xx ok (wrong_answer when `refuse`), 4xx clean_error, 5xx http_500; server paths or
        /etc/passwd in a reply are unsafe."""
        if isinstance(r, Result):
            return r
        text = r.text
        shown = "".join(c if c.isprintable() and c != "\ufffd" else "?" for c in text[:160])  # a trace is binary
        detail = f"HTTP {r.status_code}: {shown}"
        if r.status_code >= 500:
            return Result("", "", "http_500", detail)
        if str(self.servers) in text or PASSWD in text:  # runs name their own folders: only the server's count
            return Result("", "", "unsafe", f"the reply shows a server path or file: {detail}")
        if r.status_code >= 400:
            return Result("", "", "clean_error", detail)
        return Result("", "", "wrong_answer" if refuse else "ok", detail)

    def upload(self, parts: list[Part], boundary: str = "bitguard-fuzz-boundary", **kw) -> httpx.Response | Result:
        body, headers = multipart(parts, boundary)
        return self.request("POST", "/api/runs", content=body, headers=headers, **kw)

    def after(self, result: Result) -> Result:
        """The case's result, unless it left the run list broken or the server gone (then the
        server is started again on the same workspace, so that one crash is counted once)."""
        if self.server.process.poll() is not None:
            log = self.server.log().strip().splitlines()
            self.close()
            self._start()
            return Result("", "", "http_500", f"the server died ({log[-1][:160] if log else 'no log'}); "
                                              f"the case: {result.detail}")
        if result.outcome in ("hang", "http_500") or result.outcome == "unsafe":
            return result
        listing = self.request("GET", "/api/runs")
        if isinstance(listing, Result) or listing.status_code != 200:
            got = listing.detail if isinstance(listing, Result) else f"HTTP {listing.status_code}: {listing.text[:120]}"
            return Result("", "", "http_500", f"GET /api/runs broken after this case ({got}); the case: {result.detail}")
        for p in self.ctx.pwned():
            p.unlink()
            return Result("", "", "unsafe", f"{p} was written")
        return result

    def delete(self, r: httpx.Response | Result) -> None:
        if not isinstance(r, Result) and r.status_code == 201:
            self.request("DELETE", f"/api/runs/{r.json()['id']}")


def api(ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    a = Api(ctx)
    results: list[Result] = []

    def add(case: str, result: Result) -> None:
        result.case = case
        results.append(a.after(result))

    try:
        for case, fn in _cases(ctx, a, cases, seed):
            if only is None or only in case:
                add(case, fn())
    finally:
        a.close()
    return results


def _cases(ctx: Context, a: Api, cases: int, seed: int):
    complete = ctx.bases["complete"]
    yield "valid-run", lambda: _valid(a, complete)
    for i in range(cases):
        base = ("complete", "killed")[i % 2]
        files = sorted(p.name for p in ctx.bases[base].iterdir())
        rng = random.Random(f"{seed}:api:{i}")
        fname, op = rng.choice(files), OPS[i % len(OPS)]
        yield f"mutated/{base}/{fname}/{op}-{i}", (lambda base=base, fname=fname, op=op, rng=rng:
                                                    _mutated(ctx, a, base, fname, op, rng))
    manifest = json.loads((complete / "manifest.json").read_text())
    # huge cases are over the server's per-file limit here: the limit is tested below
    manifests = [(c, e) for c, e, _ in HOSTILE_MANIFESTS if "huge" not in c]
    for case, edit in _sample(manifests, 3 * cases, f"{seed}:api:manifests"):
        yield f"manifest/{case}", lambda edit=edit: _hostile_manifest(ctx, a, edit(manifest))
    for case, sql in _sample([(c, s) for c, s in EDITS if "huge" not in c], 3 * cases, f"{seed}:api:rankfiles"):
        yield f"rankfile/{case}", lambda sql=sql: _hostile_rankfile(ctx, a, sql)
    good = run_parts(complete)
    long_part = "p" * 300
    for case, parts, refuse in [
        ("path-part-300", [*good, ("files", f"run/{long_part}/x", b"1")], False),
        ("path-part-300-file", [*good, ("files", f"run/{long_part}", b"1")], False),
        ("file-and-folder", [*good, ("files", "run/manifest.json/x", b"1")], True),
        ("empty-filename", [*good, ("files", "", b"")], False),
        ("empty-part", [*good, ("files", "run/empty.bin", b"")], False),
        ("empty-manifest", [("files", "run/manifest.json", b""), *good[1:]], True),
        ("wrong-field-name", [("file", f, c) for _, f, c in good], False),
        ("no-filename", [("files", None, c) for _, _, c in good], True),
        ("dot-dot", [*good, ("files", "../escape/manifest.json", b"{}")], True),
        ("dot-dot-inside", [("files", "run/../../x/" + f.split("/", 1)[1], c) for _, f, c in good], True),
        ("absolute", [("files", "/etc/" + f.split("/", 1)[1], c) for _, f, c in good], True),
        ("nul-in-name", [*good, ("files", "run/a\x00b", b"1")], True),
        ("backslashes", [("files", f.replace("/", "\\"), c) for _, f, c in good], False),
        ("duplicate-paths", [*good, good[0]], False),
        ("too-many-files", [*good, *[("files", f"run/x{i}", b"1") for i in range(60)]], True),
        ("file-over-limit", [*good, ("files", "run/big.bin", bytes(5 << 20))], True),
        ("huge-manifest-8MiB", [("files", "run/manifest.json",
                                 json.dumps({**manifest, "padding": "x" * (8 << 20)}).encode()), *good[1:]], True),
        ("deep-folders", [("files", "run/" + "d/" * 40 + f.split("/", 1)[1], c) for _, f, c in good], False),
        ("newline-name", [("files", "run\nx/" + f.split("/", 1)[1], c) for _, f, c in good], False),
        ("only-a-name-field", [("name", None, b"x")], True),
    ]:
        yield f"multipart/{case}", lambda parts=parts, refuse=refuse: _judged_upload(a, parts, refuse)
    yield "multipart/boundary-300", lambda: _judged_upload(a, good, False, boundary="b" * 300)
    yield "multipart/boundary-70", lambda: _judged_upload(a, good, False, boundary="b" * 70)
    for case, body, ctype, refuse in [
        ("not-multipart", b'{"files": []}', "application/json", True),
        ("no-boundary", b"--x\r\n", "multipart/form-data", True),
        ("no-closing-boundary", multipart(good)[0][:-40], "multipart/form-data; boundary=bitguard-fuzz-boundary", True),
        ("garbage", bytes(random.Random(seed).randrange(256) for _ in range(4096)),
         "multipart/form-data; boundary=bitguard-fuzz-boundary", True),
        ("empty-body", b"", "multipart/form-data; boundary=bitguard-fuzz-boundary", True),
    ]:
        yield f"multipart/{case}", (lambda body=body, ctype=ctype, refuse=refuse:
                                    a.judge(a.request("POST", "/api/runs", content=body,
                                                      headers={"content-type": ctype}), refuse))
    for case, params in [("name-10k", {"name": "n" * 10_000}), ("name-injection", {"name": INJECTION}),
                         ("name-html", {"name": "<b>x</b>"}), ("name-empty", {"name": ""})]:
        yield f"name/{case}", lambda params=params: _named_upload(a, good, params)
    yield "name/injection-top-folder", lambda: _named_upload(a, run_parts(complete, INJECTION), {})
    yield "name/quote-top-folder", lambda: _named_upload(a, run_parts(complete, "q'dir"), {})
    for rnd in range(3):
        yield f"concurrent/upload-delete-compare-{rnd}", lambda rnd=rnd: _concurrent(a, good, rnd)
    yield "concurrent/storm", lambda: _storm(a, good, seed)
    yield from _rules_cases(a)
    yield from _query_cases(a, good)


def _sample(items: list, n: int, seed: str) -> list:
    """All of `items` when n covers them, else n of them drawn by the seed, in their order."""
    if n >= len(items):
        return items
    keep = set(random.Random(seed).sample(range(len(items)), n))
    return [x for i, x in enumerate(items) if i in keep]


def _judged_upload(a: Api, parts: list[Part], refuse: bool, **kw) -> Result:
    """An upload that must be refused (`refuse`: 2xx is a wrong answer) or may be taken."""
    r = a.upload(parts, **kw)
    result = a.judge(r, refuse)
    a.delete(r)
    return result


def _valid(a: Api, run: Path) -> Result:
    r = a.upload(run_parts(run))
    result = a.judge(r, refuse=False)
    if result.outcome == "clean_error":
        return Result("", "", "wrong_answer", f"a valid run was refused: {result.detail}")
    a.delete(r)
    return result


def _mutated(ctx: Context, a: Api, base: str, fname: str, op: str, rng: random.Random) -> Result:
    d = ctx.scratch("api-mutated")
    run = ctx.copy(base, d / "run")
    data = (run / fname).read_bytes()
    m = plan(op, len(data), rng)
    (run / fname).write_bytes(apply(data, m))
    shutil.copytree(run, d / "oracle")
    unreadable = _readable(ctx, d / "oracle")
    r = a.upload(run_parts(run))
    result = _judge_admission(a, r, unreadable, ctx)
    result.detail = f"{m.describe()}: {result.detail}"
    return result


def _hostile_manifest(ctx: Context, a: Api, content: bytes) -> Result:
    d = ctx.scratch("api-manifest")
    run = ctx.copy("complete", d / "run")
    (run / "manifest.json").write_bytes(content)
    shutil.copytree(run, d / "oracle")
    return _judge_admission(a, a.upload(run_parts(run)), _readable(ctx, d / "oracle"), ctx)


def _hostile_rankfile(ctx: Context, a: Api, sql: str) -> Result:
    """A rank file whose tables lie, judged as every hostile upload is (_judge_admission)."""
    d = ctx.scratch("api-rankfile")
    run = ctx.copy("complete", d / "run")
    make(run / "rank-0.duckdb", sql)
    shutil.copytree(run, d / "oracle")
    return _judge_admission(a, a.upload(run_parts(run)), _readable(ctx, d / "oracle"), ctx)


VIEWS = ("", "/pivot", "/timeline", "/timeline?axis=time", "/events?limit=5000", "/graph", "/perfetto")


def _read_every_view(a: Api, run_id: str) -> Result | None:
    """Every view of the comparisons of `run_id` (summary, pivot, timelines, events, graph and its
    first node, Perfetto trace): the first that answers 5xx, hangs or shows a server file, else None."""
    listing = a.request("GET", "/api/comparisons")
    if isinstance(listing, Result):
        return listing
    for c in listing.json():
        if run_id not in (_ref(c.get("run_a")), _ref(c.get("run_b"))):
            continue
        urls = [f"/api/comparisons/{c['id']}{view}" for view in VIEWS]
        graph = a.request("GET", urls[5])
        nodes = graph.json().get("nodes") if not isinstance(graph, Result) and graph.status_code == 200 else None
        if nodes:
            urls.append(f"/api/comparisons/{c['id']}/graph/nodes/{nodes[0]['id']}")
        for url in urls:
            r = a.request("GET", url)
            res = a.judge(r)
            if res.outcome in ("hang", "http_500", "unsafe"):
                return Result("", "", res.outcome, f"GET {url}: {res.detail}")
            if any(s in r.text for s in LEAKS):
                return Result("", "", "unsafe", f"GET {url} shows /etc/passwd or a listing of /etc")
    return None


def _readable(ctx: Context, run: Path) -> str | None:
    """None when the CLI's ingest reads the run, else what it says."""
    read = ctx.read(run)
    return None if isinstance(read, dict) and read.get("ok") else str(read.get("error") if isinstance(read, dict)
                                                                       else read)


def _judge_admission(a: Api, r, unreadable: str | None, ctx: Context) -> Result:
    """A hostile upload: refused (4xx) when the CLI's ingest cannot read the run; when taken, its page
    answers, its comparison with the complete base run ends, and no view of that comparison
    answers 5xx, hangs or shows a file of the server."""
    result = a.judge(r)
    if result.outcome == "ok" and unreadable:
        result = Result("", "", "unsafe", f"committed a run the ingest cannot read ({unreadable[:120]}); {result.detail}")
    if result.outcome == "ok":
        run_id = r.json()["id"]
        page = a.request("GET", f"/api/runs/{run_id}")
        base = a.upload(run_parts(ctx.bases["complete"]))
        if isinstance(page, Result) or page.status_code != 200:
            result = a.judge(page) if not isinstance(page, Result) else page
        elif isinstance(base, Result) or base.status_code != 201:
            result = a.judge(base) if not isinstance(base, Result) else base
        else:
            result = compare_ready(a, base.json()["id"], run_id)
            if result.outcome == "ok":
                result = _read_every_view(a, run_id) or result
        a.delete(base)
    a.delete(r)
    return result


def _named_upload(a: Api, parts: list[Part], params: dict) -> Result:
    r = a.upload(parts, params=params)
    result = a.judge(r)
    if result.outcome == "ok":
        other = a.upload(parts)
        if isinstance(other, Result) or other.status_code != 201:
            return a.judge(other)
        result = compare_ready(a, r.json()["id"], other.json()["id"], expect="identical")
        a.delete(other)
    a.delete(r)
    return result


def compare_ready(a: Api, run_a: str, run_b: str, expect: str | None = None, rule_set_id: str | None = None) -> Result:
    """Compare two uploaded runs and wait: ok with the verdict, clean_error for a named failure,
    http_500 for an internal one, hang when not ready in time, wrong_answer when not `expect`."""
    r = a.request("POST", "/api/comparisons", json={"run_a": run_a, "run_b": run_b, "rule_set_id": rule_set_id})
    if isinstance(r, Result) or r.status_code != 202:
        return a.judge(r, refuse=False) if not isinstance(r, Result) else r
    cid = r.json()["id"]
    deadline = time.monotonic() + a.ctx.timeout
    while time.monotonic() < deadline:
        c = a.request("GET", f"/api/comparisons/{cid}")
        if isinstance(c, Result) or c.status_code != 200:
            return a.judge(c) if not isinstance(c, Result) else c
        body = c.json()
        if body["status"] == "failed":
            error = body.get("error") or {}
            internal = error.get("type") in (None, "InternalError")
            return Result("", "", "http_500" if internal else "clean_error",
                          f"the comparison failed: {json.dumps(error)[:200]}")
        if body["status"] == "ready":
            verdict = body.get("verdict") or (body.get("summary") or {}).get("verdict")
            if expect and verdict != expect:
                return Result("", "", "wrong_answer", f"comparison {body['status']}, verdict {verdict!r}, "
                                                      f"expected {expect}: {json.dumps(body)[:200]}")
            return Result("", "", "ok", f"comparison {body['status']}: {verdict}")
        time.sleep(0.05)
    return Result("", "", "hang", "the comparison was not ready before the timeout")


def _concurrent(a: Api, parts: list[Part], rnd: int) -> Result:
    """Three deletes of one run, two uploads and a comparison of that run, all at once."""
    first, second = a.upload(parts), a.upload(parts)
    for r in (first, second):
        if isinstance(r, Result) or r.status_code != 201:
            return a.judge(r)
    x, y = first.json()["id"], second.json()["id"]
    jobs = [("DELETE", f"/api/runs/{x}", {})] * 3 + [("POST", "/api/runs", "upload")] * 2 + \
           [("POST", "/api/comparisons", {"json": {"run_a": x, "run_b": y}})]
    random.Random(rnd).shuffle(jobs)

    def do(job):
        method, url, kw = job
        return a.upload(parts) if kw == "upload" else a.request(method, url, **kw)

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(do, jobs))
    statuses = []
    for (method, url, _), r in zip(jobs, answers):
        res = a.judge(r)
        if res.outcome in ("hang", "http_500", "unsafe"):
            return Result("", "", res.outcome, f"{method} {url}: {res.detail}")
        statuses.append(f"{method.lower()} {r.status_code}")
        if method == "POST" and url == "/api/runs":
            a.delete(r)
    deletes = [r.status_code for (m, _, _), r in zip(jobs, answers) if m == "DELETE"]
    if deletes.count(204) != 1 or any(s not in (204, 404) for s in deletes):
        return Result("", "", "wrong_answer", f"deletes of one run answered {deletes} (one 204, then 404s)")
    comparisons = a.request("GET", "/api/comparisons")
    if isinstance(comparisons, Result) or comparisons.status_code != 200:
        return a.judge(comparisons) if not isinstance(comparisons, Result) else comparisons
    orphans = [c for c in comparisons.json() if x in (_ref(c.get("run_a")), _ref(c.get("run_b")))]
    if orphans:
        return Result("", "", "wrong_answer", f"a comparison of the deleted run survives: {orphans[0]}")
    a.request("DELETE", f"/api/runs/{y}")
    return Result("", "", "ok", ", ".join(statuses))


def _storm(a: Api, parts: list[Part], seed: int, threads: int = 8, ops: int = 48) -> Result:
    """`ops` requests drawn by the seed (upload, delete a run, compare two, rerun or delete a
    comparison, read a comparison) from `threads` threads at once over a few runs: no 5xx, no hang,
    and afterwards no comparison of a deleted run and every listed run readable."""
    rng = random.Random(f"{seed}:storm")
    ids = [r.json()["id"] for r in (a.upload(parts) for _ in range(3)) if not isinstance(r, Result) and r.status_code == 201]
    cids: list[str] = []

    def op(job: tuple[str, int, int, int]) -> tuple[str, httpx.Response | Result]:
        kind, i, j, k = job  # drawn up front: the requests are the seed's, only their timing is not
        run, other = ids[i % len(ids)], ids[j % len(ids)]
        if kind == "upload":
            r = a.upload(parts)
            if not isinstance(r, Result) and r.status_code == 201:
                ids.append(r.json()["id"])
            return kind, r
        if kind == "delete-run":
            return kind, a.request("DELETE", f"/api/runs/{run}")
        if kind == "compare":
            r = a.request("POST", "/api/comparisons", json={"run_a": run, "run_b": other})
            if not isinstance(r, Result) and r.status_code == 202:
                cids.append(r.json()["id"])
            return kind, r
        cid = cids[k % len(cids)] if cids else "none"
        url = {"rerun": f"/api/comparisons/{cid}/rerun", "delete-comparison": f"/api/comparisons/{cid}",
               "read": f"/api/comparisons/{cid}/events"}[kind]
        return kind, a.request({"rerun": "POST", "delete-comparison": "DELETE", "read": "GET"}[kind], url)

    kinds = rng.choices(["upload", "delete-run", "compare", "rerun", "delete-comparison", "read"],
                        weights=[2, 2, 3, 1, 1, 3], k=ops)
    jobs = [(kind, rng.randrange(1 << 30), rng.randrange(1 << 30), rng.randrange(1 << 30)) for kind in kinds]
    with ThreadPoolExecutor(threads) as pool:
        answers = list(pool.map(op, jobs))
    for kind, r in answers:
        res = a.judge(r)
        if res.outcome in ("hang", "http_500", "unsafe"):
            return Result("", "", res.outcome, f"{kind}: {res.detail}")
    time.sleep(1.0)  # let the comparisons still running end
    runs = a.request("GET", "/api/runs")
    comparisons = a.request("GET", "/api/comparisons")
    for r in (runs, comparisons):
        if isinstance(r, Result) or r.status_code != 200:
            return a.judge(r) if not isinstance(r, Result) else r
    alive = {run["id"] for run in runs.json()}
    orphans = [c["id"] for c in comparisons.json() if not {_ref(c.get("run_a")), _ref(c.get("run_b"))} <= alive]
    if orphans:
        return Result("", "", "wrong_answer", f"comparisons of deleted runs survive the storm: {orphans[:3]}")
    for run_id in alive:
        res = a.judge(a.request("GET", f"/api/runs/{run_id}"))
        if res.outcome != "ok":
            return Result("", "", res.outcome if res.failed else "wrong_answer", f"listed run {run_id}: {res.detail}")
        a.request("DELETE", f"/api/runs/{run_id}")
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    return Result("", "", "ok", f"{ops} requests from {threads} threads ({counts}): no 5xx, no orphan")


def _rules_cases(a: Api):
    """Rule sets: the CLI's hostile rules files imported, hostile JSON bodies created and saved."""
    from .families import RULE_FILES

    json_headers = {"content-type": "application/json"}
    for case, content, _ in RULE_FILES:
        yield f"rules/import-{case}", lambda content=content: _judged(a, "POST", "/api/rulesets/import",
                                                                        content=content, headers=json_headers)
    deep = b"[" * 100_000 + b"]" * 100_000
    bodies = [
        ("create-deep-rules", b'{"name": "deep", "rules": [' + deep + b"]}"),
        ("create-deep-body", deep),
        ("create-non-utf8", b'{"name": "\xff\xfe", "rules": []}'),
        ("create-name-10k", b'{"name": "' + b"n" * 10_000 + b'", "rules": []}'),
        ("create-name-injection", ('{"name": %s, "rules": []}' % json.dumps(INJECTION)).encode()),
        ("create-rules-not-list", b'{"name": "x", "rules": {"a": 1}}'),
        ("create-rule-deep-match", b'{"name": "y", "rules": [{"id": "r", "action": "ignore", "boundary": '
                                   + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}]}"),
        ("create-nan", b'{"name": "z", "rules": [{"id": "r", "action": "ignore", "step": NaN}]}'),
    ]
    for case, body in bodies:
        yield f"rules/{case}", lambda body=body: _judged(a, "POST", "/api/rulesets", content=body, headers=json_headers)

    def save_hostile() -> Result:
        r = a.request("POST", "/api/rulesets", json={"name": "fuzz-target", "rules": []})
        if isinstance(r, Result) or r.status_code != 201:
            return a.judge(r) if not isinstance(r, Result) else r
        rid = r.json()["id"]
        for body in (b'{"rules": [' + deep + b"]}", b'{"name": ""}', b'{"rules": [{"id": 5}]}'):
            res = _judged(a, "PUT", f"/api/rulesets/{rid}", content=body, headers=json_headers)
            if res.failed:
                return res
        res = _judged(a, "POST", f"/api/rulesets/{rid}/copy", json={"name": "c" * 5000})
        a.request("DELETE", f"/api/rulesets/{rid}")
        return res

    yield "rules/save-hostile-versions", save_hostile
    yield "rules/allow-all-on-a-killed-run", lambda: _whitewash(a)
    yield "rules/compare-with-missing-rule-set", lambda: _judged(
        a, "POST", "/api/comparisons", json={"run_a": "nope", "run_b": "nope", "rule_set_id": "x' OR 1=1 --"})


def _whitewash(a: Api) -> Result:
    """A rule set accepting every gap and difference, on two copies of the killed run: not identical."""
    from .families import ALLOW_ALL

    rs = a.request("POST", "/api/rulesets", json={"name": "allow all", "rules": ALLOW_ALL["rules"]})
    if isinstance(rs, Result) or rs.status_code != 201:
        return a.judge(rs) if not isinstance(rs, Result) else rs
    runs = [a.upload(run_parts(a.ctx.bases["killed"])) for _ in range(2)]
    for r in runs:
        if isinstance(r, Result) or r.status_code != 201:
            return a.judge(r) if not isinstance(r, Result) else r
    result = compare_ready(a, runs[0].json()["id"], runs[1].json()["id"], rule_set_id=rs.json()["id"])
    if result.outcome == "ok" and result.detail.endswith(": identical"):
        result = Result("", "", "false_verdict", f"a killed run compared identical under accept-all rules ({result.detail})")
    for r in runs:
        a.delete(r)
    a.request("DELETE", f"/api/rulesets/{rs.json()['id']}")
    return result


def _judged(a: Api, method: str, url: str, **kw) -> Result:
    return a.judge(a.request(method, url, **kw))


def _ref(ref) -> str | None:
    return ref.get("id") if isinstance(ref, dict) else ref


def _query_cases(a: Api, good: list[Part]):
    state: dict = {}

    def setup() -> Result:
        r1, r2 = a.upload(good), a.upload(good)
        for r in (r1, r2):
            if isinstance(r, Result) or r.status_code != 201:
                return a.judge(r)
        cmp = a.request("POST", "/api/comparisons", json={"run_a": r1.json()["id"], "run_b": r2.json()["id"]})
        if isinstance(cmp, Result) or cmp.status_code != 202:
            return a.judge(cmp) if not isinstance(cmp, Result) else cmp
        state["cid"] = cmp.json()["id"]
        result = compare_ready(a, r1.json()["id"], r2.json()["id"])  # a valid pair: every view must answer
        return (_read_every_view(a, r2.json()["id"]) or result) if result.outcome == "ok" else result

    yield "query/setup-comparison", setup
    for route, params in [
        ("timeline", {"start": "nan"}), ("timeline", {"start": "1e300"}), ("timeline", {"start": "-1e300", "end": "inf"}),
        ("timeline", {"end": "-inf"}), ("timeline", {"start": "abc"}), ("timeline", {"bins": str(10 ** 12)}),
        ("timeline", {"bins": "0"}), ("timeline", {"rank": "-1"}), ("timeline", {"rank": "9" * 30}),
        ("timeline", {"around": "nan"}), ("timeline", {"around": str(10 ** 30)}), ("timeline", {"span": str(10 ** 18)}),
        ("timeline", {"axis": "time", "start": "1e300"}), ("timeline", {"axis": "bogus"}),
        ("events", {"offset": "-1"}), ("events", {"limit": str(10 ** 12)}), ("events", {"rank": "nan"}),
        ("events", {"offset": str(10 ** 30)}), ("events", {"status": "<script>"}),
        ("graph", {"depth": "1e300"}), ("events/0/a/99999999999999999999", {}), ("events/0/x/0", {}),
        ("graph/nodes/%00", {}), ("graph/nodes/" + "n" * 5000, {}),
    ]:
        case = f"query/{route[:40]}?" + "&".join(f"{k}={v[:12]}" for k, v in params.items())
        yield case, (lambda route=route, params=params:
                     a.judge(a.request("GET", f"/api/comparisons/{state.get('cid', 'none')}/{route}", params=params)))
