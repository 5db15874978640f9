"""The fuzz family of the SIGKILL promise: a recording killed at a random point keeps every step
before the last one that ended.

README: "when step k ends, every event of the steps before it is durable". Each case records a
small training script that SIGKILLs itself at a point drawn from the seed (a step, and where in
it: before the forward, after the forward, after the backward, inside optimizer.step, after the
step ended), recorded in-process (the killed process is the recorder: its journal stays for the
next reader) or under the launcher (`-- python script.py`: the launcher folds it); some cases
sleep between steps so that a fold (every 5 s) happens before the kill. The steps the promise
covers must read back exactly as in a complete recording of the same script (same rows, same
digests: what a verdict rests on); else the case is data_lost. Comparing the killed run with the
complete one must say inconclusive (exit 3): identical is a false verdict; diverged, or a
refusal of the killed run, is a wrong answer. One more case compares a run while it is still
being recorded: never identical (a clean "still being written" refusal is fine), and the
recording must finish unharmed and then compare identical with the complete one.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from .harness import Context, Result, crashed, first_line

STEPS = 8
POINTS = ("before-forward", "after-forward", "after-backward", "in-optimizer-step", "after-step")
SCRIPT = """\
import os, signal, sys, time, torch
step_at, point = (os.environ.get("KILL_AT") or "-1:none").split(":")
step_at, pause = int(step_at), float(os.environ.get("PAUSE") or 0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def kill(here):
    if step == step_at and point == here:
        os.kill(os.getpid(), signal.SIGKILL)
def pre_step(*args):
    kill("in-optimizer-step")
opt.register_step_pre_hook(pre_step)
for step in range(%d):
    kill("before-forward")
    loss = model(torch.randn(4, 8)).pow(2).mean()
    kill("after-forward")
    loss.backward()
    kill("after-backward")
    opt.step()
    opt.zero_grad()
    kill("after-step")
    time.sleep(pause)
""" % STEPS


def _record(ctx: Context, out: Path, script: Path, launcher: bool, env: dict) -> subprocess.Popen:
    tail = [sys.executable, str(script)] if launcher else [str(script)]
    return subprocess.Popen([sys.executable, "-m", "bitguard", "record", "--out", str(out), "--", *tail],
                            cwd=ctx.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _by_step(read: dict) -> dict[int, list[str]]:
    steps: dict[int, list[str]] = {}
    for step, row in zip(read["steps"], read["events"]):
        steps.setdefault(step, []).append(row)
    return steps


def sigkill(ctx: Context, cases: int, seed: int, only: str | None = None) -> list[Result]:
    script = ctx.root / "base" / "sigkill.py"
    script.write_text(SCRIPT)
    plan = []
    for i in range(cases):
        rng = random.Random(f"{seed}:sigkill:{i}")
        step, point = rng.randrange(1, STEPS - 1), rng.choice(POINTS)
        launcher, pause = i % 2 == 1, 0.8 if i % 4 == 3 else 0.0
        case = f"{'launcher' if launcher else 'in-process'}/step-{step}/{point}" + (f"/pause-{pause}" if pause else "")
        if only is None or only in case:
            plan.append((case, step, point, launcher, pause))
    if not plan:
        return []
    d = ctx.scratch("sigkill")
    reference = d / "reference"
    env = dict(os.environ)
    jobs = [("reference", reference, False, env)] + [
        (case, d / f"run-{n}", launcher, {**env, "KILL_AT": f"{step}:{point}", "PAUSE": str(pause)})
        for n, (case, step, point, launcher, pause) in enumerate(plan)]
    procs = {}
    for n in range(0, len(jobs), 2):  # two recordings at a time
        batch = {name: (out, _record(ctx, out, script, launcher, e)) for name, out, launcher, e in jobs[n:n + 2]}
        for name, (out, proc) in batch.items():
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            procs[name] = (out, proc.returncode, err)
    out, rc, err = procs["reference"]
    if rc != 0:
        raise RuntimeError(f"recording the complete sigkill reference exited {rc}:\n{err}")
    ref = ctx.read(out)
    if not isinstance(ref, dict) or not ref.get("ok"):
        raise RuntimeError(f"the ingest cannot read the sigkill reference: {ref}")
    ref_steps = _by_step(ref)
    results = []
    for case, step, point, launcher, pause in plan:
        out, rc, err = procs[case]
        r = _judge(ctx, out, rc, err, step, point, launcher, ref_steps, reference)
        r.case = case
        results.append(r)
    if only is None or only in "live/compare-while-recording":
        r = _while_recording(ctx, script, reference, d / "live")
        r.case = "live/compare-while-recording"
        results.append(r)
    return results


def _while_recording(ctx: Context, script: Path, reference: Path, out: Path) -> Result:
    """`bitguard compare` on a run still being recorded: not identical, and the recording is unharmed
    (it completes, and then compares identical with the reference)."""
    proc = _record(ctx, out, script, True, {**os.environ, "PAUSE": "0.6"})
    deadline = time.monotonic() + 60
    while not list(out.glob("rank-0.*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(1.5)  # a few steps in
    live = ctx.cli(["compare", str(reference), str(out)])
    still_running = proc.poll() is None
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return Result("", "", "hang", "the recording did not finish after a compare read it")
    bad = crashed(live)
    if bad:
        return bad
    if proc.returncode != 0:
        return Result("", "", "wrong_answer", f"the recording failed ({proc.returncode}) after a compare read it "
                                              f"while it ran: {first_line(err)}")
    during = f"exit {live['rc']}: {first_line(live['stderr'] if live['rc'] == 2 else live['stdout'])}"
    if live["rc"] == 0 and still_running:
        return Result("", "", "false_verdict", f"a run still recording compared identical ({during})")
    after = ctx.cli(["compare", str(reference), str(out)])
    bad = crashed(after)
    if bad:
        return bad
    if after["rc"] != 0:
        return Result("", "", "wrong_answer", f"once finished, the run does not compare identical with the reference "
                                              f"(exit {after['rc']}: {first_line(after['stdout'] or after['stderr'])})")
    return Result("", "", "ok" if live["rc"] != 2 else "clean_error", f"while recording: {during}; after: identical")


def _judge(ctx: Context, out: Path, rc: int, err: str, step: int, point: str, launcher: bool,
           ref_steps: dict, reference: Path) -> Result:
    killed = 128 + signal.SIGKILL if launcher else -signal.SIGKILL
    if rc != killed:
        return Result("", "", "wrong_answer", f"the recording exited {rc}, not as killed ({killed}): {first_line(err)}")
    durable = range(step if point == "after-step" else step - 1)  # steps before the last one that ended
    answer = ctx.cli(["compare", str(reference), str(out)])
    read = ctx.read(out)
    if not isinstance(read, dict) or not read.get("ok"):
        return Result("", "", "data_lost", f"the killed run cannot be read: {read if isinstance(read, str) else read['error']}")
    steps = _by_step(read)
    for s in durable:
        if steps.get(s) != ref_steps.get(s):
            return Result("", "", "data_lost", f"step {s} (before the last step that ended) reads "
                                               f"{len(steps.get(s, []))} events, {sum(a != b for a, b in zip(steps.get(s, []), ref_steps[s]))} "
                                               f"of them unlike the complete run's {len(ref_steps[s])}")
    bad = crashed(answer)
    if bad:
        return bad
    verdict = f"exit {answer['rc']}: {first_line(answer['stderr'] if answer['rc'] == 2 else answer['stdout'])}"
    kept = f"steps {list(durable)} whole, {len(read['events'])} events kept"
    if answer["rc"] == 0:
        return Result("", "", "false_verdict", f"a killed run compared identical to the complete one ({kept}; {verdict})")
    if answer["rc"] != 3:
        return Result("", "", "wrong_answer", f"expected inconclusive for a killed run ({kept}; {verdict})")
    return Result("", "", "ok", f"{kept}; {verdict}")
