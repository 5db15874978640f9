"""A tiny transformer-like language model trained eagerly for a few steps on CPU (AdamW, dropout),
optionally under bf16 autocast (`--autocast`). STACK_FAULT=module:step=S flips a bit of
blocks.1.mlp's output at step S."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from _fault import Fault
from _result import write_result


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.drop(self.mlp(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=32, n=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--autocast", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = TinyLM()
    fault = Fault(model.blocks[1].mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        fault.step = step
        idx = torch.randint(0, 64, (4, 16), generator=data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 64), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    write_result(model, losses)


if __name__ == "__main__":
    main()
