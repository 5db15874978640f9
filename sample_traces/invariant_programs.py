"""One small training script whose flags make the clean and buggy programs of the invariants
evaluation (issue 17; docs/INVARIANTS.md). An ordinary training script: it never imports bitguard.

Flags vary the model (--model: the tiny GPT of tinygpt.py, GPT-2 and Llama built by transformers
from tiny configs with random weights, nothing downloaded, or an MLP), the optimizer (SGD,
SGD+momentum, Adam, AdamW), the LR schedule (none, step, cosine, linear warmup), batch size,
precision (fp32, bf16 autocast), gradient accumulation, clipping, dropout, weight tying, a layer
frozen by design (--freeze) and the world size (run it under `torchrun --nproc-per-node 2` for
DDP on gloo). Everything is seeded: the same flags give the same numbers, bit for bit.

`--bug NAME` switches on one of TrainCheck's silent-bug classes from `--bug-step` on (default 2;
one-off bugs happen at that step only), so that the latency of a detection is counted in steps:

  no-zero-grad           optimizer.zero_grad() is no longer called: gradients accumulate
  frozen-updated         the layer frozen by design (--freeze) is unfrozen: the optimizer, built
                         over every parameter, updates it
  left-frozen            a layer that should train is frozen (requires_grad False) and stays so
  clip-before-backward   clip_grad_norm_ is called before backward (it clips stale gradients;
                         the new ones go unclipped); needs --clip
  clip-wrong-params      clip_grad_norm_ clips only the first two parameters; needs --clip
  scheduler-not-stepped  scheduler.step() is no longer called; needs --schedule
  param-not-in-group     one parameter is dropped from its param group (in no group any more)
  dropout-eval           model.eval() is left on (dropout off while training)
  replica-diverge        rank 1 alone nudges one parameter by 1e-3, once (needs 2 ranks)
  wrong-dtype            the token embedding is cast to bf16 (tiny GPT, untied, SGD: under Adam the
                         float32 state makes it fail loudly, which is no silent bug)
  accum-wrong-scale      with --accumulate N > 1, the loss is no longer divided by N
  repeat-batch           the data loader hands out the previous step's batch again, once
  broken-tying           the output layer gets its own copy of the tied embedding (--tie), one the
                         optimizer does not know
  inplace-leaf           one parameter is edited in place (scaled by 0.999) outside the optimizer,
                         once, before the forward

Which parameter or layer a bug touches is fixed per model (`TARGETS`). `--results DIR` writes
DIR/rank-R.json: the losses (hex floats) and a sha256 of each final parameter.
What this script does not know: anything about bitguard, invariants or what should catch a bug.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tinygpt  # noqa: E402

MODELS = ("tinygpt", "gpt2", "llama", "mlp")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = ("none", "step", "cosine", "warmup")
BUGS = ("no-zero-grad", "frozen-updated", "left-frozen", "clip-before-backward", "clip-wrong-params",
        "scheduler-not-stepped", "param-not-in-group", "dropout-eval", "replica-diverge", "wrong-dtype",
        "accum-wrong-scale", "repeat-batch", "broken-tying", "inplace-leaf")
ONE_OFF = ("replica-diverge", "repeat-batch", "inplace-leaf")  # happen at --bug-step only
VOCAB, SEQ, WIDTH, FEATURES, OUTPUTS = 64, 16, 32, 16, 4


@dataclass(frozen=True)
class Targets:
    frozen: str  # module frozen by design with --freeze (frozen-updated unfreezes it)
    trains: str  # module that should train (left-frozen freezes it)
    victim: str  # parameter edited by replica-diverge, inplace-leaf, param-not-in-group


TARGETS = {
    "tinygpt": Targets("wpe", "blocks.1.mlp", "blocks.0.mlp.fc.weight"),
    "gpt2": Targets("transformer.wpe", "transformer.h.1.mlp", "transformer.h.0.mlp.c_fc.weight"),
    "llama": Targets("model.layers.0.input_layernorm", "model.layers.1.mlp", "model.layers.0.mlp.up_proj.weight"),
    "mlp": Targets("net.0", "net.3", "net.3.weight"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="tinygpt")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--schedule", choices=SCHEDULES, default="none")
    p.add_argument("--lr", type=float, default=None, help="default: 0.05 for SGD, 0.01 for Adam(W)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: forward under CPU autocast")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ max norm (0: no clipping)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--tie", action="store_true", help="tie the output layer to the token embedding")
    p.add_argument("--freeze", action="store_true", help="freeze TARGETS[model].frozen by design")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bug", choices=BUGS, default=None)
    p.add_argument("--bug-step", type=int, default=2)
    p.add_argument("--results", default=None, help="write DIR/rank-R.json (losses, final parameter sha256)")
    args = p.parse_args(argv)
    problem = check_args(args)
    if problem:
        p.error(problem)
    return args


def check_args(args) -> str | None:
    """Why these flags cannot make the program they ask for (None: they can)."""
    needs = {"clip-before-backward": args.clip > 0, "clip-wrong-params": args.clip > 0,
             "scheduler-not-stepped": args.schedule != "none", "frozen-updated": args.freeze,
             "accum-wrong-scale": args.accumulate > 1, "broken-tying": args.tie,
             "wrong-dtype": args.model == "tinygpt" and not args.tie and args.optimizer in ("sgd", "momentum"),
             "replica-diverge": int(os.environ.get("WORLD_SIZE", "1")) > 1}
    if args.bug in needs and not needs[args.bug]:
        return f"--bug {args.bug} needs " + {
            "clip-before-backward": "--clip", "clip-wrong-params": "--clip", "scheduler-not-stepped": "--schedule",
            "frozen-updated": "--freeze", "accum-wrong-scale": "--accumulate > 1", "broken-tying": "--tie",
            "wrong-dtype": "--model tinygpt, no --tie, --optimizer sgd or momentum (Adam's float32 state"
                            " makes a bf16 parameter fail loudly, not silently)", "replica-diverge": "2 ranks (torchrun)"}[args.bug]
    if args.tie and args.model == "mlp":
        return "--tie needs a token model (not --model mlp)"
    if args.bug and not 1 <= args.bug_step < args.steps:
        return f"--bug-step must be in 1..{args.steps - 1}"
    return None


class MLPNet(nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 32),
                                 nn.GELU(), nn.Linear(32, OUTPUTS))

    def forward(self, x):
        return self.net(x)


def build_model(args) -> nn.Module:
    if args.model == "tinygpt":
        model = tinygpt.GPT(VOCAB, SEQ, WIDTH, 2, 4, nn.LayerNorm, args.dropout)
        if args.tie:
            model.lm_head.weight = model.wte.weight
        return model
    if args.model == "mlp":
        return MLPNet(args.dropout)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=4,
                            resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
                            tie_word_embeddings=args.tie, use_cache=False, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attention_dropout=args.dropout, tie_word_embeddings=args.tie, use_cache=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return LlamaForCausalLM(config)


def build_optimizer(args, params):
    lr = args.lr if args.lr is not None else (0.05 if args.optimizer in ("sgd", "momentum") else 1e-2)
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if args.optimizer == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def build_scheduler(args, optimizer):
    if args.schedule == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if args.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    if args.schedule == "warmup":
        return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=3)
    return None


def make_batches(args, rank: int) -> list[list]:
    """batches[step][micro]: token rows (token models) or (x, y) pairs (MLP), this rank's own."""
    g = torch.Generator().manual_seed(args.seed + 1 + 1000 * rank)
    shape = (args.steps, args.accumulate, args.batch)
    if args.model == "mlp":
        x, y = torch.randn(*shape, FEATURES, generator=g), torch.randn(*shape, OUTPUTS, generator=g)
        batches = [[(x[s, m], y[s, m]) for m in range(args.accumulate)] for s in range(args.steps)]
    else:
        tokens = torch.randint(0, VOCAB, (*shape, SEQ + 1), generator=g)
        batches = [[tokens[s, m] for m in range(args.accumulate)] for s in range(args.steps)]
    if args.bug == "repeat-batch":
        batches[args.bug_step] = batches[args.bug_step - 1]
    return batches


def compute_loss(args, model, batch):
    if args.model == "mlp":
        x, y = batch
        return F.mse_loss(model(x).float(), y)
    if args.model == "tinygpt":
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    ids = batch[:, :-1]
    return model(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself


@dataclass
class Program:
    """Everything a training step touches; `net` is the bare model, `model` what is called (DDP or net)."""

    args: argparse.Namespace
    net: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    batches: list
    rank: int = 0
    world: int = 1
    step: int = 0  # the step being trained
    losses: list = field(default_factory=list)

    def module(self, name: str) -> nn.Module:
        return self.net.get_submodule(name)

    def param(self, name: str) -> nn.Parameter:
        return self.net.get_parameter(name)


def build(args, rank: int = 0, world: int = 1) -> Program:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    net = build_model(args)
    if args.freeze:
        net.get_submodule(TARGETS[args.model].frozen).requires_grad_(False)
    model = net
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
    optimizer = build_optimizer(args, net.parameters())  # every parameter, frozen ones included
    return Program(args, net, model, optimizer, build_scheduler(args, optimizer), make_batches(args, rank), rank, world)


def start_of_step(prog: Program, step: int) -> None:
    """The bugs that change the program's state before the step's forward."""
    args, t = prog.args, TARGETS[prog.args.model]
    if step != args.bug_step:
        return  # every state-changing bug happens once, at its step, and its effect persists
    if args.bug == "frozen-updated":
        prog.module(t.frozen).requires_grad_(True)
    elif args.bug == "left-frozen":
        prog.module(t.trains).requires_grad_(False)
    elif args.bug == "param-not-in-group":
        victim = prog.param(t.victim)
        for group in prog.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p is not victim]
    elif args.bug == "dropout-eval":
        prog.model.eval()
    elif args.bug == "wrong-dtype":
        prog.net.wte.to(torch.bfloat16)
    elif args.bug == "broken-tying":
        hf = args.model != "tinygpt"
        out = prog.net.get_output_embeddings() if hf else prog.net.lm_head
        inp = prog.net.get_input_embeddings() if hf else prog.net.wte
        out.weight = nn.Parameter(inp.weight.detach().clone())  # a copy, and not in the optimizer
    elif args.bug == "inplace-leaf":
        with torch.no_grad():
            prog.param(t.victim).mul_(0.999)


def clip(prog: Program) -> None:
    params = [p for p in prog.net.parameters() if p.requires_grad]
    if prog.args.bug == "clip-wrong-params" and prog.step >= prog.args.bug_step:
        params = params[:2]
    torch.nn.utils.clip_grad_norm_(params, prog.args.clip)


def train_step(prog: Program, step: int) -> float:
    args = prog.args
    active = args.bug is not None and step >= args.bug_step
    prog.step = step
    start_of_step(prog, step)
    if not (active and args.bug == "no-zero-grad"):
        prog.optimizer.zero_grad(set_to_none=True)
    if args.clip and active and args.bug == "clip-before-backward":
        clip(prog)
    total = 0.0
    for batch in prog.batches[step]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss = compute_loss(args, prog.model, batch)
        scale = 1 if (active and args.bug == "accum-wrong-scale") else args.accumulate
        (loss / scale).backward()
        total += loss.item() / args.accumulate
    if args.clip and not (active and args.bug == "clip-before-backward"):
        clip(prog)
    prog.optimizer.step()
    if prog.scheduler is not None and not (active and args.bug == "scheduler-not-stepped"):
        prog.scheduler.step()
    if args.bug == "replica-diverge" and step == args.bug_step and prog.rank == 1:
        with torch.no_grad():
            prog.param(TARGETS[args.model].victim).add_(1e-3)
    prog.losses.append(total)
    return total


def train(args, rank: int = 0, world: int = 1) -> Program:
    prog = build(args, rank, world)
    prog.model.train()
    for step in range(args.steps):
        train_step(prog, step)
    return prog


def write_results(prog: Program, folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    params = {name: hashlib.sha256(p.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
              for name, p in prog.net.named_parameters()}
    doc = {"losses": [float(l).hex() for l in prog.losses], "params": params}
    (out / f"rank-{prog.rank}.json").write_text(json.dumps(doc, indent=1))


def on_ranks(body) -> None:
    """`body(rank, world)`, in a gloo process group when torchrun started WORLD_SIZE > 1 ranks. The
    group is destroyed after `body` returns, when what it made (DDP, whose reducer holds the group)
    is gone with its frame (MACHINE.md: gloo teardown)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        body(0, 1)
        return
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo")
    body(dist.get_rank(), world)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)

    def body(rank, world):
        prog = train(args, rank, world)
        if args.results:
            write_results(prog, args.results)

    on_ranks(body)


if __name__ == "__main__":
    main()
