"""Afterwards: how to confirm a confirmed online alert bitwise, offline, with `record` and `compare`.

An online alert says a sensor saw a wrong value at step K on rank R, and the verifier confirmed
it on the evidence it kept. The core tool can then show it bit for bit: replay step K from the
last checkpoint the training saved before it, twice, recorded in full mode with only that step
recorded (`bitguard record --steps K:K+1`), once on the suspect device and once on a healthy
one, and `bitguard compare` the two: a divergence names the first boundary where the suspect
device computed something else (then `bitguard drill` names the operation); identical means the
fault did not recur in that replay (it is intermittent: replay again).

bitguard counts steps from 0 in each process, so after a resume from a checkpoint saved at step
C the suspect step is K - C: the advice says so rather than guessing C, which only the training
script knows. `advice(alert, command)` builds the commands from the run's recorded command and
its world size; it knows nothing of how alerts are raised or read.
"""

from __future__ import annotations

import shlex


def _script_args(command) -> list[str] | None:
    """The training script and its arguments from a manifest's `command` (`python train.py ...`,
    `train.py ...` as torchrun's ranks record it), None when it cannot be read as one."""
    if isinstance(command, str):
        command = shlex.split(command)
    if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
        return None
    words = list(command)
    if words[0].endswith(".py"):
        return words
    if "python" in words[0].rsplit("/", 1)[-1]:
        rest = words[1:]
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
            rest.pop(0)
        return rest or None
    return None


def advice(alert: dict, command, world_size: int = 1) -> dict:
    """The replay advice for one confirmed alert: its step and rank, the commands, and the text
    `bitguard alerts` prints."""
    k, rank = alert.get("step"), alert.get("rank")
    k = k if isinstance(k, int) else 0
    script = _script_args(command)
    shown = shlex.join(script) if script else "SCRIPT [ARGS]"
    window = f"{k}:{k + 1}"
    outs = (f"runs/step-{k}-healthy", f"runs/step-{k}-suspect")
    if world_size > 1:
        launch = f"torchrun --nproc-per-node {world_size} -m bitguard record"
        tail = f"-- {shown}"
    else:
        launch = "bitguard record"
        tail = f"-- python {shown}"
    records = [f"{launch} --mode full --steps {window} --out {out} {tail}" for out in outs]
    compare = f"bitguard compare {outs[0]} {outs[1]}"
    where = f"rank {rank}'s device" if world_size > 1 else "the suspect device"
    text = "\n".join([
        f"afterwards: replay step {k} offline and compare it bitwise:",
        f"  1. start from the last checkpoint your script saved before step {k}, twice: once on a healthy device,",
        f"     once on {where}, recording only step {k} (after a resume from a checkpoint of step C it is",
        f"     step {k}-C in the new process: use --steps {k}-C:{k}-C+1):",
        *(f"       {r}" for r in records),
        f"  2. {compare}",
        "     exit 1 names the first boundary where the suspect device computed something else (then",
        f"     'bitguard drill {outs[0]} {outs[1]}' names the operation); exit 0: the fault did not recur in",
        "     this replay (intermittent: replay again)",
    ])
    return {"step": k, "rank": rank, "steps": window, "records": records, "compare": compare,
            "resume_note": f"after a resume from a checkpoint of step C, record --steps {k}-C:{k}-C+1",
            "text": text}
