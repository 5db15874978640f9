"""Held-out training programs for the invariants evaluation (issue 17; docs/INVARIANTS.md,
'Held-out evaluation'). The engine was developed against sample_traces/invariant_programs.py;
nothing here was seen while it was tuned. An ordinary training script: it never imports bitguard.

Five programs, each written in a style the tuning corpus does not use (`--program`):

  nanogpt  a nanoGPT-like loop (karpathy/nanoGPT train.py's shape): its own GPT with a fused
           qkv projection and the output layer tied into the token embedding, AdamW over
           decay/no-decay param groups, a warmup-cosine lr set by hand on every group (no torch
           scheduler), gradient accumulation, bf16 autocast on CPU with a disabled GradScaler
           (scale/unscale_/step/update as nanoGPT calls them), zero_grad(set_to_none=True)
           *after* the step, the next batch fetched while the current one trains, an
           evaluation (model.eval(), no_grad) before iteration 0 and every 3 iterations;
  trainer  the Hugging Face Trainer on a tiny BERT classifier built from its config (random
           weights, nothing downloaded): its own AdamW groups, linear or cosine warmup
           schedule, max_grad_norm clipping, gradient accumulation, model.zero_grad() after the
           step, optionally a custom `compute_loss_func` normalised by num_items_in_batch;
  loop     a plain torch loop on a small CNN (Conv2d, BatchNorm, Dropout) fed by a DataLoader:
           four param groups (backbone/head x decay/no-decay, the head at 10x the lr), OneCycleLR,
           MultiStepLR or ExponentialLR, model.zero_grad(), an evaluation every 2 iterations
           (model.eval(), no_grad, model.train());
  ema      a word-language-model LSTM (PyTorch's examples/word_language_model) with the decoder
           tied to the encoder, clipping at 0.25, an EMA copy (torch.optim.swa_utils.AveragedModel)
           updated after each step and evaluated every 2 iterations, optionally the first LSTM
           layer frozen by design;
  ddp      under torchrun (2 ranks, gloo): a transformer encoder classifier in DDP, gradient
           accumulation with DDP's no_sync(), clipping, ExponentialLR, each rank its own data.

`--bug NAME` (the names in `BUGS`) switches on a silent bug of the classes TrainCheck's study and
real reports name, from iteration `--bug-step` (default 2) on, or from the start for bugs made
when the optimizer is built (`FROM_START`). `--results DIR` writes DIR/rank-R.json (losses as hex
floats, a sha256 per final parameter). Everything is seeded: the same flags give the same bits.
What this script does not know: anything about bitguard or which invariant should catch a bug.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

PROGRAMS = ("nanogpt", "trainer", "loop", "ema", "ddp")
BUGS = {
    "nanogpt": {
        "zero-grad-in-accum": "optimizer.zero_grad() inside the micro-step loop: only the last micro-batch's gradient is kept",
        "accum-no-divide": "the loss is no longer divided by the accumulation steps",
        "lr-not-updated": "the hand-written lr schedule is no longer applied to the param groups (lr stays)",
        "clip-skipped": "gradient clipping is skipped (grad_clip set, the clip call gone)",
        "stale-batch": "the next batch is no longer fetched: every micro-step trains on the same batch",
    },
    "trainer": {
        "head-not-in-optimizer": "the user's optimizer is built over model.bert only: the classifier head is in no group",
        "loss-func-no-accum": "compute_loss_func returns the mean loss, ignoring num_items_in_batch: with accumulation "
                              "the loss is not divided by the accumulation steps",
        "unfreeze-all": "a callback calls model.requires_grad_(True) to unfreeze the embeddings frozen by design: they "
                        "get gradients, but the Trainer built its optimizer without them: never updated",
        "reinit-head": "a callback re-initialises the classifier head in place, once",
    },
    "loop": {
        "eval-not-reset": "after an evaluation model.train() is forgotten: dropout and BatchNorm stay in eval mode",
        "loader-iter-recreated": "next(iter(loader)) each micro-step: the loader's first batch every time",
        "group-missing": "the param groups filter parameters by name and miss the BatchNorm weights",
        "wd-on-norms": "the decay groups take every parameter: weight decay on BatchNorm and biases",
        "zero-grad-after-backward": "zero_grad() between backward and step: the step sees no gradient",
        "scheduler-not-stepped": "scheduler.step() is no longer called",
    },
    "ema": {
        "unfreeze-all": "model.requires_grad_(True) at a new phase: the LSTM layer frozen by design trains",
        "ema-not-restored": "the EMA weights are copied into the model for an evaluation and not swapped back, once",
        "ema-before-step": "the EMA is updated before optimizer.step(): it averages stale weights",
    },
    "ddp": {
        "clip-rank0-only": "only rank 0 clips its gradients: the replicas' optimizer steps differ (BLOOM's bug class)",
        "accum-no-divide": "the loss is no longer divided by the accumulation steps",
    },
}
# made with the optimizer or the loss function: from step 0 (--bug-step does not apply)
FROM_START = {"head-not-in-optimizer", "group-missing", "wd-on-norms", "loss-func-no-accum"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--program", choices=PROGRAMS, required=True)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: CPU autocast (nanogpt, loop)")
    p.add_argument("--clip", type=float, default=None, help="max norm (default per program; 0: none)")
    p.add_argument("--schedule", default=None, help="loop: onecycle|multistep|exponential; trainer: linear|cosine")
    p.add_argument("--optimizer", default=None, help="loop: sgd|adam")
    p.add_argument("--freeze", action="store_true", help="trainer: embeddings frozen; ema: LSTM layer 0 frozen")
    p.add_argument("--loss-func", action="store_true", help="trainer: a compute_loss_func over num_items_in_batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bug", default=None)
    p.add_argument("--bug-step", type=int, default=2)
    p.add_argument("--results", default=None)
    args = p.parse_args(argv)
    if args.bug is not None and args.bug not in BUGS[args.program]:
        p.error(f"--bug {args.bug} is not a bug of --program {args.program} (one of {', '.join(BUGS[args.program])})")
    needs = {"zero-grad-in-accum": args.accumulate > 1, "accum-no-divide": args.accumulate > 1,
             "loss-func-no-accum": args.accumulate > 1 and args.loss_func,
             "unfreeze-all": args.freeze, "stale-batch": True}
    if not needs.get(args.bug, True):
        p.error(f"--bug {args.bug} needs " + {"unfreeze-all": "--freeze", "loss-func-no-accum": "--loss-func and "
                "--accumulate > 1"}.get(args.bug, "--accumulate > 1"))
    if args.bug and not 1 <= args.bug_step < args.steps:
        p.error(f"--bug-step must be in 1..{args.steps - 1}")
    return args


def bug_on(args, it: int, name: str) -> bool:
    """Is bug `name` active at iteration `it`?"""
    return args.bug == name and (name in FROM_START or it >= args.bug_step)


def autocast(args):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")


# -- nanogpt ----------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab=65, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT ties this way round
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def train_nanogpt(args, rank: int, world: int) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(1337 + args.seed)
    block_size, learning_rate, min_lr, warmup, grad_clip = 16, 1e-3, 1e-4, 2, 1.0 if args.clip is None else args.clip
    data = torch.randint(0, 65, (4096,), generator=torch.Generator().manual_seed(7 + args.seed))
    val = torch.randint(0, 65, (1024,), generator=torch.Generator().manual_seed(8 + args.seed))

    def get_batch(split):
        src = data if split == "train" else val
        ix = torch.randint(len(src) - block_size, (args.batch,))
        x = torch.stack([src[i:i + block_size] for i in ix])
        y = torch.stack([src[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    def get_lr(it):
        if it < warmup:
            return learning_rate * (it + 1) / (warmup + 1)
        ratio = (it - warmup) / max(1, args.steps - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    model = NanoGPT()
    optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT: enabled only for float16

    @torch.no_grad()
    def estimate_loss():
        model.eval()
        out = {}
        for split in ("train", "val"):
            out[split] = sum(model(*get_batch(split))[1].item() for _ in range(2)) / 2
        model.train()
        return out

    losses = []
    X, Y = get_batch("train")
    for it in range(args.steps):
        lr = get_lr(it)
        if not bug_on(args, it, "lr-not-updated"):
            for group in optimizer.param_groups:
                group["lr"] = lr
        if it % 3 == 0:
            estimate_loss()
        total = 0.0
        for micro in range(args.accumulate):
            with autocast(args):
                logits, loss = model(X, Y)
                if not bug_on(args, it, "accum-no-divide"):
                    loss = loss / args.accumulate
            if not bug_on(args, it, "stale-batch"):
                X, Y = get_batch("train")
            if bug_on(args, it, "zero-grad-in-accum"):
                optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            total += loss.item()
        if grad_clip != 0.0 and not bug_on(args, it, "clip-skipped"):
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return model, losses


# -- trainer ----------------------------------------------------------------------------------
class Sentences(torch.utils.data.Dataset):
    """Random token rows with a label each, fixed by their own generator."""

    def __init__(self, rows, length=12, vocab=64, labels=3, seed=0):
        g = torch.Generator().manual_seed(11 + seed)
        self.ids = torch.randint(1, vocab, (rows, length), generator=g)
        self.labels = torch.randint(0, labels, (rows,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def train_trainer(args, rank: int, world: int) -> tuple[nn.Module, list[float]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments, set_seed

    set_seed(args.seed)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    model = BertForSequenceClassification(config)
    if args.freeze:
        model.bert.embeddings.requires_grad_(False)

    class Bugs(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kwargs):
            if state.global_step != args.bug_step:
                return
            if args.bug == "unfreeze-all":
                model.requires_grad_(True)
            elif args.bug == "reinit-head":
                model.classifier.reset_parameters()

    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"]
        if args.bug == "loss-func-no-accum":
            return F.cross_entropy(logits, labels)  # the mean of this micro-batch: not over the accumulated items
        return F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch

    optimizers = (None, None)
    if args.bug == "head-not-in-optimizer":
        optimizers = (torch.optim.AdamW(model.bert.parameters(), lr=5e-4, weight_decay=0.01), None)
    clip = 1.0 if args.clip is None else args.clip
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=args.accumulate, learning_rate=5e-4, weight_decay=0.01, warmup_steps=2,
            lr_scheduler_type=args.schedule or "linear", max_grad_norm=clip, logging_steps=1, save_strategy="no",
            report_to=[], use_cpu=True, seed=args.seed, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=training,
                          train_dataset=Sentences(args.steps * args.batch * args.accumulate, seed=args.seed),
                          callbacks=[Bugs()], optimizers=optimizers,
                          compute_loss_func=loss_func if args.loss_func else None)
        trainer.train()
    return model, [e["loss"] for e in trainer.state.log_history if "loss" in e]


# -- loop -------------------------------------------------------------------------------------
class SmallCNN(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.drop(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)))


def loop_groups(args, model: SmallCNN, lr: float) -> list[dict]:
    """backbone/head x decay/no-decay; the head at 10x the lr."""
    groups = []
    for part, scale in (("backbone", 1.0), ("head", 10.0)):
        named = [(n, p) for n, p in model.named_parameters() if (n.startswith("fc.") == (part == "head"))]
        if bug_on(args, 0, "group-missing"):  # by name: 'bn' weights match neither filter
            decay = [p for n, p in named if n.endswith("weight") and not n.startswith("bn")]
            no_decay = [p for n, p in named if n.endswith("bias")]
        elif bug_on(args, 0, "wd-on-norms"):
            decay, no_decay = [p for _, p in named], []
        else:
            decay = [p for _, p in named if p.dim() > 1]
            no_decay = [p for _, p in named if p.dim() <= 1]
        groups.append({"params": decay, "lr": lr * scale, "weight_decay": 5e-4})
        if no_decay:
            groups.append({"params": no_decay, "lr": lr * scale, "weight_decay": 0.0})
    return groups


def train_loop(args, rank: int, world: int) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(args.seed)
    model = SmallCNN()
    g = torch.Generator().manual_seed(3 + args.seed)
    n = args.steps * args.accumulate * args.batch
    images, labels = torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=args.batch)
    val = torch.randn(8, 3, 8, 8, generator=g)
    lr = 0.05 if (args.optimizer or "sgd") == "sgd" else 2e-3
    groups = loop_groups(args, model, lr)
    if (args.optimizer or "sgd") == "sgd":
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    else:
        optimizer = torch.optim.Adam(groups, lr=lr)
    schedule = args.schedule or "onecycle"
    if schedule == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in groups],
                                                        total_steps=args.steps)
    elif schedule == "multistep":
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 4], gamma=0.3)
    else:
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.8)
    losses, it_loader = [], iter(loader)
    model.train()
    for it in range(args.steps):
        model.zero_grad()
        total = 0.0
        for micro in range(args.accumulate):
            x, y = next(iter(loader)) if bug_on(args, it, "loader-iter-recreated") else next(it_loader)
            with autocast(args):
                loss = F.cross_entropy(model(x).float(), y) / args.accumulate
            loss.backward()
            total += loss.item()
        if bug_on(args, it, "zero-grad-after-backward"):
            model.zero_grad()
        optimizer.step()
        if not bug_on(args, it, "scheduler-not-stepped"):
            scheduler.step()
        losses.append(total)
        if it % 2 == 1:
            model.eval()
            with torch.no_grad():
                model(val)
            if not bug_on(args, it + 1, "eval-not-reset"):  # (the eval ends this iteration: its effect, the next)
                model.train()
    return model, losses


# -- ema --------------------------------------------------------------------------------------
class RNNModel(nn.Module):
    """examples/word_language_model's model: encoder, LSTM, decoder tied to the encoder."""

    def __init__(self, ntoken=50, ninp=32, nhid=32, nlayers=2, dropout=0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight = self.encoder.weight
        self.nlayers, self.nhid = nlayers, nhid

    def forward(self, x, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return self.decoder(self.drop(output)), hidden

    def init_hidden(self, bsz):
        return (torch.zeros(self.nlayers, bsz, self.nhid), torch.zeros(self.nlayers, bsz, self.nhid))


def train_ema(args, rank: int, world: int) -> tuple[nn.Module, list[float]]:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(args.seed)
    model = RNNModel()
    if args.freeze:
        for name, p in model.rnn.named_parameters():
            if name.endswith("_l0"):
                p.requires_grad_(False)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    clip = 0.25 if args.clip is None else args.clip
    bptt = 8
    data = torch.randint(0, 50, (bptt * args.steps * args.accumulate + 1, args.batch),
                         generator=torch.Generator().manual_seed(5 + args.seed))
    hidden = model.init_hidden(args.batch)
    losses = []
    model.train()
    for it in range(args.steps):
        if args.bug == "unfreeze-all" and it == args.bug_step:
            model.requires_grad_(True)
        if args.bug == "ema-not-restored" and it == args.bug_step:
            model.load_state_dict(ema.module.state_dict())  # (an evaluation on the EMA weights, never undone)
        optimizer.zero_grad()
        total = 0.0
        for micro in range(args.accumulate):
            i = (it * args.accumulate + micro) * bptt
            x, y = data[i:i + bptt], data[i + 1:i + 1 + bptt]
            hidden = tuple(h.detach() for h in hidden)
            output, hidden = model(x, hidden)
            loss = F.cross_entropy(output.view(-1, 50), y.reshape(-1)) / args.accumulate
            loss.backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if bug_on(args, it, "ema-before-step"):
            ema.update_parameters(model)
            optimizer.step()
        else:
            optimizer.step()
            ema.update_parameters(model)
        losses.append(total)
        if it % 2 == 1:
            ema.eval()
            with torch.no_grad():
                ema(data[:bptt], model.init_hidden(args.batch))
    return nn.ModuleDict({"model": model, "ema": ema}), losses  # (the results name both)


# -- ddp --------------------------------------------------------------------------------------
class EncoderClassifier(nn.Module):
    def __init__(self, vocab=64, width=32, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))


def train_ddp(args, rank: int, world: int) -> tuple[nn.Module, list[float]]:
    import contextlib

    torch.manual_seed(args.seed)
    net = EncoderClassifier()
    model = net
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    clip = 0.1 if args.clip is None else args.clip
    g = torch.Generator().manual_seed(21 + args.seed + 1000 * rank)  # each rank its own shard
    ids = torch.randint(0, 64, (args.steps, args.accumulate, args.batch, 10), generator=g)
    ys = torch.randint(0, 4, (args.steps, args.accumulate, args.batch), generator=g)
    losses = []
    model.train()
    for it in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(args.accumulate):
            last = micro == args.accumulate - 1
            sync = model.no_sync() if (world > 1 and not last) else contextlib.nullcontext()
            with sync:
                loss = F.cross_entropy(model(ids[it, micro]), ys[it, micro])
                if not bug_on(args, it, "accum-no-divide"):
                    loss = loss / args.accumulate
                loss.backward()
            total += loss.item()
        if clip and not (bug_on(args, it, "clip-rank0-only") and rank != 0):
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()
        scheduler.step()
        losses.append(total)
    return net, losses


TRAIN = {"nanogpt": train_nanogpt, "trainer": train_trainer, "loop": train_loop, "ema": train_ema, "ddp": train_ddp}


def write_results(model: nn.Module, losses: list[float], rank: int, folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    params = {name: hashlib.sha256(p.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
              for name, p in model.named_parameters()}
    (out / f"rank-{rank}.json").write_text(json.dumps({"losses": [float(x).hex() for x in losses], "params": params},
                                                      indent=1))


def main(argv=None):
    from bitguard.sample_traces.invariant_programs import on_ranks

    args = parse_args(argv)

    def body(rank, world):
        model, losses = TRAIN[args.program](args, rank, world)
        if args.results:
            write_results(model, losses, rank, args.results)

    on_ranks(body)


if __name__ == "__main__":
    main()
