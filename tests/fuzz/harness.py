"""The fuzz harness: damaged and hostile inputs against bitguard, each case classified, one table.

    .venv/bin/python -m tests.fuzz.harness --cases 8 --seed 1 --table      # from the repo root

prints the markdown table of docs/RELIABILITY.md (families x outcomes) and, below it, one line per
failing case with what reproduces it (`--only CASE_ID` reruns one case, `--keep` keeps its files).
Every case is a pure function of (seed, case id, base runs). Base runs are recorded once per
harness run, with `bitguard record`, under a temporary folder: a complete tiny GPT run and a run
whose script SIGKILLs itself after five steps (so its last events are still in rank-0.journal);
`--bases DIR` reuses ones kept by `--keep`, which makes a rerun byte-for-byte the same.

Outcomes (a case gets exactly one, the first that applies, in this order):
  hang           no answer within the timeout (20 s; `bitguard compare` runs in a worker process
                 that is killed and restarted; a case that starts its own fresh `bitguard`
                 process, whose imports alone took over 20 s on this 2-core machine under a
                 load of 13, waits 60 s)
  traceback      "Traceback" on stderr, exit status 70 (internal error), a Python exception that
                 escaped `bitguard.cli.main`, or the process died of a signal
  http_500       the upload API answered 5xx or dropped the connection, or a comparison of an
                 admitted run failed with an internal error
  unsafe         a file named pwned.csv appeared, /etc/passwd's content, a listing of /etc or a
                 server path was shown, the text report passed on control characters from a run
                 or printed a second VERDICT line, or a run the ingest cannot read was committed
  false_verdict  "identical" (exit 0) although a side was actually damaged: what the ingest reads
                 of what a verdict rests on (each event's seq, step, phase, kind and
                 boundary; each of its tensors' role, index, shape, digests and unobserved mark;
                 the manifest's tool, schema version, world size, status, completeness) differs
                 from the original, or the ingest cannot read it at all; or a killed run compared identical to a complete one
  data_lost      events of the original are no longer readable from the damaged side, and the
                 tool said nothing of damage (no exit 2, no "damaged"/"corrupt"/"checksum"/
                 "unreadable"/"lost" in its output). A journal cut short whose readable events
                 are a prefix of the original's is what a kill mid-write leaves: not counted. For
                 a killed recording: a step before the last one that ended not read back as
                 recorded.
  wrong_answer   any other answer that is not what the input calls for (a refusal in more than
                 one line included): a valid run (hostile
                 folder name) not compared identical, "diverged" for a side whose content is
                 unchanged, an invalid manifest accepted, a non-regular file or hostile upload
                 not refused, two readers of one run disagreeing
  clean_error    exit status 2 with one line on stderr (after argparse's usage lines), no
                 traceback (HTTP 4xx for the API): the input was refused
  ok             a believable verdict: exit 0, 1 or 3 (HTTP 2xx) where the input allows it

Families: mutated (truncation, bit flips, inserted and zeroed bytes in manifest.json, rank-0.duckdb,
its WAL and rank-0.journal of the two base runs; `--cases` per file), manifest (hostile manifests),
names (hostile folder names, as the run folder and as its parent, and `--cases` of them recorded
into), nonregular (FIFOs, links,
folders where files belong), rankfile (valid DuckDB rank files whose tables lie), ranks (a synthetic
two-rank run with ranks missing, swapped, foreign, extra or empty), cli (--rules
files, arguments, output paths, a closed stdout, two readers of one killed run), sigkill
(recordings killed at `--cases` drawn points: the steps before the last one that ended must read
back as recorded), api (the upload API of a live server: `--cases` mutated uploads and three
times as many hostile manifests and rank files, malformed multipart, concurrent uploads and
deletes, hostile query parameters, rule sets), workspace (runs damaged on the server's disk, then
the server restarted).

This module knows how to run and judge cases; what the cases are lives in mutations.py (the
inputs), families.py (run folders and the CLI), rankfiles.py, ranks.py, sigkill.py, api_family.py and
workspace_family.py (the server); worker.py is the child process that runs bitguard.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
WORKER = Path(__file__).with_name("worker.py")
TINYGPT = REPO / "sample_traces" / "tinygpt.py"
TIMEOUT = 20.0
RECORD_TAIL = [sys.executable, str(TINYGPT), "--steps", "2", "--layers", "1", "--width", "16"]  # the complete base run

# outcome -> its column in the table, in the table's order (the docstring above defines each)
OUTCOMES = {"ok": "ok verdicts", "clean_error": "clean errors", "traceback": "tracebacks", "hang": "hangs",
            "http_500": "HTTP 500", "false_verdict": "false verdicts", "data_lost": "data lost",
            "wrong_answer": "wrong answers", "unsafe": "unsafe"}
FAILURES = tuple(k for k in OUTCOMES if k not in ("ok", "clean_error"))
SAID_DAMAGED = ("damaged", "corrupt", "checksum", "unreadable", "lost")
PASSWD = "root:x:0:0"

KILLED_SCRIPT = """\
import os, signal, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step == 4:
        os.kill(os.getpid(), signal.SIGKILL)  # no launcher folds the journal: it stays as the kill left it
"""


@dataclass
class Result:
    family: str
    case: str  # case id: `--only` reruns it
    outcome: str
    detail: str = ""  # what happened: exit status, first line of stderr, HTTP status

    @property
    def failed(self) -> bool:
        return self.outcome in FAILURES


class Worker:
    """A child Python running bitguard calls in-process (worker.py), killed and restarted on a hang."""

    def __init__(self, cwd: Path, log: Path):
        self.cwd, self.log = cwd, log
        self.proc: subprocess.Popen | None = None
        self._buf = b""

    def _start(self) -> None:
        r, w = os.pipe()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, str(WORKER), str(w)], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=log, pass_fds=(w,), cwd=self.cwd,
                                         start_new_session=True)
        os.close(w)
        self._answers, self._buf = r, b""

    def call(self, request: dict, timeout: float = TIMEOUT) -> dict | str:
        """The worker's answer, or "hang" (no answer in time) or "died: ..." (the process ended)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                self.stop()
                return "hang"
            chunk = os.read(self._answers, 1 << 20)
            if not chunk:
                code = self.proc.wait()
                self.stop()
                return f"died: exit status {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else "")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            os.close(self._answers)
            self.proc = None


class Context:
    """The temporary folder, the base runs (pristine: cases work on copies) and the worker."""

    def __init__(self, root: Path | None = None, keep: bool = False, timeout: float = TIMEOUT):
        self.keep, self.timeout = keep, timeout
        self.process_timeout = max(60.0, 3 * timeout)  # a fresh Python's start is part of it
        self.root = Path(root or tempfile.mkdtemp(prefix="bitguard-fuzz-")).resolve()
        self.cwd = self.root / "cwd"  # the worker's and the server's working directory: pwned.csv lands here
        self.cwd.mkdir(parents=True, exist_ok=True)
        self.worker = Worker(self.cwd, self.root / "worker.log")
        self.bases: dict[str, Path] = {}
        self.reads: dict[str, dict] = {}
        self._n = 0

    def record_bases(self, reuse: Path | None = None) -> None:
        """Record the two base runs, or take them from `reuse` (a folder holding complete/ and killed/,
        e.g. one kept by an earlier `--keep`), then read them once and check they compare identical."""
        base = self.root / "base"
        base.mkdir(exist_ok=True)
        if reuse:
            for name in ("complete", "killed"):
                shutil.copytree(Path(reuse) / name, base / name, symlinks=True)
                self.bases[name] = base / name
        else:
            self._record(base)
        if not (base / "killed" / "rank-0.journal").exists():
            raise RuntimeError("the killed base run left no rank-0.journal; the journal family has nothing to mutate")
        for name in self.bases:
            self.reads[name] = self.read(self.copy(name))
            if not self.reads[name].get("ok"):
                raise RuntimeError(f"the ingest cannot read the pristine {name} base run: {self.reads[name]}")
        check = self.cli(["compare", str(self.copy("complete")), str(self.copy("complete"))])
        if not isinstance(check, dict) or check["rc"] != 0:
            raise RuntimeError(f"two copies of the complete base run do not compare identical: {check}")

    def _record(self, base: Path) -> None:
        (base / "killed.py").write_text(KILLED_SCRIPT)
        jobs = {
            "complete": [sys.executable, "-m", "bitguard", "record", "--out", str(base / "complete"), "--",
                         *RECORD_TAIL],
            # in-process recording (`-- SCRIPT.py`): the killed process is the recorder, no launcher folds
            "killed": [sys.executable, "-m", "bitguard", "record", "--out", str(base / "killed"), "--",
                       str(base / "killed.py")],
        }
        procs = {k: subprocess.Popen(cmd, cwd=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for k, cmd in jobs.items()}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            expected = -signal.SIGKILL if name == "killed" else 0
            if proc.returncode != expected:
                raise RuntimeError(f"recording the {name} base run exited {proc.returncode}:\n{err}{out}")
            self.bases[name] = base / name

    def scratch(self, label: str) -> Path:
        self._n += 1
        d = self.root / "cases" / f"{self._n:05d}-{label}"
        d.mkdir(parents=True)
        return d

    def copy(self, base: str, dest: Path | None = None) -> Path:
        dest = dest or self.scratch(base) / base
        shutil.copytree(self.bases[base], dest, symlinks=True)
        return dest

    def cli(self, argv: list[str], timeout: float | None = None) -> dict | str:
        return self.worker.call({"op": "cli", "argv": argv}, timeout or self.timeout)

    def read(self, path: Path) -> dict | str:
        return self.worker.call({"op": "read", "path": str(path)}, self.timeout)

    def pwned(self) -> list[Path]:
        return [p for p in [*self.root.rglob("pwned.csv"), *REPO.glob("pwned.csv")] if p.is_file()]

    def close(self) -> None:
        self.worker.stop()
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)


def first_line(text: str) -> str:
    """The line that says what happened: a traceback's last line, a report's VERDICT line, else the first."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    if lines[0] == "{":  # a --json report
        try:
            doc = json.loads(text)
            return f"JSON verdict {doc.get('verdict')!r}" + (f", {doc['first_divergence'].get('cause')} divergence"
                                                             if isinstance(doc.get("first_divergence"), dict) else "")
        except ValueError:
            pass
    verdict = [ln for ln in lines if ln.startswith("VERDICT")]
    return (lines[-1] if "Traceback" in text else verdict[0] if verdict else lines[0])[:200]


def _refusal_lines(stderr: str) -> list[str]:
    """stderr's lines without argparse's usage block (usage: and its indented continuation lines)."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if lines and lines[0].startswith("usage:"):
        lines = [ln for ln in lines[1:] if not ln.startswith(" ")]
    return lines


def crashed(answer: dict | str) -> Result | None:
    """The hang/traceback outcome of a CLI answer, a wrong_answer for a refusal (exit 2) that is not
    one line on stderr, or None when the command answered normally."""
    if answer == "hang":
        return Result("", "", "hang", "no answer before the timeout")
    if isinstance(answer, str):
        return Result("", "", "traceback", answer)
    if answer["rc"] == "exception" or answer["rc"] == 70 or "Traceback" in answer["stderr"]:
        return Result("", "", "traceback", f"exit {answer['rc']}: {first_line(answer['stderr'])}")
    if answer["rc"] not in (0, 1, 2, 3):
        return Result("", "", "traceback", f"exit {answer['rc']}: {first_line(answer['stderr'])}")
    if answer["rc"] == 2 and len(_refusal_lines(answer["stderr"])) != 1:
        return Result("", "", "wrong_answer", f"exit 2 with {len(_refusal_lines(answer['stderr']))} lines on stderr, "
                                              f"not one: {answer['stderr'][:200]!r}")
    return None


def judge_cli(answer: dict | str, expect: str) -> Result:
    """Outcome of a CLI answer where the input calls for `expect`: "identical" (exit 0), "error"
    (exit 2), "verdict" (0, 1 or 3), "refused-or-verdict" (2 or 3), or "any" (0 to 3)."""
    bad = crashed(answer)
    if bad:
        return bad
    rc, text = answer["rc"], answer["stdout"] + answer["stderr"]
    detail = f"exit {rc}: {first_line(answer['stderr'] if rc == 2 else answer['stdout'])}"
    if PASSWD in text:
        return Result("", "", "unsafe", "the output shows /etc/passwd's content")
    allowed = {"identical": (0,), "error": (2,), "verdict": (0, 1, 3), "refused-or-verdict": (2, 3),
               "any": (0, 1, 2, 3)}[expect]
    if rc not in allowed:
        return Result("", "", "wrong_answer", f"expected {expect}, got {detail}")
    return Result("", "", "clean_error" if rc == 2 else "ok", detail)


def said_damaged(answer: dict, root: Path) -> bool:
    """Whether the output reports damage in its own words (paths under the harness's folder taken out)."""
    text = re.sub(re.escape(str(root)) + r"\S*", "", answer["stdout"] + answer["stderr"])
    return any(w in text.lower() for w in SAID_DAMAGED)


FAMILIES = ("mutated", "rankfile", "ranks", "manifest", "names", "nonregular", "cli", "sigkill", "api",
            "workspace")


def run_family(name: str, ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    from . import api_family, families, rankfiles, ranks, sigkill, workspace_family

    fn = {"mutated": families.mutated, "rankfile": rankfiles.rankfile, "ranks": ranks.ranks,
          "manifest": families.manifests,
          "names": families.names,
          "nonregular": families.nonregular, "cli": families.cli_inputs, "sigkill": sigkill.sigkill,
          "api": api_family.api, "workspace": workspace_family.workspace}[name]
    results = fn(ctx, cases=cases, seed=seed, only=only)
    for r in results:
        r.family = name
    return results


def table(results: list[Result], elapsed: dict[str, float]) -> str:
    cols = [("cases tried", None), *((title, key) for key, title in OUTCOMES.items()), ("seconds", None)]
    lines = ["| family | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    by_family: dict[str, Counter] = {}
    for r in results:
        by_family.setdefault(r.family, Counter())[r.outcome] += 1
    total = Counter()
    for fam, counts in by_family.items():
        total.update(counts)
        cells = [str(sum(counts.values())), *(str(counts[k]) for _, k in cols[1:-1]), f"{elapsed.get(fam, 0):.0f}"]
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    cells = [str(sum(total.values())), *(str(total[k]) for _, k in cols[1:-1]), f"{sum(elapsed.values()):.0f}"]
    lines.append("| **all** | " + " | ".join(f"**{c}**" for c in cells) + " |")
    return "\n".join(lines)


def _signature(detail: str) -> str:
    """What happened, without what differs from case to case (mutation, ids, numbers, paths)."""
    text = re.sub(r"^(truncate|bitflip|insert|zero) size=\d+ at byte \d+: ", "", detail)
    text = re.sub(r"/tmp/\S+|\b[0-9a-f]*\d[0-9a-f]*\b", "…", text)
    return text[:110]


def grouped(failures: list[Result]) -> str:
    """One line per (family, outcome, what happened), with how many cases and three of their ids."""
    groups: dict[tuple, list[Result]] = {}
    for r in failures:
        groups.setdefault((r.family, r.outcome, _signature(r.detail)), []).append(r)
    lines = []
    for (family, outcome, _), rs in groups.items():
        ids = ", ".join(f"`{r.case}`" for r in rs[:3]) + (", …" if len(rs) > 3 else "")
        lines.append(f"- {family} **{outcome}** ×{len(rs)} ({ids}): {rs[0].detail[:200]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz.harness", description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=8,
                   help="random cases per mutated file, kills, mutated uploads (x3: hostile uploads), "
                        "names recorded into")
    p.add_argument("--seed", type=int, default=1, help="every random choice derives from it and the case id")
    p.add_argument("--family", action="append", choices=FAMILIES, help="only these families (repeatable)")
    p.add_argument("--only", default=None, help="only cases whose id contains this text")
    p.add_argument("--table", action="store_true", help="print the markdown table (docs/RELIABILITY.md)")
    p.add_argument("--bases", default=None, help="take the base runs from this folder (complete/, killed/) "
                   "instead of recording them")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    p.add_argument("--each", action="store_true", help="list every failing case (default: grouped)")
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds before a case counts as a hang")
    p.add_argument("--json", default=None, help="also write every case's outcome to this JSON file")
    args = p.parse_args(argv)
    ctx = Context(keep=args.keep, timeout=args.timeout)
    results: list[Result] = []
    elapsed: dict[str, float] = {}
    start = time.monotonic()
    try:
        ctx.record_bases(args.bases)
        elapsed["(base runs)"] = time.monotonic() - start
        for fam in args.family or FAMILIES:
            t0 = time.monotonic()
            results += run_family(fam, ctx, args.cases, args.seed, args.only)
            elapsed[fam] = time.monotonic() - t0
            print(f"{fam}: {sum(1 for r in results if r.family == fam)} cases in {elapsed[fam]:.1f} s",
                  file=sys.stderr)
    finally:
        ctx.close()
    base_s = elapsed.pop("(base runs)", 0.0)
    if args.table:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = "python -m tests.fuzz.harness " + " ".join(argv if argv is not None else sys.argv[1:])
        print(f"`{cmd}` ({when}; git {_git_head()}; base runs recorded in {base_s:.0f} s)\n")
        print(table(results, elapsed))
    failures = [r for r in results if r.failed]
    if failures and args.each:
        print(f"\n{len(failures)} failing case(s):")
        for r in failures:
            print(f"- {r.family} `{r.case}`: **{r.outcome}**: {r.detail}")
    elif failures:
        print(f"\n{len(failures)} failing case(s), grouped by what happened (`--each` lists every one):")
        print(grouped(failures))
    if args.keep:
        print(f"\ncases kept under {ctx.root}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 1 if failures else 0


def _git_head() -> str:
    """The commit the harness ran on, and whether tracked files differed from it."""
    try:
        git = ["git", "-C", str(REPO)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return (head.stdout.strip() or "?") + (" with uncommitted changes" if dirty else "")
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
