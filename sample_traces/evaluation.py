"""Fault-localisation evaluation: record every scenario, compare, score, print the tables.

`bitguard eval` runs this. For each scenario (scenarios.py) it records the reference and the
suspect (recordings.py), compares them, and scores the first divergence against the scenario's
true root cause: `exact` (the pivot is the faulty boundary, or the expected first consumer of
a fault that sits between boundaries), `first-consumer` (a first observed consumer of a
boundary-level fault), `wrong` (anywhere else), `missed` (no divergence); a benign pair is
`accepted` or a `false alarm`. Beside each verdict it reports when a loss-curve watcher
(relative loss difference above 1e-3) would first notice, from longer plain runs of both
scripts, whether a rerun of the suspect gives the same verdict, and the time taken.

`--ablations` scores the same pairs under the analysis options of `compare` (XOR digest
alone, a scalar-sum fingerprint, a 1e-3 tolerance on full tensors, a few probes) and under
recordings made without determinism controls, in one table. Recordings are kept under
`--out` and reused when their command matches (`--fresh` records again).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bitguard.sample_traces.recordings import Job, Outcome, run_jobs
from bitguard.sample_traces.scenarios import Scenario, Site, get

LOSS_RTOL = 1e-3  # the loss watcher notices a step whose losses differ by more than this, relatively
WATCH_STEPS = 100  # steps of the plain runs the loss watcher reads
FAULT_RESULTS = ("exact", "first-consumer", "wrong", "missed")
BENIGN_RESULTS = ("accepted", "false alarm")


@dataclass(frozen=True)
class Method:
    name: str  # column name in the ablation table
    label: str  # what it is, in words
    recording: str  # which recordings it reads: plain | dump | nodet | unseeded | nodet-unseeded
    fingerprint: str = "xor+pos"  # compare(fingerprint=...)
    few_probes: bool = False  # compare(probes=scenario.probes)


METHODS = (
    Method("full", "bitguard: xor+pos digests, determinism controls, every boundary", "dump"),
    Method("xor", "the XOR digest alone (compare(fingerprint='xor'))", "dump", fingerprint="xor"),
    Method("sum", "scalar sum of each tensor in float64, compared exactly (fingerprint='sum')", "dump",
           fingerprint="sum"),
    Method("tol-1e-3", "full tensors compared with allclose(rtol=1e-3) (fingerprint='tolerance')", "dump",
           fingerprint="tolerance"),
    Method("no-det", "recorded with --no-determinism (the scripts still seed themselves)", "nodet"),
    Method("unseeded", "the scripts run with --no-seed; bitguard's determinism controls seed them", "unseeded"),
    Method("no-det+unseeded", "--no-determinism and --no-seed: nobody seeds the model's initialisation",
           "nodet-unseeded"),
    Method("few-probes", "only the root module (data, forward, backward) and the output head's parameter "
           "(compare(probes=...))", "dump", few_probes=True),
)


# -- runs -----------------------------------------------------------------------------------
def _job(script: str, args: tuple[str, ...], recording: str, runs: Path, rerun: bool = False) -> Job:
    if recording in ("unseeded", "nodet-unseeded"):
        args = (*args, "--no-seed")
    determinism = recording not in ("nodet", "nodet-unseeded")
    dump = recording == "dump"
    key = hashlib.sha1(json.dumps([script, args, determinism, dump]).encode()).hexdigest()[:10]
    name = f"{Path(script).stem}-{recording}-{key}" + ("-rerun" if rerun else "")
    return Job(script, args, str(runs / name), determinism=determinism, dump=dump)


@dataclass(frozen=True)
class Pair:
    scenario: Scenario
    recording: str
    reference: Job
    suspect: Job
    suspect_rerun: Job | None = None
    reference_rerun: Job | None = None


def pairs(scenarios: list[Scenario], recording: str, runs: Path, reruns: bool) -> list[Pair]:
    out = []
    for s in scenarios:
        ref, sus = (_job(s.script, a, recording, runs) for a in (s.reference, s.suspect))
        extra = {}
        if reruns:
            extra = {"suspect_rerun": _job(s.script, s.suspect, recording, runs, rerun=True),
                     "reference_rerun": _job(s.script, s.reference, recording, runs, rerun=True)}
        out.append(Pair(s, recording, ref, sus, **extra))
    return out


def _distinct(jobs: list[Job]) -> list[Job]:
    return list(dict.fromkeys(jobs))


# -- comparing and scoring ------------------------------------------------------------------
def pivot_summary(first_divergence: dict | None) -> dict | None:
    fd = first_divergence
    if fd is None:
        return None
    return {"step": fd["step"], "phase": fd["phase"], "kind": fd["kind"], "boundary": fd["boundary"],
            "blame": fd["blame"], "fault_class": fd["fault_class"],
            "window": (fd["blame_window"] or {}).get("module")}


def compare_summary(a: str, b: str, rules: str | None = None, fingerprint: str = "xor+pos",
                    probes: list[str] | None = None) -> dict:
    """Compare two run directories; the parts of the report the evaluation scores (picklable)."""
    from bitguard.backend.compare import compare

    t0 = time.perf_counter()
    d = compare(a, b, rules=rules, fingerprint=fingerprint, probes=probes).to_dict()
    al = d["alignment"]
    return {"verdict": d["verdict"], "pivot": pivot_summary(d["first_divergence"]),
            "unallowed_gaps": al["gaps_a"] + al["gaps_b"] - al["allowed_gaps"],
            "seconds": time.perf_counter() - t0}


def _compare_star(kwargs: dict) -> dict:
    return compare_summary(**kwargs)


def compare_many(requests: list[dict], workers: int = 2) -> list[dict]:
    """compare_summary(**request) for each request, on `workers` fresh processes."""
    if workers <= 1 or len(requests) <= 1:
        return [compare_summary(**r) for r in requests]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_compare_star, requests))


def score(s: Scenario, summary: dict) -> str:
    """exact | first-consumer | wrong | missed for a fault; accepted | false alarm for a benign pair."""
    p = summary["pivot"]
    if s.expected is None:
        return "accepted" if p is None and summary["unallowed_gaps"] == 0 else "false alarm"
    if p is None:
        return "missed"
    e = s.expected
    site = Site(p["step"], p["phase"], p["boundary"])
    if site == e.site and p["kind"] == e.kind and p["blame"] == e.blame and p["fault_class"] == e.fault_class:
        return s.located
    if site in s.consumers:
        return "first-consumer"
    return "wrong"


def localized(result: str) -> bool:
    return result in ("exact", "first-consumer", "accepted")


def loss_noticed(reference: list[float], suspect: list[float], rtol: float = LOSS_RTOL) -> int | None:
    """First step whose losses differ by more than `rtol` relatively (None: never, in these steps)."""
    for step, (a, b) in enumerate(zip(reference, suspect)):
        if abs(b - a) > rtol * abs(a):
            return step
    return None


def loss_gap(reference: list[float], suspect: list[float]) -> float:
    """The largest relative loss difference over the steps both runs have."""
    return max((abs(b - a) / abs(a) for a, b in zip(reference, suspect) if a), default=0.0)


def fmt_pivot(p: dict | None) -> str:
    return "—" if p is None else f"{p['step']} {p['phase']} {p['boundary']}"


def fmt_expected(s: Scenario) -> str:
    e = s.expected
    return "identical (rules)" if e is None else f"{e.step} {e.phase} {e.boundary}"


# -- the evaluation ---------------------------------------------------------------------------
@dataclass
class Row:
    scenario: str
    expected: str
    result: str
    pivot: dict | None
    blame: str
    rerun: str = ""
    loss_step: int | None = None
    loss_note: str = ""
    record_s: float | None = None  # both runs' wall time, imports excluded (None: reused recordings)
    compare_s: float = 0.0
    commands: list[str] = field(default_factory=list)


def _check_recorded(outcomes: list[Outcome]) -> None:
    failed = [o for o in outcomes if o.exit_status != 0]
    if failed:
        from bitguard.errors import BitguardError

        o = failed[0]
        raise BitguardError(f"recording failed (exit {o.exit_status}): {o.job.shell()}\n{o.log}\n"
                            f"see {o.job.out}.log; fix the script or the scenario, then run bitguard eval again")


def main_table(scenarios: list[Scenario], out: Path, workers: int = 2, reruns: bool = True,
               watch_steps: int = WATCH_STEPS, reuse: bool = True) -> list[Row]:
    runs = out / "runs"
    ps = pairs(scenarios, "plain", runs, reruns)
    jobs = _distinct([j for p in ps for j in (p.reference, p.suspect, p.suspect_rerun, p.reference_rerun) if j])
    watch = {}
    if watch_steps:
        for p in ps:
            for side in (p.reference, p.suspect):
                key = side.out
                if key not in watch:
                    folder = out / "losses" / Path(side.out).name
                    args = (*side.args, "--steps", str(watch_steps), "--losses", str(folder / "losses.json"))
                    watch[key] = Job(side.script, args, str(folder), record=False)
    everything = jobs + list(watch.values())
    outcomes = run_jobs(everything, workers=workers, reuse=reuse)
    _check_recorded(outcomes)
    seconds = {job.out: o.seconds for job, o in zip(everything, outcomes)}
    reused = {job.out for job, o in zip(everything, outcomes) if o.reused}
    requests = []
    for p in ps:
        rules = str(p.scenario.rules_path) if p.scenario.rules else None
        requests.append({"a": p.reference.out, "b": p.suspect.out, "rules": rules})
        if reruns:
            requests += [{"a": p.reference.out, "b": p.suspect_rerun.out, "rules": rules},
                         {"a": p.suspect.out, "b": p.suspect_rerun.out, "rules": rules},
                         {"a": p.reference.out, "b": p.reference_rerun.out, "rules": rules}]
    summaries = iter(compare_many(requests, workers))
    rows = []
    for p in ps:
        s = p.scenario
        main = next(summaries)
        result = score(s, main)
        rerun = ""
        if reruns:
            again, suspects, references = next(summaries), next(summaries), next(summaries)
            same = again["pivot"] == main["pivot"]
            suspects_differ = suspects["verdict"] != "identical"
            ok = same and references["verdict"] == "identical" and suspects_differ == s.reruns_differ
            rerun = ("same verdict" if same else "VERDICT CHANGED") + ("; suspect reruns differ" if suspects_differ
                                                                       else "")
            if not ok and same:
                rerun += " (UNEXPECTED)"
        step, note = None, "not run"
        if watch_steps:
            ref_l = _losses(watch[p.reference.out])
            sus_l = _losses(watch[p.suspect.out])
            step = loss_noticed(ref_l, sus_l)
            note = (f"step {step}" if step is not None
                    else f"never in {watch_steps} (max {loss_gap(ref_l, sus_l):.0e})")
        p_ = main["pivot"]
        record_s = None if {p.reference.out, p.suspect.out} & reused else seconds[p.reference.out] + seconds[p.suspect.out]
        rows.append(Row(s.name, fmt_expected(s), result, p_, "—" if p_ is None else f"{p_['blame']}/{p_['fault_class']}",
                        rerun, step, note, record_s, main["seconds"], [p.reference.shell(), p.suspect.shell()]))
    return rows


def _losses(job: Job) -> list[float]:
    return json.loads((Path(job.out) / "losses.json").read_text())["losses"]


def ablation_table(scenarios: list[Scenario], out: Path, workers: int = 2, reuse: bool = True,
                   methods: tuple[Method, ...] = METHODS) -> dict[str, dict[str, dict]]:
    """{method: {scenario: {"result", "pivot", ...}}} for every method and scenario."""
    runs = out / "runs"
    by_recording = {m.recording: pairs(scenarios, m.recording, runs, reruns=False) for m in methods}
    jobs = _distinct([j for ps in by_recording.values() for p in ps for j in (p.reference, p.suspect)])
    _check_recorded(run_jobs(jobs, workers=workers, reuse=reuse))
    requests, keys = [], []
    for m in methods:
        for p in by_recording[m.recording]:
            s = p.scenario
            requests.append({"a": p.reference.out, "b": p.suspect.out,
                             "rules": str(s.rules_path) if s.rules else None, "fingerprint": m.fingerprint,
                             "probes": list(s.probes) if m.few_probes else None})
            keys.append((m, s))
    table: dict[str, dict[str, dict]] = {m.name: {} for m in methods}
    for (m, s), summary in zip(keys, compare_many(requests, workers)):
        table[m.name][s.name] = {**summary, "result": score(s, summary)}
    return table


# -- printing ---------------------------------------------------------------------------------
def render_main(rows: list[Row]) -> str:
    head = ("scenario", "expected pivot", "pivot found", "result", "blame", "reruns", "loss watcher",
            "record s", "compare s")
    body = [(r.scenario, r.expected, fmt_pivot(r.pivot), r.result, r.blame, r.rerun, r.loss_note,
             "reused" if r.record_s is None else f"{r.record_s:.1f}", f"{r.compare_s:.2f}") for r in rows]
    faults = [r for r in rows if r.result in FAULT_RESULTS]
    benign = [r for r in rows if r.result in BENIGN_RESULTS]
    lines = _markdown(head, body)
    lines.append("")
    lines.append(f"faults localized {sum(localized(r.result) for r in faults)}/{len(faults)} "
                 f"(exact {sum(r.result == 'exact' for r in faults)}, "
                 f"first consumer {sum(r.result == 'first-consumer' for r in faults)}); "
                 f"benign pairs accepted {sum(r.result == 'accepted' for r in benign)}/{len(benign)}")
    return "\n".join(lines)


SHORT = {"exact": "exact", "first-consumer": "1st-cons", "wrong": "WRONG", "missed": "MISSED",
         "accepted": "ok", "false alarm": "FALSE ALARM"}


def render_ablations(table: dict[str, dict[str, dict]], scenarios: list[Scenario],
                     methods: tuple[Method, ...] = METHODS) -> str:
    head = ("scenario", *[m.name for m in methods])
    body = [(s.name, *[SHORT[table[m.name][s.name]["result"]] for m in methods]) for s in scenarios]
    faults = [s for s in scenarios if s.expected is not None]
    benign = [s for s in scenarios if s.expected is None]

    def count(m, pred, group):
        return f"{sum(pred(table[m.name][s.name]['result']) for s in group)}/{len(group)}"

    body.append(("**faults localized**", *[f"**{count(m, localized, faults)}**" for m in methods]))
    body.append(("exact", *[count(m, lambda r: r == "exact", faults) for m in methods]))
    body.append(("benign accepted", *[count(m, lambda r: r == "accepted", benign) for m in methods]))
    lines = _markdown(head, body)
    lines.append("")
    lines += [f"- `{m.name}`: {m.label}" for m in methods]
    return "\n".join(lines)


def _markdown(head: tuple, body: list[tuple]) -> list[str]:
    cells = [tuple(str(c) for c in row) for row in [head, *body]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *[line(r) for r in cells[1:]]]


def main(args) -> int:
    """`bitguard eval`: args has scenarios, out, json, ablations, watch_steps, workers, reruns, fresh."""
    scenarios = get(args.scenarios)
    out = Path(args.out)
    if args.fresh and out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    rows = main_table(scenarios, out, args.workers, args.reruns, args.watch_steps, reuse=not args.fresh)
    ablations = ablation_table(scenarios, out, args.workers, reuse=not args.fresh) if args.ablations else None
    elapsed = time.perf_counter() - t0
    if args.json:
        doc = {"schema": "bitguard.eval/1", "rows": [asdict(r) for r in rows], "seconds": elapsed,
               "loss_rtol": LOSS_RTOL, "watch_steps": args.watch_steps,
               "scenarios": {s.name: asdict(s) for s in scenarios}}
        if ablations is not None:
            doc["ablations"] = ablations
            doc["methods"] = [asdict(m) for m in METHODS]
        print(json.dumps(doc, indent=2))
    else:
        print(render_main(rows))
        if ablations is not None:
            print()
            print(render_ablations(ablations, scenarios))
        print(f"\n{len(scenarios)} scenarios in {elapsed:.0f} s; recordings under {out / 'runs'}")
    expected = all(localized(r.result) and "UNEXPECTED" not in r.rerun and "CHANGED" not in r.rerun for r in rows)
    return 0 if expected else 1
