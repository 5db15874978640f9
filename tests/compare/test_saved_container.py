"""A save of the same tensors in another container (`dict(model.state_dict())` against the OrderedDict
`state_dict()` returns) pairs with the other run's save and is compared by its tensors (helper 77: the
wrong weights saved in a plain dict were "different tensors (roles, shapes or dtypes)", and every digest
was said to be equal)."""

from __future__ import annotations

import torch

import bitguard

from .recorded_sgd import record_sgd


def _run(tmp_path, name: str, container, edit: float = 0.0) -> None:
    def save(model, step, micro):
        if step == 1:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            state["0.bias"] += edit
            torch.save(container(state), tmp_path / f"{name}.pt")

    record_sgd(tmp_path / name, lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(),
                                                            torch.nn.Linear(4, 1)), after_backward=save)


def test_a_save_in_another_container_is_compared_by_its_tensors(tmp_path):
    from collections import OrderedDict

    _run(tmp_path, "a", OrderedDict)
    _run(tmp_path, "b", dict)
    _run(tmp_path, "c", dict, edit=1e-3)
    same = bitguard.compare(tmp_path / "a", tmp_path / "b")
    assert same.verdict == "identical", same.first_divergence
    assert any(r["code"] == "retyped" and "OrderedDict in A, dict in B" in r["message"]
               for r in same.certification_reasons()), same.certification_reasons()
    fd = bitguard.compare(tmp_path / "a", tmp_path / "c").first_divergence
    assert (fd["kind"], fd["blame"], fd["step"]) == ("saved", "source", 1), fd
    assert [t["path"] for t in fd["tensors"] if t["differs"]] == ["['0.bias']"], fd["tensors"]
