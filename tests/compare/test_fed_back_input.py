"""A data pivot at a root's later call in a step, after its earlier calls matched, says its input may be
made by the training's code from what those calls returned (helper 74: x-transformers' generate() sampling
at another temperature was blamed on the data with nothing more said); a first call's data pivot does not."""

from __future__ import annotations

import torch
import torch.nn as nn

import bitguard


def _run(path, temperature: float = 1.0, seed: int = 1) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with bitguard.record(path, determinism=False):
        torch.manual_seed(seed)
        x = torch.randint(0, 16, (4, 5))
        loss = nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():  # generation: each call's input is the last one's sample appended
            tokens = torch.tensor([[1, 2, 3]])
            for _ in range(3):
                probs = torch.softmax(net(tokens)[:, -1] / temperature, -1)
                tokens = torch.cat([tokens, torch.multinomial(probs, 1)], 1)


def test_a_later_calls_input_names_the_calls_before_it(tmp_path):
    _run(tmp_path / "a")
    _run(tmp_path / "b", temperature=0.05)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["phase"], fd["blame"], fd["call"]) == ("data", "data", fd["call"]) and fd["call"] >= 1, fd
    detail = (fd["blame_window"] or {}).get("detail", "")
    assert f"called {fd['call']} time" in detail and "what those calls returned" in detail, fd


def test_a_first_calls_data_pivot_says_nothing_of_calls_before(tmp_path):
    _run(tmp_path / "a")
    _run(tmp_path / "b", seed=2)
    fd = bitguard.compare(tmp_path / "a", tmp_path / "b").first_divergence
    assert (fd["phase"], fd["blame"], fd["call"]) == ("data", "data", 0), fd
    assert "what those calls returned" not in ((fd["blame_window"] or {}).get("detail") or ""), fd
