"""The invariants corpus (sample_traces/invariant_programs.py): every model runs, the same flags give
the same numbers, and each bug class really does what it says, checked on the program's own state
(in process, no bitguard). The two-rank bug runs under torchrun and is marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bitguard.sample_traces import invariant_programs as ip

BUG_STEP = 2


def program(*argv: str) -> ip.Program:
    prog = ip.build(ip.parse_args(["--steps", "4", *argv]))
    prog.model.train()
    return prog


def run(prog: ip.Program, upto: int) -> ip.Program:
    for step in range(len(prog.losses), upto):
        ip.train_step(prog, step)
    return prog


def params(prog: ip.Program) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in prog.net.named_parameters()}


def grads(prog: ip.Program) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in prog.net.named_parameters() if p.grad is not None}


def grad_norm(tensors) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in tensors])).item()


@pytest.mark.parametrize("argv", [
    ("--model", "tinygpt", "--optimizer", "sgd", "--schedule", "step", "--tie"),
    ("--model", "gpt2", "--optimizer", "adam", "--precision", "bf16", "--dropout", "0.1"),
    ("--model", "llama", "--optimizer", "momentum", "--schedule", "warmup", "--accumulate", "2"),
    ("--model", "mlp", "--optimizer", "adamw", "--schedule", "cosine", "--clip", "0.5", "--freeze"),
])
def test_every_model_trains_and_repeats_bitwise(argv):
    a, b = run(program(*argv), 3), run(program(*argv), 3)
    assert all(torch.isfinite(torch.tensor(a.losses)))
    assert [x.hex() for x in a.losses] == [x.hex() for x in b.losses]
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_flags_a_bug_cannot_use_are_refused():
    with pytest.raises(SystemExit):
        ip.parse_args(["--bug", "scheduler-not-stepped"])  # no schedule to forget
    with pytest.raises(SystemExit):
        ip.parse_args(["--bug", "wrong-dtype", "--optimizer", "adamw"])  # loud, not silent
    one_rank = ip.parse_args([])
    one_rank.bug = "replica-diverge"
    assert "2 ranks" in ip.check_args(one_rank)


def test_missing_zero_grad_accumulates_gradients():
    clean, bug = run(program(), BUG_STEP), run(program("--bug", "no-zero-grad"), BUG_STEP)
    before = grads(bug)
    run(clean, BUG_STEP + 1), run(bug, BUG_STEP + 1)
    fresh, got = grads(clean), grads(bug)
    assert all(torch.allclose(got[n], before[n] + fresh[n], atol=1e-6) for n in fresh)
    assert not all(torch.equal(got[n], fresh[n]) for n in fresh)


def test_frozen_layer_is_updated_from_the_bug_step():
    name = "wpe.weight"
    clean, bug = program("--freeze"), program("--freeze", "--bug", "frozen-updated")
    start = params(bug)[name]
    run(clean, 4), run(bug, BUG_STEP)
    assert torch.equal(params(bug)[name], start) and torch.equal(params(clean)[name], start)
    run(bug, BUG_STEP + 1)
    assert bug.param(name).requires_grad and not torch.equal(params(bug)[name], start)


def test_layer_that_should_train_is_left_frozen():
    bug = run(program("--bug", "left-frozen"), BUG_STEP)
    clean = run(program(), BUG_STEP)
    name = "blocks.1.mlp.fc.weight"
    frozen = params(bug)[name]
    run(bug, 4), run(clean, 4)
    assert not bug.param(name).requires_grad and torch.equal(params(bug)[name], frozen)
    assert not torch.equal(params(clean)[name], frozen)


@pytest.mark.parametrize("bug", ["clip-before-backward", "clip-wrong-params"])
def test_wrong_clipping_leaves_the_gradient_norm_over_max(bug):
    clean, buggy = run(program("--clip", "0.5"), BUG_STEP + 1), run(program("--clip", "0.5", "--bug", bug), BUG_STEP + 1)
    assert grad_norm(grads(clean).values()) <= 0.5 + 1e-5
    assert grad_norm(grads(buggy).values()) > 0.5 + 1e-3
    if bug == "clip-wrong-params":  # what it did clip is within the bound
        assert grad_norm([p.grad for p in list(buggy.net.parameters())[:2]]) <= 0.5 + 1e-5


def test_scheduler_never_stepped_freezes_the_lr():
    clean = run(program("--schedule", "cosine"), 4)
    bug = program("--schedule", "cosine", "--bug", "scheduler-not-stepped")
    run(bug, BUG_STEP)
    lr = bug.optimizer.param_groups[0]["lr"]
    run(bug, 4)
    assert bug.optimizer.param_groups[0]["lr"] == lr != clean.optimizer.param_groups[0]["lr"]


def test_parameter_missing_from_every_group_gets_a_grad_and_no_update():
    bug = run(program("--bug", "param-not-in-group"), BUG_STEP)
    name = ip.TARGETS["tinygpt"].victim
    before = params(bug)[name]
    run(bug, BUG_STEP + 1)
    victim = bug.param(name)
    assert all(victim is not p for g in bug.optimizer.param_groups for p in g["params"])
    assert victim.grad is not None and torch.equal(victim.detach(), before)


def test_dropout_left_in_eval_mode():
    bug = run(program("--dropout", "0.1", "--bug", "dropout-eval"), BUG_STEP + 1)
    drops = [m for m in bug.net.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and not any(m.training for m in drops)


def test_wrong_dtype_parameter():
    bug = run(program("--optimizer", "sgd", "--bug", "wrong-dtype"), BUG_STEP + 1)
    assert bug.net.wte.weight.dtype == torch.bfloat16 and bug.net.lm_head.weight.dtype == torch.float32


def test_accumulation_with_the_wrong_loss_scale_multiplies_gradients():
    clean = run(program("--accumulate", "2"), BUG_STEP + 1)
    bug = run(program("--accumulate", "2", "--bug", "accum-wrong-scale"), BUG_STEP + 1)
    g, b = grads(clean), grads(bug)
    assert all(torch.allclose(b[n], 2 * g[n], rtol=1e-5, atol=1e-7) for n in g)


def test_loader_repeats_a_batch_once():
    bug, clean = program("--bug", "repeat-batch"), program()
    assert bug.batches[BUG_STEP] is bug.batches[BUG_STEP - 1]
    assert not torch.equal(clean.batches[BUG_STEP][0], clean.batches[BUG_STEP - 1][0])
    assert all(torch.equal(bug.batches[s][0], clean.batches[s][0]) for s in (0, 1, 3))


def test_broken_weight_tying():
    clean = run(program("--tie"), 4)
    bug = run(program("--tie", "--bug", "broken-tying"), 4)
    assert clean.net.lm_head.weight is clean.net.wte.weight
    head = bug.net.lm_head.weight
    assert head is not bug.net.wte.weight
    assert all(head is not p for g in bug.optimizer.param_groups for p in g["params"])


def test_inplace_edit_of_a_leaf_parameter():
    bug = run(program("--bug", "inplace-leaf"), BUG_STEP)
    name = ip.TARGETS["tinygpt"].victim
    before = params(bug)[name]
    ip.start_of_step(bug, BUG_STEP)
    assert torch.equal(bug.param(name).detach(), before * 0.999)


@pytest.mark.slow
@pytest.mark.extended  # a replica diverging on 2 ranks is caught by test_engine_end_to_end.py
def test_one_replica_diverges_under_two_ranks(tmp_path):
    script = ip.__file__
    for name, bug in (("clean", []), ("bug", ["--bug", "replica-diverge"])):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        script, "--model", "mlp", "--steps", "4", "--results", str(tmp_path / name), *bug],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    for name, differ in (("clean", set()), ("bug", {ip.TARGETS["mlp"].victim})):
        r0, r1 = (json.loads((tmp_path / name / f"rank-{r}.json").read_text())["params"] for r in (0, 1))
        assert {n for n in r0 if r0[n] != r1[n]} == differ, name
