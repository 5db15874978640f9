"""Tensors no module holds, each stepped by an optimizer of its own made in an order that changes
from run to run (Pyro's `pyro.optim` makes one per `pyro.param` while iterating a set of tensors):
named by their place in the optimizer made first, second, ..., identical reruns diverged and the API
differences listed every optimizer's parameters (helper 42). Where the library names them (Pyro's
param store), that name is theirs and their optimizer's. Pyro is not installed here: its param store
is stood in for by the one method bitguard reads (`param_name`)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import duckdb
import pytest
import torch

import bitguard

NAMES: dict[int, str] = {}  # id(tensor) -> its name in the stand-in param store


class _Store:
    def param_name(self, p):
        return NAMES.get(id(p))


def _train(path, order: str) -> None:
    torch.manual_seed(0)
    params = {"a": torch.zeros(3, requires_grad=True), "b": torch.ones((), requires_grad=True),
              "c": torch.ones(3, requires_grad=True)}
    NAMES.clear()
    NAMES.update({id(p): n for n, p in params.items()})
    x = torch.randn(4, 3)
    optimizers = {}
    with bitguard.record(path, determinism=False):
        for _ in range(3):
            ((x @ params["a"] + params["b"]) ** 2).mean().add(params["c"].sum()).backward()
            for name in order:  # (the order a set of tensors happens to have in this process)
                p = params[name]
                if name not in optimizers:
                    optimizers[name] = torch.optim.Adam([p], lr=0.1)
                optimizers[name].step()
                p.grad = None


@pytest.fixture
def pyro_store(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyro.primitives", SimpleNamespace(get_param_store=_Store))


def test_tensors_a_library_names_are_named_so_and_their_optimizers_too(tmp_path, pyro_store):
    _train(tmp_path / "x", "abc")
    _train(tmp_path / "y", "cab")
    c = bitguard.compare(tmp_path / "x", tmp_path / "y")
    assert c.verdict == "identical", c.first_divergence
    doc = c.to_dict()
    assert doc.get("api_differences") is None, doc.get("api_differences")
    con = duckdb.connect(str(tmp_path / "x" / "rank-0.duckdb"), read_only=True)
    try:
        stepped = {b for (b,) in con.sql("SELECT DISTINCT boundary FROM events WHERE kind = 'step'").fetchall()}
        final = {b for (b,) in con.sql("SELECT DISTINCT boundary FROM events WHERE kind = 'final'").fetchall()}
    finally:
        con.close()
    assert stepped == final == {"pyro.param['a']", "pyro.param['b']", "pyro.param['c']"}, (stepped, final)


def test_without_a_library_name_they_are_named_by_the_optimizers_order(tmp_path):
    """What the stand-in changes: without it the same pair differs by the names alone."""
    _train(tmp_path / "x", "abc")
    _train(tmp_path / "y", "cab")
    assert bitguard.compare(tmp_path / "x", tmp_path / "y").verdict != "identical"
