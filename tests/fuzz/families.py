"""The fuzz families that go through `bitguard compare`: mutated run folders, hostile manifests,
hostile folder names, non-regular files and hostile command-line inputs.

Each family builds its cases on copies of the harness's base runs, runs them through the
harness's worker (or, where a real pipe is the point, a subprocess) and judges them with the
harness's rules (harness.py's docstring defines the outcomes). The server is api_family.py's.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from .harness import RECORD_TAIL, Context, Result, crashed, first_line, judge_cli, said_damaged
from .mutations import HOSTILE_MANIFESTS, HOSTILE_NAMES, OPS, apply, plan

VERDICTS = {0: "identical", 1: "diverged", 3: "inconclusive"}  # exit status -> the JSON report's verdict
TARGETS = [("complete", "manifest.json"), ("complete", "rank-0.duckdb"), ("killed", "manifest.json"),
           ("killed", "rank-0.duckdb"), ("killed", "rank-0.duckdb.wal"), ("killed", "rank-0.journal")]


def _wanted(case: str, only: str | None) -> bool:
    return only is None or only in case


def named(case: str, r: Result) -> Result:
    """`r` with its case id (judges leave it empty; the family that ran the case knows it)."""
    r.case = case
    return r


def compare_argv(original: Path, other: Path, other_first: bool) -> list[str]:
    """`bitguard compare` of an original and a damaged or hostile copy, the copy as run A or as run B."""
    return ["compare", str(other), str(original)] if other_first else ["compare", str(original), str(other)]


def _differ(a: list, b: list) -> int:
    """Rows that differ by position, plus those one list has beyond the other."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def judge_damage(answer, read, orig: dict, cut_tail_ok: bool, root: Path, count_lost: bool = True) -> Result:
    """Outcome of comparing an original with a mutated copy whose ingest read is `read`. With
    `count_lost` False (rows removed on purpose, not by the tool), missing events are not data lost."""
    bad = crashed(answer)
    if bad:
        return bad
    if not isinstance(read, dict):
        read = {"ok": False, "error": read}
    rc = answer["rc"]
    if not read["ok"]:
        why = f"the ingest cannot read it ({read['error'][:120]})"
    elif read["facts"] != orig["facts"]:
        why = f"its manifest now says {read['facts']}"
    elif read["events"] != orig["events"] or read["tensors"] != orig["tensors"]:
        why = (f"{_differ(read['events'], orig['events'])} event and {_differ(read['tensors'], orig['tensors'])} "
               f"tensor rows differ, {len(read['events'])} events read of {len(orig['events'])}")
    else:
        why = None
    detail = f"exit {rc}: {first_line(answer['stderr'] if rc == 2 else answer['stdout'])}"
    if rc == 0 and why:
        return Result("", "", "false_verdict", f"identical although {why}")
    if count_lost and read["ok"] and rc != 2 and not said_damaged(answer, root):
        lost = set(orig["events"]) - set(read["events"])
        prefix = read["events"] == orig["events"][:len(read["events"])]
        if lost and not (cut_tail_ok and prefix):
            return Result("", "", "data_lost", f"{len(lost)} of {len(orig['events'])} events unreadable, "
                                               f"not reported as damage ({detail})")
    if rc == 1 and not why:
        return Result("", "", "wrong_answer", f"diverged although the content read is unchanged ({detail})")
    return Result("", "", "clean_error" if rc == 2 else "ok", detail + (f" [{why}]" if why else ""))


def mutated(ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    """Truncation, bit flips, inserted and zeroed bytes in each file of the two base runs."""
    results = []
    for base, fname in TARGETS:
        source = ctx.bases[base] / fname
        if not source.exists():
            continue
        data = source.read_bytes()
        for i in range(cases):
            op = OPS[i % len(OPS)]
            case = f"{base}/{fname}/{op}-{i}"
            if not _wanted(case, only):
                continue
            m = plan(op, len(data), random.Random(f"{seed}:{case}"))
            d = ctx.scratch("mutated")
            mutant = ctx.copy(base, d / "mutant")  # no word of SAID_DAMAGED in a path the report shows
            (mutant / fname).write_bytes(apply(data, m))
            shutil.copytree(mutant, d / "oracle")  # reading folds the journal: the oracle reads its own copy
            read = ctx.read(d / "oracle")
            as_json = ["--json"] if i % 4 >= 2 else []  # half the cases check the JSON report's verdict too
            answer = ctx.cli([*compare_argv(ctx.copy(base, d / "original"), mutant, other_first=i % 2 == 1), *as_json])
            r = judge_damage(answer, read, ctx.reads[base], op == "truncate" and fname.endswith("journal"), ctx.root)
            if as_json and r.outcome == "ok":
                r = _json_verdict(answer, VERDICTS[answer["rc"]]) or r
            r.detail = f"{m.describe()}: {r.detail}"
            results.append(named(case, r))
    return results


def manifests(ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    """A hostile manifest.json in a copy of the complete run, compared with the original."""
    results = []
    manifest = json.loads((ctx.bases["complete"] / "manifest.json").read_text())
    for i, (case, edit, calls_for) in enumerate(HOSTILE_MANIFESTS):
        if not _wanted(case, only):
            continue
        d = ctx.scratch("manifest")
        hostile = ctx.copy("complete", d / "hostile")
        (hostile / "manifest.json").write_bytes(edit(manifest))
        answer = ctx.cli(compare_argv(ctx.copy("complete", d / "original"), hostile, other_first=i % 2 == 1))
        r = crashed(answer)
        if r is None:
            rc = answer["rc"]
            detail = f"exit {rc}: {first_line(answer['stderr'] if rc == 2 else answer['stdout'])}"
            if rc == 0 and calls_for == "false":
                r = Result("", "", "false_verdict", f"identical although the manifest no longer says the run is whole: "
                                                    f"{detail}")
            elif rc != 2 and calls_for == "refuse":
                r = Result("", "", "wrong_answer", f"an invalid manifest was accepted: {detail}")
            elif rc == 1 and calls_for == "any":
                r = Result("", "", "wrong_answer", f"diverged although only the manifest changed: {detail}")
            else:
                r = Result("", "", "clean_error" if rc == 2 else "ok", detail)
        results.append(named(case, r))
    return results


def names(ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    """A valid run copied into a folder with a hostile name compares identical with its original;
    `cases` of the names are also recorded into (RECORD_INTO, in order)."""
    results = []
    hostile = [*HOSTILE_NAMES, ("deep-path", "/".join(["d" * 200] * 18))]
    for i, (label, name) in enumerate(hostile):
        for placement in ("folder", "parent"):
            case = f"{label}/{placement}"
            if not _wanted(case, only):
                continue
            d = ctx.scratch("name")
            target = d / name if placement == "folder" else d / name / "run"
            try:
                ctx.copy("complete", target)
            except OSError as exc:  # the file system refuses the name: nothing to test
                print(f"names: skipped {case}: {exc}", file=sys.stderr)
                continue
            as_json = ["--json"] if placement == "parent" else []  # the JSON report must carry any name
            answer = ctx.cli([*compare_argv(ctx.copy("complete", d / "original"), target, other_first=i % 2 == 1), *as_json])
            r = judge_cli(answer, "identical")
            if as_json and r.outcome == "ok":
                r = _json_verdict(answer, "identical") or r
            results.append(named(case, _no_pwned(ctx, r)))
    results += _record_into(ctx, [(label, name) for label, name in hostile if label in RECORD_INTO][:cases], only)
    return results


RECORD_INTO = ("sql-injection", "single-quote", "newline", "unicode", "backslash", "leading-dash", "long-255-bytes",
               "double-quote")  # the order --cases takes them in


def _no_pwned(ctx: Context, r: Result) -> Result:
    for p in ctx.pwned():
        p.unlink()
        r = Result("", "", "unsafe", f"{p} was written")
    return r


def _record_into(ctx: Context, hostile: list[tuple[str, str]], only: str | None) -> list[Result]:
    """`bitguard record --out FOLDER` with a hostile name records as anywhere else (the run compares
    identical with the complete base run: the same tiny GPT, the same seed) or is refused in one
    line before training; it runs nothing."""
    jobs = [(f"record-into/{label}", name) for label, name in hostile if _wanted(f"record-into/{label}", only)]
    results = []
    for n in range(0, len(jobs), 2):  # two recordings at a time
        procs = []
        for case, name in jobs[n:n + 2]:
            out = ctx.scratch("record-into") / name
            cmd = [sys.executable, "-m", "bitguard", "record", "--out", str(out), "--", *RECORD_TAIL]
            procs.append((case, out, subprocess.Popen(cmd, cwd=ctx.cwd, stdout=subprocess.PIPE,
                                                      stderr=subprocess.PIPE, text=True)))
        for case, out, proc in procs:
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                results.append(named(case, Result("", "", "hang", "the recording did not end in 120 s")))
                continue
            if "Traceback" in err or proc.returncode == 70:
                r = Result("", "", "traceback", f"record exit {proc.returncode}: {first_line(err)}")
            elif proc.returncode == 2:  # refused before anything was written, in one line: a clean error
                r = Result("", "", "clean_error", f"record exit 2: {first_line(err)}")
            elif proc.returncode != 0:
                r = Result("", "", "wrong_answer", f"record exit {proc.returncode}: {first_line(err)}")
            else:
                r = judge_cli(ctx.cli(["compare", str(ctx.bases["complete"]), str(out)]), "identical")
            results.append(named(case, _no_pwned(ctx, r)))
    return results


def _json_verdict(answer: dict, expected: str) -> Result | None:
    """A wrong_answer when stdout is not a bitguard.compare JSON document with the expected verdict."""
    try:
        verdict = json.loads(answer["stdout"]).get("verdict")
    except ValueError as exc:
        return Result("", "", "wrong_answer", f"the --json report is not JSON ({exc})")
    if verdict != expected:
        return Result("", "", "wrong_answer", f"the --json report says {verdict!r}, not {expected!r}")
    return None


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _link(target: str | Path):
    def make(path: Path) -> None:
        path.unlink(missing_ok=True)
        path.symlink_to(target)
    return make


def _folder(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.mkdir()


def nonregular(ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    """FIFOs, links out of the run folder and folders where a run's files belong: refused, never a hang."""
    outside = ctx.copy("complete")  # a valid rank file outside the run folder, for a link leading out
    makers = {"fifo": _fifo, "passwd-link": _link("/etc/passwd"), "dev-null-link": _link("/dev/null"),
              "link-out-of-run": _link(outside / "rank-0.duckdb"), "dangling-link": _link("/nonexistent/x"),
              "folder": _folder}
    results = []
    for fname in ("manifest.json", "rank-0.duckdb", "rank-0.journal", "rank-1.duckdb"):
        for kind, make in makers.items():
            case = f"{fname}/{kind}"
            if not _wanted(case, only) or (kind == "link-out-of-run" and fname == "manifest.json"):
                continue
            d = ctx.scratch("nonregular")
            run = ctx.copy("complete", d / "run")
            make(run / fname)
            answer = ctx.cli(compare_argv(ctx.copy("complete", d / "original"), run, other_first=False),
                             timeout=ctx.timeout)
            results.append(named(case, judge_cli(answer, "error")))
    return results


RULE_FILES: list[tuple[str, bytes, str]] = [  # (case, content, what the input calls for)
    ("non-utf8", b'\xff\xfe{"rules": []}', "error"),
    ("deep-list-1e5", b"[" * 100_000 + b"]" * 100_000, "error"),
    ("deep-rule-1e5", b'{"schema": "bitguard.rules/1", "rules": [' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"]}",
     "error"),
    ("huge-valid-16MiB", b'{"schema": "bitguard.rules/1", "rules": []' + b" " * (16 << 20) + b"}", "any"),
    ("huge-brackets-16MiB", b"[" * (16 << 20), "error"),
    ("empty", b"", "error"),
    ("null", b"null", "error"),
    ("list", b"[]", "error"),
    ("rules-string", b'{"rules": "x"}', "error"),
    ("rules-of-numbers", b'{"rules": [1, 2]}', "error"),
    ("rule-id-number", b'{"rules": [{"id": 1, "action": "ignore"}]}', "error"),
    ("rule-nan", b'{"rules": [{"id": "r", "action": "ignore", "step": NaN}]}', "error"),
    ("rule-match-object", b'{"rules": [{"id": "r", "action": "ignore", "boundary": {"$ne": 1}}]}', "error"),
    # well-formed rules with nasty matches: a verdict or a refusal, never a crash or a hang
    *[(case, (b'{"schema": "bitguard.rules/1", "rules": [{"id": "r", "action": "ignore", "match": %s}]}' % m), "any")
      for case, m in [
          ("glob-10k-stars", b'{"boundary": "' + b"*a" * 5000 + b'b"}'),
          ("glob-unclosed-bracket", b'{"boundary": "blocks.[0"}'),
          ("glob-every-char-class", b'{"boundary": "' + b"[!a-z]" * 2000 + b'"}'),
          ("steps-huge", b'{"steps": [1000000000000000000000000000000, null]}'),
          ("steps-reversed", b'{"steps": [5, 1]}'),
          ("steps-strings", b'{"steps": ["a", 1]}'),
          ("rank-huge", b'{"rank": 1000000000000000000000000000000}'),
          ("rank-negative", b'{"rank": -1}'),
          ("role-unknown", b'{"role": "oracle"}'),
          ("match-everything", b"{}"),
      ]],
    ("10k-rules", b'{"schema": "bitguard.rules/1", "rules": ['
     + b", ".join(b'{"id": "r%d", "action": "allow-gap", "match": {"boundary": "m%d.*"}}' % (i, i) for i in range(10_000))
     + b"]}", "any"),
    ("duplicate-ids", b'{"schema": "bitguard.rules/1", "rules": [{"id": "r", "action": "ignore"}, '
                      b'{"id": "r", "action": "allow-gap"}]}', "error"),
]


def cli_inputs(ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    """Hostile --rules files, arguments and output paths; a stdout closed under the report."""
    d = ctx.scratch("cli")
    a, b = ctx.copy("complete", d / "a"), ctx.copy("complete", d / "b")
    (d / "file").write_text("not a run\n")
    os.mkfifo(d / "fifo")
    calls: list[tuple[str, list[str], str]] = []
    for case, content, expect in RULE_FILES:
        (d / f"rules-{case}.json").write_bytes(content)
        calls.append((f"rules/{case}", ["compare", str(a), str(b), "--rules", str(d / f"rules-{case}.json")], expect))
    for case, path in (("folder", d), ("fifo", d / "fifo"), ("passwd", "/etc/passwd"), ("dev-null", "/dev/null"),
                       ("missing", d / "nope.json")):
        calls.append((f"rules/{case}", ["compare", str(a), str(b), "--rules", str(path)], "error"))
    for case, argv, expect in [
        ("rank-negative", ["--rank", "-1"], "error"), ("rank-absent", ["--rank", "7"], "error"),
        ("rank-huge", ["--rank", "9" * 30], "error"), ("rank-word", ["--rank", "abc"], "error"),
        ("json", ["--json"], "identical"),
    ]:
        calls.append((f"args/{case}", ["compare", str(a), str(b), *argv], expect))
    calls.append(("args/same-run-twice", ["compare", str(a), str(a)], "identical"))
    for case, path in (("file", d / "file"), ("empty-string", ""), ("dev-null", "/dev/null"), ("fifo", d / "fifo"),
                       ("missing", d / "nowhere")):
        calls.append((f"args/run-is-{case}", ["compare", str(a), str(path)], "error"))
    for case, out, expect in (("missing-folder", d / "no" / "x.perfetto-trace", "any"), ("a-folder", d, "error"),
                              ("dev-full", "/dev/full", "error")):
        calls.append((f"export/{case}", ["export-perfetto", str(a), str(b), "-o", str(out)], expect))
    calls.append(("export/max-events-negative", ["export-perfetto", str(a), str(b), "-o", str(d / "t.pftrace"),
                                                 "--max-events", "-5"], "error"))
    results = []
    for case, argv, expect in calls:
        if _wanted(case, only):
            results.append(named(case, judge_cli(ctx.cli(argv, timeout=ctx.timeout), expect)))
    for case, extra in (("closed-stdout/text", []), ("closed-stdout/json", ["--json"])):
        if _wanted(case, only):
            results.append(named(case, _closed_stdout(ctx, [str(a), str(b), *extra])))
    if _wanted("pipe/head-1", only):
        results.append(named("pipe/head-1", _head(ctx, [str(a), str(b)])))
    for n in range(2):
        if _wanted(f"concurrent-readers/killed-run-{n}", only):
            results.append(named(f"concurrent-readers/killed-run-{n}", _two_readers(ctx)))
    results += _whitewash(ctx, d, only)
    return results


ALLOW_ALL = {"schema": "bitguard.rules/1", "rules": [
    {"id": "any-gap", "action": "allow-gap", "match": {}}, {"id": "any-digest", "action": "ignore", "match": {}}]}


def _whitewash(ctx: Context, d: Path, only: str | None) -> list[Result]:
    """Rules that accept every gap and every digest difference cannot make what is not known
    identical: unrelated runs (nothing paired), a killed run, a run with a rank missing."""
    rules = d / "allow-all.json"
    rules.write_text(json.dumps(ALLOW_ALL))
    two_ranks = d / "two-ranks"
    _write_two_rank_run(two_ranks)
    one_rank = d / "rank-1-missing"
    shutil.copytree(two_ranks, one_rank)
    (one_rank / "rank-1.duckdb").unlink()
    pairs = {"unrelated-runs": (ctx.copy("complete"), ctx.copy("killed")),
             "killed-run": (ctx.copy("killed"), ctx.copy("killed")),
             "rank-missing": (two_ranks, one_rank)}
    results = []
    for case, (a, b) in pairs.items():
        if not _wanted(f"rules-whitewash/{case}", only):
            continue
        answer = ctx.cli(["compare", str(a), str(b), "--rules", str(rules)])
        r = crashed(answer)
        if r is None:
            detail = f"exit {answer['rc']}: {first_line(answer['stderr'] if answer['rc'] == 2 else answer['stdout'])}"
            r = Result("", "", "false_verdict" if answer["rc"] == 0 else "clean_error" if answer["rc"] == 2 else "ok",
                       ("identical under rules that accept everything: " if answer["rc"] == 0 else "") + detail)
        results.append(named(f"rules-whitewash/{case}", r))
    return results


def _write_two_rank_run(path: Path) -> None:
    from .ranks import fixtures_runs  # tests/ on sys.path, the synthetic run writer

    fixtures_runs.write_run(str(path), fixtures_runs.RunSpec(layers=2, steps=2, world_size=2))


def _two_readers(ctx: Context) -> Result:
    """Two `bitguard compare` processes reading one killed run (its journal unfolded) at once agree."""
    d = ctx.scratch("readers")
    ref, killed = ctx.copy("killed", d / "reference"), ctx.copy("killed", d / "killed")
    procs = [subprocess.Popen([sys.executable, "-m", "bitguard", "compare", str(ref), str(killed)], cwd=ctx.cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    answers = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=ctx.process_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return Result("", "", "hang", "a reader did not exit before the timeout")
        answers.append({"rc": proc.returncode, "stdout": out, "stderr": err})
    for answer in answers:
        bad = crashed(answer)
        if bad:
            return bad
    codes = [a["rc"] for a in answers]
    if len(set(codes)) > 1 or codes[0] == 2:
        return Result("", "", "wrong_answer", f"two readers at once answered {codes}: "
                                              + "; ".join(first_line(a["stderr"] or a["stdout"]) for a in answers))
    return Result("", "", "ok", f"both exit {codes[0]}")


def _subprocess_result(proc_stderr: str, rc: int | None) -> Result:
    if rc is None:
        return Result("", "", "hang", "no exit before the timeout")
    if "Traceback" in proc_stderr or "Exception ignored" in proc_stderr or rc == 70:
        return Result("", "", "traceback", f"exit {rc}: {first_line(proc_stderr)}")
    return Result("", "", "ok", f"exit {rc}, stderr {first_line(proc_stderr)!r}")


def _closed_stdout(ctx: Context, args: list[str]) -> Result:
    """`bitguard compare A B` writing into a pipe whose reader is gone (what `| head` leaves)."""
    r, w = os.pipe()
    os.close(r)
    proc = subprocess.Popen([sys.executable, "-m", "bitguard", "compare", *args], stdout=w, stderr=subprocess.PIPE,
                            text=True, cwd=ctx.cwd)
    os.close(w)
    try:
        _, err = proc.communicate(timeout=ctx.process_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return _subprocess_result("", None)
    return _subprocess_result(err, proc.returncode)


def _head(ctx: Context, args: list[str]) -> Result:
    """The shell line itself: `bitguard compare A B | head -1`, stderr of bitguard kept."""
    cmd = (f"{shlex.quote(sys.executable)} -m bitguard compare {' '.join(map(shlex.quote, args))} 2>head.err "
           f"| head -1; echo ${{PIPESTATUS[0]}} > head.rc")
    try:
        subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=ctx.process_timeout, cwd=ctx.cwd)
    except subprocess.TimeoutExpired:
        return _subprocess_result("", None)
    return _subprocess_result((ctx.cwd / "head.err").read_text(), int((ctx.cwd / "head.rc").read_text()))
