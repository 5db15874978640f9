"""A tiny transformer-like language model whose blocks run under activation checkpointing
(`torch.utils.checkpoint`, non-reentrant by default, `--reentrant` for use_reentrant=True,
`--no-checkpoint` for none: the same training, without recomputation), with
dropout inside the checkpointed blocks (checkpointing restores the RNG state for the recompute;
`--no-preserve-rng` passes preserve_rng_state=False, so a recompute draws other dropout masks than
its forward did), trained for a few steps on CPU.

STACK_FAULT=recompute:step=S flips bit 9 of the first element of blocks.1.mlp.fc's output only
when it is recomputed during backward at step S: the module counts its calls in each step (the
first is the forward, the second the recompute). Its output is saved for the backward of the
activation after it, so the fault changes the gradients, as a fault in recomputation would.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from _fault import flip_bit, spec
from _result import write_result
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.drop(self.mlp(x))


class TinyLM(nn.Module):
    def __init__(self, reentrant: bool | None, preserve_rng: bool = True, vocab=64, d=32, n=2):
        super().__init__()
        self.reentrant = reentrant  # None: no checkpointing
        self.preserve_rng = preserve_rng
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x) if self.reentrant is None else checkpoint(b, x, use_reentrant=self.reentrant,
                                                               preserve_rng_state=self.preserve_rng)
        return self.head(x)


class RecomputeFault:
    """Flips a bit of `module`'s output on its second call of STACK_FAULT's step (its recompute)."""

    def __init__(self, module: nn.Module):
        kind, args = spec()
        self.armed = kind == "recompute"
        self.at = args.get("step", -1)
        self.step = self.calls = 0
        module.register_forward_hook(self._hook)

    def start(self, step: int) -> None:
        self.step, self.calls = step, 0

    def _hook(self, module, inputs, output):
        self.calls += 1
        if self.armed and self.step == self.at and self.calls == 2:
            output = output.clone()
            flip_bit(output)
            return output
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reentrant", action="store_true", help="use_reentrant=True (default: False)")
    ap.add_argument("--no-checkpoint", action="store_true", help="no activation checkpointing")
    ap.add_argument("--no-preserve-rng", action="store_true", help="checkpoint(..., preserve_rng_state=False)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = TinyLM(None if args.no_checkpoint else args.reentrant, preserve_rng=not args.no_preserve_rng)
    fault = RecomputeFault(model.blocks[1].mlp[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        fault.start(step)
        idx = torch.randint(0, 64, (4, 16), generator=data)
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    write_result(model, losses)


if __name__ == "__main__":
    main()
