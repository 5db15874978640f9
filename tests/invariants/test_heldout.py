"""The held-out programs (sample_traces/invariant_heldout.py): each runs, repeats bitwise, and each
bug really changes the training (or the EMA it keeps) and, unless it is made with the optimizer,
not before its step. In process, no bitguard; the two-rank program runs under torchrun (slow)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from bitguard.sample_traces import invariant_heldout as ho

STEPS, BUG_STEP = 4, 2
FLAGS = {  # the flags each bug needs (the held-out bench's base programs, shorter)
    "nanogpt": ["--accumulate", "2"],
    "trainer": ["--accumulate", "2", "--freeze"],
    "loop": [],
    "ema": ["--freeze"],
}


def train(program: str, *argv: str, model_too: bool = False):
    """Losses (hex) and a sha256 per final parameter of one in-process run (and the model)."""
    args = ho.parse_args(["--program", program, "--steps", str(STEPS), *FLAGS[program], *argv])
    model, losses = ho.TRAIN[program](args, 0, 1)
    params = {n: hashlib.sha256(p.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
              for n, p in model.named_parameters()}
    return ([float(x).hex() for x in losses], params) + ((model,) if model_too else ())


@pytest.mark.parametrize("program", ["nanogpt", "loop", "ema", "trainer"])
def test_each_program_repeats_bitwise(program):
    a, b = train(program), train(program)
    assert a == b
    assert len(a[0]) == STEPS


def _bug_flags(program, bug):
    return ["--loss-func"] if bug == "loss-func-no-accum" else []


@pytest.mark.parametrize("program,bug", [(p, b) for p in ("nanogpt", "loop", "ema", "trainer") for b in ho.BUGS[p]
                                         if (p, b) != ("trainer", "unfreeze-all")])
def test_each_bug_changes_the_training_from_its_step(program, bug):
    extra = _bug_flags(program, bug)
    clean_losses, clean_params = train(program, *extra)
    losses, params = train(program, *extra, "--bug", bug, "--bug-step", str(BUG_STEP))
    changed = sorted(n for n in clean_params if params.get(n) != clean_params[n])
    assert changed or set(params) != set(clean_params), f"{bug}: the final parameters equal the clean run's"
    if bug not in ho.FROM_START:
        assert losses[:BUG_STEP] == clean_losses[:BUG_STEP], f"{bug} acted before step {BUG_STEP}"


def test_bugs_that_need_flags_are_refused_without_them():
    with pytest.raises(SystemExit):
        ho.parse_args(["--program", "nanogpt", "--bug", "accum-no-divide"])  # no accumulation to divide by
    with pytest.raises(SystemExit):
        ho.parse_args(["--program", "loop", "--bug", "stale-batch"])  # another program's bug


def test_unfrozen_embeddings_outside_the_trainers_optimizer_stay_as_they_were():
    _, clean = train("trainer")
    _, bug, model = train("trainer", "--bug", "unfreeze-all", "--bug-step", str(BUG_STEP), model_too=True)
    embeddings = [n for n in clean if n.startswith("bert.embeddings.")]
    assert embeddings and all(model.get_parameter(n).requires_grad for n in embeddings)  # unfrozen...
    assert all(bug[n] == clean[n] for n in embeddings)  # ...and never trained: the bug


def test_the_ema_bug_moves_only_the_ema():
    _, clean = train("ema")
    _, bug = train("ema", "--bug", "ema-before-step", "--bug-step", str(BUG_STEP))
    changed = {n.split(".")[0] for n in clean if bug[n] != clean[n]}
    assert changed == {"ema"}  # the trained model is bitwise the clean one: a bug of what is kept, not of training


@pytest.mark.slow
@pytest.mark.extended  # (a two-rank program, 18 s)
def test_rank0_only_clipping_makes_the_replicas_differ(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, bug in (("clean", []), ("bug", ["--bug", "clip-rank0-only"])):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               os.path.join(root, "sample_traces", "invariant_heldout.py"), "--program", "ddp",
                               "--steps", str(STEPS), "--accumulate", "2", *bug, "--results", str(tmp_path / name)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    differ = {}
    for name in ("clean", "bug"):
        r0, r1 = (json.loads((tmp_path / name / f"rank-{r}.json").read_text())["params"] for r in (0, 1))
        differ[name] = sum(r0[n] != r1[n] for n in r0)
    assert differ["clean"] == 0 and differ["bug"] > 0, differ
