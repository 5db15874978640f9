"""A tiny GPT-like language model trained for a few steps on CPU, eagerly or under torch.compile.

`--compile model` (the default) trains `torch.compile(model)`, `--compile blocks` compiles each
block in place of itself (`model.blocks[i] = torch.compile(block)`), `--compile inplace` calls
`model.compile()`, `--compile none` trains eagerly: the same model, the same graph of operations,
so eager and compiled runs can be compared. `--backend` picks the dynamo backend (inductor, the
default, generates the code a user's run would; `eager` only traces, for quick tests).

STACK_FAULT=module:step=S flips bit 9 of the first element of blocks.1.mlp's output at step S.
The flip is part of the model in every run (a `torch.where` on a mask buffer that is all False
but at the faulty step), so a faulty compiled run compiles the same graphs as a clean one.

`--counters FILE` writes dynamo's counters (graphs compiled, graph breaks, recompiles) as JSON:
the test holds a recorded run's to a plain run's.
"""

import argparse
import json
import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # (before torch: 2 cores, no compile workers)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _fault import spec  # noqa: E402
from _result import write_result  # noqa: E402

BATCH, T, D, VOCAB = 4, 15, 32, 64


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d, d)
        # the fault: True where an output element gets bit 9 flipped (never, but at STACK_FAULT's step)
        self.register_buffer("fault", torch.zeros(BATCH, T, d, dtype=torch.bool), persistent=False)

    def forward(self, x):
        y = self.proj(self.act(self.fc(x)))
        flipped = (y.detach().view(torch.int32) ^ (1 << 9)).view(torch.float32)
        return torch.where(self.fault, flipped, y)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = MLP(d)

    def forward(self, x):
        h = self.ln(x)
        x = x + self.attn(h)
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(self, vocab=VOCAB, d=D, n=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*(Block(d) for _ in range(n)))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.blocks(self.emb(idx)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--compile", choices=["model", "blocks", "inplace", "none"], default="model")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--counters", help="write dynamo's counters here as JSON")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True), as bitguard record's determinism controls set it "
                         "(inductor then generates another embedding backward: other float sums than the default's)")
    args = ap.parse_args()
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    kind, fault = spec()
    fault_step = fault.get("step", -1) if kind == "module" else -1
    torch.manual_seed(0)
    model = TinyLM()
    mask = model.blocks[1].mlp.fault
    if args.compile == "model":
        run = torch.compile(model, backend=args.backend)
    elif args.compile == "blocks":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=args.backend)
        run = model
    elif args.compile == "inplace":
        model.compile(backend=args.backend)
        run = model
    else:
        run = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        idx = torch.randint(0, VOCAB, (BATCH, T + 1), generator=data)
        mask[0, 0, 0] = step == fault_step
        logits = run(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    write_result(model, losses)
    if args.counters:
        from torch._dynamo.utils import counters

        with open(args.counters, "w") as f:
            json.dump({group: dict(values) for group, values in counters.items()}, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
