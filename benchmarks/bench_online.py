"""Online mode on the bench-size GPT (bench_recording.build(): 6 layers, width 256, sequence 128,
batch 8, vocabulary 512): the figures of docs/ONLINE.md.

    python benchmarks/bench_online.py clean --steps 500            # clean run: alerts and warnings
    python benchmarks/bench_online.py faults --warmup 30 --steps 16  # injected faults at the default budget
    python benchmarks/bench_online.py faults --budget 1 --warmup 8 --steps 8  # the check's own sensitivity
    python benchmarks/bench_online.py overhead --rounds 8 --steps 6  # plain against online, alternated
    python benchmarks/bench_online.py paired --rounds 60 --block 3   # observed against paused steps, one recording
    python benchmarks/bench_online.py coverage                     # what share of a step's FLOPs each sensor sees

Every subcommand trains in this process, each online run under `bitguard.record(DIR,
mode="online")`, on fresh random batches (a generator of its own, seed 0). Faults come from the SDC
simulator (collectors/online/simulator.py, BITGUARD_SDC_SIMULATE, set for that run only) on one
Linear, `blocks.2.mlp.fc`: bit flips at chosen positions, or perturbations of r × the operator's
median clean checksum gap, one element per call by default (a fault event: one line of the
simulator's log). An event is detected when the checksum sensor raises an alert on that module at
that step and call whose evidence names the event's element (row, column); the loss-spike watcher
(guards.py's SpikeWatcher over the step losses) detects it when it flags that step or the next. `--json` prints
the document; the text is what docs/ONLINE.md shows. The machine is shared: timings are noisy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "sample_traces"))

from roundstats import bootstrap_95, median_interval, ratio_of_means  # noqa: E402,F401 - public here too

MODULE = "blocks.2.mlp.fc"
BITS = {"sign": [31], "exponent": [30, 27, 23], "high mantissa": [22, 20], "low mantissa": [8, 0]}
SCALES = [1.0, 10.0, 100.0, 1e4]


def batches(seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, 512, (8, 129), generator=gen)


def one_step(model, opt, data) -> float:
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    logits = model(data[:, :-1])
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), data[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return float(loss)


def online_run(out: Path, steps: int, budget: float, simulate: dict | None = None) -> dict:
    """One online recording of the bench GPT: its losses, step times and alerts document."""
    import bitguard
    from bench_recording import build

    from bitguard.backend.alerts import read_alerts

    model, opt, _ = build()
    data = batches()
    if simulate is not None:
        os.environ["BITGUARD_SDC_SIMULATE"] = json.dumps(simulate)
    losses, times = [], []
    try:
        with bitguard.record(out, mode="online", budget=budget):
            for _ in range(steps):
                t = time.perf_counter()
                losses.append(one_step(model, opt, next(data)))
                times.append(time.perf_counter() - t)
    finally:
        os.environ.pop("BITGUARD_SDC_SIMULATE", None)
    from bitguard import db

    con = db.connect(out / "rank-0.duckdb", read_only=True)
    try:  # the injected module's forward calls seen and checked, per step (the sampling half of detection)
        checked = {s: (c, k) for s, c, k in con.execute(
            "SELECT step, sum(calls), sum(checked) FROM sensor_stats WHERE sensor = 'checksum' AND op = ? "
            "GROUP BY step", [f"linear:{MODULE}"]).fetchall()}
    finally:
        con.close()
    injections = []
    log = out / "sdc-injections-rank-0.jsonl"
    if log.exists():
        injections = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return {"losses": losses, "times": times, "alerts": read_alerts(out).to_dict(), "injections": injections,
            "checked_calls": checked}


# -- clean ---------------------------------------------------------------------------------------

def clean(args) -> dict:
    if args.out:  # kept: `bitguard alerts OUT` reads it, also while it runs or after it was stopped
        got = online_run(Path(args.out), args.steps, args.budget)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            got = online_run(Path(tmp) / "clean", args.steps, args.budget)
    doc = got["alerts"]
    by = {}
    for a in doc["alerts"]:
        by.setdefault(f"{a['sensor']}:{a['state']}", 0)
        by[f"{a['sensor']}:{a['state']}"] += 1
    return {"steps": args.steps, "budget": args.budget, "counts": doc["counts"], "by_sensor_state": by,
            "coverage": [{k: s[k] for k in ("sensor", "steps", "calls", "checked", "flops_seen", "flops_checked",
                                              "seconds")} for s in doc["coverage"]],
            "verifier": doc["verifier"], "median_step_s": statistics.median(got["times"][1:]),
            "loss_first_last": [got["losses"][0], got["losses"][-1]],
            "alerts": [{k: a[k] for k in ("alert_id", "step", "sensor", "boundary", "op", "state")}
                       | {"summary": (a["evidence"] or {}).get("summary")} for a in doc["alerts"]][:50]}


# -- faults --------------------------------------------------------------------------------------

def score(got: dict, first: int) -> dict:
    """Detection of each injected fault event (one corrupted element of one call: the simulator's
    log line) by the checksum sensor and by the loss-spike watcher. The checksum detects an event
    when an alert on the module's forward (op linear), at the event's step and call, names the
    event's element (row, column) in its evidence; it confirms it when that alert's verdict is
    confirmed. The watcher detects it when it flags that step or the next. Events after the loss
    went non-finite are not scored (every activation is NaN from there on: counted apart)."""
    from bitguard.collectors.online.guards import SpikeWatcher

    alerts = [a for a in got["alerts"]["alerts"] if a["sensor"] == "checksum" and a["boundary"] == MODULE
              and a["op"] == "linear"]
    by_step = {}
    for a in alerts:
        by_step.setdefault(a["step"], []).append(a)
    watcher = SpikeWatcher(min_history=5)
    flagged = {s for s, v in enumerate(got["losses"]) if watcher.observe(v) is not None}
    nonfinite = next((s for s, v in enumerate(got["losses"]) if not math.isfinite(v)), None)
    injections = [i for i in got["injections"] if i["step"] >= first]
    scored = [i for i in injections if nonfinite is None or i["step"] <= nonfinite]
    detected, confirmed, loss_detected, alert_lat, confirm_lat, states, hit_steps = 0, 0, 0, [], [], {}, []
    for inj in scored:
        hit = next((a for a in by_step.get(inj["step"], []) if (a["evidence"] or {}).get("call") == inj["call"]
                    and [inj["row"], inj["col"]] in (a["evidence"] or {}).get("elements", [])), None)
        if hit is not None:
            detected += 1
            hit_steps.append(inj["step"])
            alert_lat.append(hit["step"] - inj["step"])
            states[hit["state"]] = states.get(hit["state"], 0) + 1
            if hit["state"] == "confirmed":
                confirmed += 1
                if hit["verdict"] and hit["verdict"]["latency_steps"] is not None:
                    confirm_lat.append(hit["step"] - inj["step"] + hit["verdict"]["latency_steps"])
        if inj["step"] in flagged or inj["step"] + 1 in flagged:
            loss_detected += 1
    n = len(scored)
    checksum = next((c for c in got["alerts"]["coverage"] if c["sensor"] == "checksum"), {"ops": []})
    op = next((o for o in checksum["ops"] if o["op"] == f"linear:{MODULE}"), {})
    clean_steps = set(range(len(got["losses"]))) - {i["step"] for i in got["injections"]}
    false_alerts = [a for a in got["alerts"]["alerts"] if a["sensor"] == "checksum" and a["step"] in clean_steps
                    and a["state"] == "confirmed"]
    faulty_steps = sorted({i["step"] for i in injections})
    # the faulty calls the sampling checked (per step: the module's checked calls, at most its faulty ones)
    per_step = {}
    for i in scored:
        per_step[i["step"]] = per_step.get(i["step"], 0) + 1
    checked = sum(min(n_inj, int(got.get("checked_calls", {}).get(step, (0, 0))[1])) for step, n_inj in per_step.items())
    return {"injections": n, "not_scored_after_nan": len(injections) - n, "detected": detected,
            "rate": detected / n if n else None, "confirmed": confirmed,
            "sampling_rate": op.get("rate"),  # the module's mean call-sampling rate over the run
            "faulty_calls_checked": checked if "checked_calls" in got else None,
            "detected_of_checked": detected / checked if checked and "checked_calls" in got else None,
            "verdicts": states, "alert_latency_steps": _spread(alert_lat),
            "confirm_latency_steps": _spread(confirm_lat),
            # steps from the fault's first faulty step to the first detected event (an intermittent fault on a device)
            "steps_to_first_alert": (min(hit_steps) - faulty_steps[0]) if hit_steps and faulty_steps else None,
            "loss_watcher_detected": loss_detected, "loss_watcher_rate": loss_detected / n if n else None,
            "loss_watcher_steps_to_first": next((s - faulty_steps[0] for s in sorted(flagged)
                                                 if faulty_steps and s >= faulty_steps[0]), None),
            "confirmed_on_clean_steps": len(false_alerts),
            "nonfinite_loss_from_step": nonfinite}


def _spread(values: list[int]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "max": max(values), "n": len(values)}


def faults(args) -> dict:
    settings = [(f"bit {b} ({field})", {"bit": b}) for field, bits in BITS.items() for b in bits]
    settings += [(f"r = {r:g}", {"scale": r}) for r in SCALES]
    if args.only:
        # (a label matches when it contains the string, or when it is the string itself: "r = 10" is not "r = 100")
        settings = [s for s in settings if any(o.strip() == s[0].split(" (")[0] if o.startswith("r = ") else o in s[0]
                                               for o in args.only)]
    out = {"module": MODULE, "warmup": args.warmup, "steps": args.steps, "rows_per_step": args.rows,
           "budget": args.budget, "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, fault) in enumerate(settings):
            # (hash_range: the corrupted row is the first whose input hash falls in it, a different row each call)
            spec = {"module": MODULE, "from_step": args.warmup, "rows": args.rows, "seed": i,
                    "hash_range": [0.5, 0.6], **fault}
            got = online_run(Path(tmp) / f"fault-{i}", args.warmup + args.steps, args.budget, spec)
            out["settings"][label] = score(got, args.warmup)
            print(f"{label}: {json.dumps(out['settings'][label])}", file=sys.stderr, flush=True)
    return out


# -- overhead ------------------------------------------------------------------------------------

def overhead(args) -> dict:
    """Plain and online rounds alternated in one process (the order turns each round); each round's
    median step time against the same round's plain one; the median of those ratios."""
    import bitguard
    from bench_recording import build

    model, opt, _ = build()
    data = batches()
    for _ in range(2):
        one_step(model, opt, next(data))
    times = {"plain": [], "online": []}
    cpu = {"plain": [], "online": []}  # the process's CPU time a step (every thread: the writer's and the verifier's too)
    ratios, cpu_ratios, loads, rounds = [], [], [], []

    def steps() -> tuple[list, list]:
        wall, used = [], []
        for _ in range(args.steps):
            t, c = time.perf_counter(), time.process_time()
            one_step(model, opt, next(data))
            wall.append(time.perf_counter() - t)
            used.append(time.process_time() - c)
        return wall[1:], used[1:]  # the first step of a round pays the round's start

    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])  # (the machine's 1-minute load average as the round starts)
            walls, cpus = {}, {}
            for mode in (("plain", "online") if r % 2 == 0 else ("online", "plain")):
                if mode == "plain":
                    walls[mode], cpus[mode] = steps()
                else:
                    with bitguard.record(Path(tmp) / f"online-{r}", mode="online", budget=args.budget):
                        walls[mode], cpus[mode] = steps()
                times[mode] += walls[mode]
                cpu[mode] += cpus[mode]
            ratios.append(statistics.median(walls["online"]) / statistics.median(walls["plain"]))
            cpu_ratios.append(statistics.median(cpus["online"]) / statistics.median(cpus["plain"]))
            rounds.append(walls)
    return {"rounds": args.rounds, "steps": args.steps, "budget": args.budget,
            "median_step_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": statistics.median(ratios), "round_ratios": ratios, "ratio_interval": median_interval(ratios),
            "pooled_ratio": statistics.median(times["online"]) / statistics.median(times["plain"]),
            "mean_ratio": ratio_of_means(rounds, arms=("online", "plain")), "rounds_steps": rounds,
            # CPU time is steadier than wall time on a loaded machine (it leaves out the waits for a core), and counts
            # the store's writer and the verifier threads in full (on spare cores they would not lengthen a step)
            "median_step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
            "cpu_ratio": statistics.median(cpu_ratios), "cpu_round_ratios": cpu_ratios,
            "load_average": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}}


def paired(args) -> dict:
    """Observed and paused steps alternated inside one long online recording: after --warmup
    observed steps (the controller's start: rates, costs and thresholds learned), rounds of two
    blocks of --block steps, one observed and one paused (OnlineMonitor.pause(): every hook of
    bitguard returns at its first test of a flag; resume() restarts the budget's step clock), the
    order turning each round. The first step of each block is dropped (it follows the switch: the
    previous block's writer work and verifier tasks, the caches). A round's ratio is its median
    observed step over its median paused step; the figure is the median of the round ratios. This
    measures the steady state of a long recording at step-to-step distance, where `overhead`
    measures each half's first steps with a fresh recording at rounds of seconds; what a paused step
    still pays (the wrappers' flag tests) is measured apart (`paused_wrapper`) and is not in the ratio.
    `charged_share`: what the budget controller charged each measured observed step (its checks times
    MARGINAL and the fixed cost) over the training's own time, to hold against the measured ratio."""
    import bitguard
    from bench_recording import build

    if args.block < 2:
        raise SystemExit("--block must be at least 2: the first step of each block is dropped")
    model, opt, _ = build()
    data = batches()
    for _ in range(2):
        one_step(model, opt, next(data))
    times = {"observed": [], "paused": []}
    ratios, loads, rounds = [], [], []
    charged = []  # the controller's own figure for each measured observed step: what it charged over the training's time

    def block(observed: bool) -> list[float]:
        wall = []
        for i in range(args.block):
            t = time.perf_counter()
            one_step(model, opt, next(data))
            wall.append(time.perf_counter() - t)
            if observed and i and monitor.budget.overhead is not None:
                charged.append(monitor.budget.overhead)
        return wall[1:]

    with tempfile.TemporaryDirectory() as tmp:
        with bitguard.record(Path(tmp) / "paired", mode="online", budget=args.budget) as rec:
            monitor = rec.monitor
            for _ in range(args.warmup):
                one_step(model, opt, next(data))
            for r in range(args.rounds):
                loads.append(os.getloadavg()[0])
                steps = {}
                for arm in (("observed", "paused") if r % 2 == 0 else ("paused", "observed")):
                    if arm == "paused":
                        monitor.pause()
                    steps[arm] = block(arm == "observed")
                    if arm == "paused":
                        monitor.resume()
                    times[arm] += steps[arm]
                ratios.append(statistics.median(steps["observed"]) / statistics.median(steps["paused"]))
                rounds.append(steps)
            wrapper = _paused_wrapper_cost(monitor)
        from bitguard.backend.alerts import read_alerts

        calls_per_step = _calls_per_step(Path(tmp) / "paired")
        alerts = read_alerts(Path(tmp) / "paired").to_dict()
    step = statistics.median(times["paused"])
    return {"rounds": args.rounds, "block": args.block, "warmup": args.warmup, "budget": args.budget,
            "median_step_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": median_interval(ratios), "round_ratios": ratios,
            "pooled_ratio": statistics.median(times["observed"]) / step,
            # the training's time: the mean step, which the few steps a costly check falls on weigh in (a median leaves
            # them out); its interval resamples whole rounds
            "mean_ratio": ratio_of_means(rounds), "rounds_steps": rounds,
            "charged_share": {"median": statistics.median(charged), "mean": statistics.fmean(charged)} if charged else None,
            "paused_wrapper": {"per_call_s": wrapper, "calls_per_step": calls_per_step,
                               "share_of_step": wrapper * calls_per_step / step},
            "alerts": alerts["counts"],
            "load_average": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}}


def _calls_per_step(run: Path) -> float:
    """Forward calls of nn.Linear and the wrapped GEMM functions an observed step, from the checksum
    sensor's sensor_stats rows (what goes through a wrapper; the backward GEMMs are hooked per checked call)."""
    from bitguard import db

    con = db.connect(run / "rank-0.duckdb", read_only=True)
    try:
        calls, steps = con.execute(
            "SELECT sum(calls) FILTER (WHERE split_part(op, ':', 1) IN ('linear', 'matmul')), "
            "count(DISTINCT step) FILTER (WHERE op IS NULL) FROM sensor_stats WHERE sensor = 'checksum'").fetchone()
    finally:
        con.close()
    return (calls or 0) / max(1, steps or 0)


def _paused_wrapper_cost(monitor, n: int = 20_000) -> float:
    """Seconds a call of a wrapped function costs more while the monitor is paused than unwrapped:
    torch.mm on 1x1 tensors through the sensor's wrapper (paused) against the original."""
    import torch

    a = torch.ones(1, 1)
    wrapped = torch.mm
    original = getattr(wrapped, "__wrapped__", wrapped)

    def per_call(fn) -> float:
        best = math.inf
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn(a, a)
            best = min(best, (time.perf_counter() - t) / n)
        return best

    monitor.pause()
    try:
        return max(0.0, per_call(wrapped) - per_call(original))
    finally:
        monitor.resume()


# -- coverage ------------------------------------------------------------------------------------

def coverage(args) -> dict:
    """FLOPs of one training step (torch's FlopCounterMode: forward and backward) and what each
    sensor sees of them: the checksum sensor its Linear GEMMs (forward, dgrad, wgrad; from its own
    sensor_stats), the recompute sensor the forward of checkpointed regions (the bench GPT has none;
    the same model with every block checkpointed shows what it would see), the cross-rank sensor
    and the guards bytes, not FLOPs."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from bench_recording import build

    model, opt, _ = build()
    data = next(batches())
    with FlopCounterMode(display=False) as counter:
        one_step(model, opt, data)
    total = counter.get_total_flops()
    per_op = {str(k): v for k, v in counter.get_flop_counts().get("Global", {}).items()}
    with FlopCounterMode(display=False) as fwd:
        with torch.no_grad():
            for block in model.blocks:
                block(torch.randn(8, 128, 256))
    blocks_forward = fwd.get_total_flops()
    with tempfile.TemporaryDirectory() as tmp:
        got = online_run(Path(tmp) / "cov", args.steps, 1.0)
    checksum = next((c for c in got["alerts"]["coverage"] if c["sensor"] == "checksum"), None)
    steps = checksum["steps"] if checksum else 1
    params = sum(p.numel() for p in model.parameters())
    return {"step_flops": total, "flops_by_op": per_op,
            "checksum": {"flops_seen_per_step": checksum["flops_seen"] / steps if checksum else 0,
                         "share_seen": (checksum["flops_seen"] / steps / total) if checksum else 0,
                         "share_checked_at_budget_1": (checksum["flops_checked"] / steps / total) if checksum else 0,
                         "ops": len(checksum["ops"]) if checksum else 0},
            "recompute": {"share_if_every_block_checkpointed": blocks_forward / total, "share_bench_gpt": 0.0},
            "crossrank": {"bytes_per_step": 2 * 4 * params, "share": 0.0},
            "guard": {"share": 0.0}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("clean")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--budget", type=float, default=0.02)
    p.add_argument("--out", default=None, help="keep the online run here (default: a temporary folder)")
    p = sub.add_parser("faults")
    p.add_argument("--warmup", type=int, default=30, help="clean steps first (the checksum learns its thresholds)")
    p.add_argument("--steps", type=int, default=16, help="steps with injections after the warm-up")
    p.add_argument("--rows", type=int, default=1, help="elements corrupted per call (one per row): fault events")
    p.add_argument("--budget", type=float, default=0.02)
    p.add_argument("--only", nargs="*", default=None, help="settings whose label contains one of these")
    p = sub.add_parser("overhead")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--budget", type=float, default=0.02)
    p = sub.add_parser("paired")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--block", type=int, default=3, help="steps a block (its first is dropped)")
    p.add_argument("--warmup", type=int, default=24, help="observed steps before the first round")
    p.add_argument("--budget", type=float, default=0.02)
    p = sub.add_parser("coverage")
    p.add_argument("--steps", type=int, default=3)
    for p in sub.choices.values():
        p.add_argument("--json", action="store_true")
        p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (a shared machine: 1)")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    doc = {"clean": clean, "faults": faults, "overhead": overhead, "paired": paired, "coverage": coverage}[args.cmd](args)
    doc = {"schema": "bitguard.bench_online/1", "command": args.cmd, **doc}
    print(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
