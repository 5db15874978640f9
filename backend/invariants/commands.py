"""`bitguard invariants infer|check`: the command lines over infer.py and check.py, and their text.

infer: `bitguard invariants infer RUN [RUN ...] -o inv.json` writes a `bitguard.invariants/1`
file and prints how many invariants each template gave and how many candidates were dropped.
check: `bitguard invariants check RUN --invariants inv.json [--json]` prints the violations (or
the `bitguard.invariant-check/1` document); exit 0 none violated, 1 violated, 2 bad input (a run
without API events included: it is never a pass), 3 inconclusive (no invariant applied to the
run: nothing was checked). bitguard/cli.py registers these with one call (`add_commands`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from bitguard.errors import BadInput

EXIT = {"clean": 0, "violated": 1, "inconclusive": 3}


def cmd_infer(args) -> int:
    from bitguard.backend.invariants.infer import infer_runs

    doc = infer_runs(args.runs)
    text = json.dumps(doc, indent=1, sort_keys=False) + "\n"
    try:
        Path(args.output).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot write {args.output}: {exc.strerror or exc}; give another -o") from None
    by_template = Counter(i["template"] for i in doc["invariants"])
    print(f"wrote {args.output}: {len(doc['invariants'])} invariants from {len(args.runs)} clean run(s) "
          f"({', '.join(f'{t} {n}' for t, n in by_template.items()) or 'none'}); {len(doc['dropped'])} candidates "
          f"dropped (failed in a clean run with no precondition that separates, or too little support)")
    return 0


def verdict(report: dict) -> str:
    if report["violations"]:
        return "violated"
    return "clean" if report["applied"] else "inconclusive"


def check(run, invariants_path) -> dict:
    """The check document of `run` against the invariants file at `invariants_path`."""
    from bitguard.backend.invariants.check import load_invariants

    return check_doc(run, load_invariants(invariants_path))


def check_doc(run, invariants) -> dict:
    """The check document of `run`, with its verdict and what keeps it from being complete."""
    from bitguard.backend.ingest import open_run
    from bitguard.backend.invariants.check import check_facts
    from bitguard.backend.invariants.facts import facts_from_run

    info = open_run(run)
    facts = facts_from_run(info)
    report = check_facts(facts, invariants, str(run))
    notes = []
    silent = sorted(set(info.ranks) - set(facts))
    if silent:
        notes.append(f"rank(s) {', '.join(map(str, silent))} recorded no API events: not checked")
    why = info.incomplete_reason()
    if why:
        notes.append(f"the run is incomplete ({why}): steps it did not record were not checked")
    for rank, damage in sorted((info.damage or {}).items()):
        notes.append(f"rank {rank} is damaged ({damage.get('reason')}): its later steps may be missing")
    if not report["applied"]:
        notes.append("no invariant applied to this run (every one skipped: see skipped): nothing was checked")
    report["notes"] = notes
    report["verdict"] = verdict(report)
    return report


def render(report: dict) -> str:
    lines = [f"{report['run']}: {report['verdict']}: {len(report['violations'])} violation(s) of "
             f"{len(report['violated'])} invariant(s); {len(report['applied'])} of {report['invariants']} "
             f"invariants applied, {len(report['skipped'])} skipped"]
    for v in report["violations"][:200]:
        where = "every rank" if v["rank"] is None else f"rank {v['rank']}"
        lines.append(f"  step {v['step']} {where}: {v['message']}")
    if len(report["violations"]) > 200:
        lines.append(f"  ... {len(report['violations']) - 200} more (--json for all)")
    skipped = Counter(s["why"].split(":")[0] for s in report["skipped"])
    if skipped:
        lines.append("  skipped: " + ", ".join(f"{n} ({why})" for why, n in skipped.items()))
    lines += [f"  note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines)


def cmd_check(args) -> int:
    report = check(args.run, args.invariants)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return EXIT[report["verdict"]]


def add_commands(sub) -> None:
    """Register `bitguard invariants infer|check` on the CLI's subparsers."""
    what = "training invariants: infer them from clean runs, check any run against them"
    p = sub.add_parser("invariants", help=what, description=what)
    inv = p.add_subparsers(dest="invariants_cmd", required=True)
    what = "infer invariants with preconditions from recorded clean runs; write a bitguard.invariants/1 file"
    q = inv.add_parser("infer", help=what, description=what)
    q.add_argument("runs", nargs="+", metavar="RUN", help="run directories of clean trainings")
    q.add_argument("-o", "--output", required=True, help="the invariants file to write (JSON)")
    q.set_defaults(func=cmd_infer)
    what = ("check a run against an invariants file; exit 0 none violated, 1 violated, 2 bad input, "
            "3 inconclusive (no invariant applied)")
    q = inv.add_parser("check", help=what, description=what)
    q.add_argument("run", help="run directory to check")
    q.add_argument("--invariants", required=True, help="file written by 'bitguard invariants infer'")
    q.add_argument("--json", action="store_true", help="print the bitguard.invariant-check/1 JSON document")
    q.set_defaults(func=cmd_check)
