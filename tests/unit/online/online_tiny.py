"""A tiny GPT and its training steps, for the online tests (in process: no subprocess recording)."""

import pytest
import torch
import torch.nn.functional as F

from bitguard.sample_traces import tinygpt


def build(seed: int = 0, width: int = 32, layers: int = 2):
    torch.manual_seed(seed)
    model = tinygpt.GPT(64, 16, width, layers, 4, torch.nn.LayerNorm, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 64, (4, 17))
    return model, opt, data


def train(model, opt, data, steps: int = 3) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def tiny():
    return build
