"""A small GPT and its training loop: the workload bitguard's tests, benchmarks and scenarios record.

This is an ordinary training script; it never imports bitguard. Faults for the localisation
scenarios are switched on with --fault (each is a realistic bug, injected at a known place):

  forward-bitflip   flip one bit of blocks.{L}.mlp.fc's output (inside a module's forward)
  functional        perturb the residual add between blocks.{L}.attn and blocks.{L}.ln_2 (a
                    functional op between modules)
  backward          corrupt the gradient that blocks.{L}.attn.proj sends back (a wrong backward)
  embedding-race    mix two rows of the token embedding's gradient (a backward race)
  grad-accum        skip optimizer.zero_grad() from --fault-step on (gradients accumulate)
  optimizer         a wrong update for one parameter (lm_head.weight scaled by 1.0001 in step())
  data              a different batch at --fault-step
  data-order        shuffled batch order from --fault-step on
  rng-shift         one extra RNG draw before --fault-step (shifts every dropout mask after it)
  bf16-variance     every LayerNorm computes its variance in bf16 (low-precision normalization;
                    the modules keep their type, as after a kernel or library regression)
  swap              swap two elements of blocks.{L}.attn.qkv's output (XOR cannot see it)
  double-flip       flip the same bit in two elements of that output (cancels under XOR)
  nondeterministic  blocks.{L}.mlp.fc sums its split-K partial products in an order drawn afresh
                    on every call (a racy reduction: varies between reruns)
  benign-dropout    an extra dropout module with p=0 inserted (structure differs, values do not)
  benign-probe      with --probe: the activation-statistics probe (whose result training never
                    uses) computes in bf16 (a benign difference a rule should accept)
  rms-eps           with --norm rms: every RMSNorm adds eps 1e-5 instead of 1e-6 (a changed
                    constant inside a module of several operations)

--attention sdpa computes attention with F.scaled_dot_product_attention instead of the explicit
matmul/softmax (another kernel for the same mathematics: its low bits differ).

Every fault but benign-dropout is active from --fault-step on. --losses FILE writes the per-step
losses as JSON; --no-seed leaves the global RNG to the launcher (model initialisation then
depends on whoever seeds it, as in many training stacks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def low_precision_layer_norm(norm: nn.LayerNorm, x):
    """LayerNorm with its variance computed in bf16 (the 'bf16-variance' fault)."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).to(torch.bfloat16).pow(2).mean(-1, keepdim=True).to(x.dtype)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


class ActivationStats(nn.Module):
    """A logging probe: the RMS of the final hidden state, which training never uses (--probe)."""

    def __init__(self):
        super().__init__()
        self.low_precision = False  # the 'benign-probe' fault

    def forward(self, x):
        with torch.no_grad():
            h = x.to(torch.bfloat16) if self.low_precision else x
            return h.float().pow(2).mean().sqrt()


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, sdpa: bool = False):
        super().__init__()
        self.heads = heads
        self.sdpa = sdpa
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            p = self.drop.p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, norm: type, dropout: float, sdpa: bool = False):
        super().__init__()
        self.ln_1 = norm(width)
        self.attn = CausalSelfAttention(width, heads, dropout, sdpa)
        self.ln_2 = norm(width)
        self.mlp = MLP(width)

    def forward(self, x):
        x = residual_add(x, self.attn(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


def residual_add(x, y):  # a functional op between modules (the 'functional' fault patches it)
    return x + y


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, width: int, layers: int, heads: int, norm: type, dropout: float,
                 probe: bool = False, sdpa: bool = False):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, norm, dropout, sdpa) for _ in range(layers))
        self.ln_f = norm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.stats = ActivationStats() if probe else None
        self.last_rms = None

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if self.stats is not None:
            self.last_rms = self.stats(x)  # logged, never trained on
        return self.lm_head(self.ln_f(x))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--norm", choices=("layer", "rms"), default="layer")
    p.add_argument("--attention", choices=("manual", "sdpa"), default="manual",
                   help="explicit matmul/softmax attention, or F.scaled_dot_product_attention")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-seed", dest="self_seed", action="store_false",
                   help="do not seed the global RNG (leave it to the launcher, as many training stacks do)")
    p.add_argument("--probe", action="store_true", help="add the activation-statistics probe (model.stats)")
    p.add_argument("--fault", default=None)
    p.add_argument("--fault-step", type=int, default=1)
    p.add_argument("--fault-layer", type=int, default=0)
    p.add_argument("--results", default=None, help="write losses (hex floats) and final parameters here (.pt)")
    p.add_argument("--losses", default=None, help="write the per-step losses here (JSON)")
    p.add_argument("--progress", action="store_true", help="print 'step N done' after each step")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    return p.parse_args(argv)


def flip_bit(t: torch.Tensor, flat_index: int, bit: int) -> torch.Tensor:
    """Return t with one bit of one element flipped (through an integer view of the bytes)."""
    out = t.clone()
    ints = out.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]).view(-1)
    ints[flat_index] ^= 1 << bit
    return out


def install_fault(args, model: GPT, state: dict):
    """Patch the model for the chosen fault; `state['step']` is the current step."""
    fault, layer = args.fault, args.fault_layer
    active = lambda: state["step"] >= args.fault_step  # noqa: E731
    block = model.blocks[layer]
    if fault == "forward-bitflip":
        fc = block.mlp.fc
        original = fc.forward
        fc.forward = lambda x: flip_bit(original(x), 3, 7) if active() else original(x)
    elif fault == "functional":
        global residual_add
        plain = residual_add

        def residual_add(x, y):  # noqa: F811
            out = plain(x, y)
            return flip_bit(out, 5, 3) if active() else out
    elif fault == "backward":
        proj = block.attn.proj
        original = proj.forward

        class Scale(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                return flip_bit(g, 2, 9) if active() else g

        proj.forward = lambda x: original(Scale.apply(x))
    elif fault == "embedding-race":
        def corrupt(g):
            if not active():
                return g
            g = g.clone()
            touched = g.abs().sum(1).nonzero().flatten()  # rows of tokens in this batch
            i, j = touched[0], touched[-1]
            g[i] = g[i] + g[j] * 1e-3  # two rows' updates mixed, as a racy scatter-add would
            return g

        model.wte.weight.register_hook(corrupt)
    elif fault == "nondeterministic":
        fc = block.mlp.fc
        original = fc.forward
        # the order in which split-K workers finish: outside every RNG a training run can seed
        schedule = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        chunks = torch.arange(fc.in_features).chunk(max(1, fc.in_features // 2))

        def racy(x):
            if not active():
                return original(x)
            parts = [x[..., idx] @ fc.weight[:, idx].T for idx in chunks]
            order = torch.randperm(len(parts), generator=schedule).tolist()
            out = parts[order[0]]
            for k in order[1:]:
                out = out + parts[k]
            return out + fc.bias

        fc.forward = racy
    elif fault in ("swap", "double-flip"):
        qkv = block.attn.qkv
        original = qkv.forward

        def permuted(x):
            out = original(x)
            if not active():
                return out
            out = out.clone()
            flat = out.view(-1)
            # two query elements of token 1 (token 0 attends to itself only: its softmax hides any
            # change), at the same place in two consecutive 64-bit words
            i = out.shape[-1]
            j = i + 8 // out.element_size()
            if fault == "swap":
                flat[i], flat[j] = flat[j].clone(), flat[i].clone()  # unequal values: pos sees it
                return out
            flat[i] = flip_bit(out, i, 4).view(-1)[i]
            return flip_bit(out, j, 4)  # the same bit in another word: cancels in XOR

        qkv.forward = permuted
    elif fault == "bf16-variance":
        def regressed(norm, exact, x):
            return low_precision_layer_norm(norm, x) if active() else exact(x)

        for norm in model.modules():
            if isinstance(norm, nn.LayerNorm):
                norm.forward = partial(regressed, norm, norm.forward)
    elif fault == "rms-eps":
        def changed(norm, exact, x):
            norm.eps = 1e-5 if active() else 1e-6
            return exact(x)

        for norm in model.modules():
            if isinstance(norm, RMSNorm):
                norm.forward = partial(changed, norm, norm.forward)
    elif fault == "benign-dropout":
        block.mlp.act = nn.Sequential(nn.GELU(), nn.Dropout(0.0))
    elif fault == "benign-probe":
        if model.stats is None:
            sys.exit("--fault benign-probe needs --probe")
        stats = model.stats
        original = stats.forward

        def probe(x):
            stats.low_precision = active()
            return original(x)

        stats.forward = probe
    elif fault not in (None, "grad-accum", "optimizer", "data", "data-order", "rng-shift"):
        sys.exit(f"unknown --fault {fault}")


def batches(args, steps: int):
    g = torch.Generator().manual_seed(args.seed + 1)
    data = torch.randint(0, args.vocab, (steps, args.batch, args.seq + 1), generator=g)
    order = list(range(steps))
    if args.fault == "data-order":
        tail = order[args.fault_step:]
        order = order[:args.fault_step] + tail[1:] + tail[:1]
    if args.fault == "data":
        data[args.fault_step, 0, 0] = (data[args.fault_step, 0, 0] + 1) % args.vocab
    return [data[i] for i in order]


def main(argv=None):
    args = parse_args(argv)
    if args.self_seed:
        torch.manual_seed(args.seed)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    norm = RMSNorm if args.norm == "rms" else nn.LayerNorm
    model = GPT(args.vocab, args.seq, args.width, args.layers, args.heads, norm, args.dropout, args.probe,
                args.attention == "sdpa").to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    state = {"step": 0}
    install_fault(args, model, state)
    if args.fault == "optimizer":
        def wrong_update(opt, *_):  # part of the optimizer's step, for one parameter
            if state["step"] >= args.fault_step:
                with torch.no_grad():
                    model.lm_head.weight.mul_(1.0001)

        optimizer.register_step_post_hook(wrong_update)
    losses = []
    for step, batch in enumerate(batches(args, args.steps)):
        state["step"] = step
        if args.fault == "rng-shift" and step == args.fault_step:
            torch.rand(1)
        x, y = batch[:, :-1], batch[:, 1:]
        if not (args.fault == "grad-accum" and step >= args.fault_step):
            optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if args.progress:
            print(f"step {step} done", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    if args.losses:
        with open(args.losses, "w") as f:
            json.dump({"losses": losses}, f)
    if args.results:
        torch.save({"losses": [float(l).hex() for l in losses],
                    "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}, args.results)
    return losses


if __name__ == "__main__":
    main()
