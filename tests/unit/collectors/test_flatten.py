"""Outputs in any pytree container keep their event and their tensors (collectors/hooks.py
`flatten`): a node registered without key paths, as transformers 4.46 registered its
ModelOutput (CausalLMOutputWithPast), one whose key function raises something else, a dict
subclass pytree does not know, and a dataclass inside a keyless node."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import polars as pl
import pytest
import torch
from torch.utils import _pytree as pytree

import bitguard
from bitguard.backend.ingest import load_rank, open_run
from bitguard.collectors.flatten import NotFlattened, flatten


class KeylessOutput(OrderedDict):
    """Like transformers 4.46's ModelOutput: an OrderedDict registered with pytree without
    `flatten_with_keys_fn`, so `tree_flatten_with_path` raises ValueError on it."""


pytree.register_pytree_node(
    KeylessOutput, lambda o: (list(o.values()), list(o.keys())),
    lambda values, keys: KeylessOutput(zip(keys, values)))


class Pair:
    """A node that is no Mapping: registered without keys, its key function absent."""

    def __init__(self, first, second):
        self.first, self.second = first, second


pytree.register_pytree_node(Pair, lambda p: ([p.first, p.second], None), lambda values, _: Pair(*values))


class Broken:
    """A node whose key function raises a RuntimeError, not the ValueError of a missing one."""

    def __init__(self, t):
        self.t = t


def _refuse_keys(node):
    raise RuntimeError("key paths refused by design")


pytree.register_pytree_node(Broken, lambda b: ([b.t], None), lambda values, _: Broken(*values),
                            flatten_with_keys_fn=_refuse_keys)


@dataclass
class Extra:
    hidden: torch.Tensor


class Plain(dict):
    """A dict subclass: pytree treats it as a leaf."""


def test_a_node_registered_without_key_paths_is_walked_by_its_keys():
    loss, logits = torch.tensor(1.0), torch.ones(2, 3)
    with pytest.raises(ValueError, match="flatten_with_keys_fn"):
        pytree.tree_flatten_with_path(KeylessOutput(loss=loss, logits=logits))
    flat = flatten(KeylessOutput(loss=loss, logits=logits, past=((logits * 2, logits * 3),)))
    assert type(flat) is not NotFlattened
    assert [p for p, _ in flat] == ["['loss']", "['logits']", "['past'][0][0]", "['past'][0][1]"]
    assert flat[0][1] is loss and flat[1][1] is logits


def test_a_keyless_node_inside_a_container_and_a_dataclass_inside_a_keyless_node_keep_their_tensors():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    flat = flatten({"out": Pair(a, Extra(b)), "more": [c]})
    assert type(flat) is not NotFlattened
    assert [t for _, t in flat] == [a, b, c] and [p for p, _ in flat] == [
        "['out']<leaf 0>", "['out']<leaf 1>.hidden", "['more'][0]"]


def test_a_key_function_that_raises_something_else_falls_back_to_positions():
    t = torch.ones(2)
    flat = flatten((Broken(t), t * 2))
    assert type(flat) is not NotFlattened and [p for p, _ in flat] == ["[0]<leaf 0>", "[1]"]


def test_a_dict_subclass_pytree_does_not_know_is_walked():
    t = torch.ones(2)
    flat = flatten((Plain(x=t), 1))
    assert [(p, x) for p, x in flat] == [("[0]['x']", t)]


class LazyStackedMapping(Mapping):
    """As tensordict's LazyStackedTensorDict: items kept apart (`tensordicts`); its `items()` stack each key
    every item holds, and raise when they cannot be stacked; pytree has no key paths for it."""

    def __init__(self, parts):
        self.tensordicts = parts

    def keys(self, include_nested=False, leaves_only=False):
        return [k for k in self.tensordicts[0] if all(k in p for p in self.tensordicts)]

    def __getitem__(self, key):
        return torch.stack([p[key] for p in self.tensordicts])

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self.keys())


class Part(dict):
    def keys(self, include_nested=False, leaves_only=False):
        return list(super().keys())


def test_a_lazy_stack_is_walked_item_by_item_where_its_items_differ():
    """Helper 62: a LazyStackedTensorDict whose items hold different keys gave only the keys all hold (an
    entry one item holds, which the model read, went unrecorded, unsaid); one of ragged items raised, and
    identical runs were never certified. A stack of items alike keeps its stacked entries."""
    x0, x1, w = torch.zeros(3), torch.ones(3), torch.full((1,), 2.0)
    flat = flatten((LazyStackedMapping([Part(x=x0), Part(x=x1, w=w)]),))
    assert type(flat) is not NotFlattened
    assert [(p, t) for p, t in flat] == [("[0][0]['x']", x0), ("[0][1]['x']", x1), ("[0][1]['w']", w)]
    ragged = torch.ones(5)
    flat = flatten((LazyStackedMapping([Part(x=x0), Part(x=ragged)]),))
    assert type(flat) is not NotFlattened and [(p, t) for p, t in flat] == [("[0][0]['x']", x0), ("[0][1]['x']", ragged)]
    flat = flatten((LazyStackedMapping([Part(x=x0), Part(x=x1)]),))
    assert [p for p, _ in flat] == ["[0]['x']"] and torch.equal(flat[0][1], torch.stack([x0, x1]))


class _Returns(torch.nn.Module):
    def __init__(self, wrap):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.wrap = wrap

    def forward(self, x):
        y = self.lin(x)
        return self.wrap(y)


@pytest.mark.parametrize("wrap", [
    lambda y: KeylessOutput(loss=y.sum(), logits=y),
    lambda y: Pair(y.sum(), y),
    lambda y: (Broken(y.sum()), y),
], ids=["keyless-mapping", "keyless-node", "raising-keys"])
def test_a_root_returning_such_a_container_keeps_its_forward_and_backward_events(tmp_path, wrap):
    torch.manual_seed(0)
    model = _Returns(wrap)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bitguard.record(tmp_path / "run", determinism=False):
        for _ in range(2):
            out = model(torch.randn(2, 3))
            loss = next(iter(out.values())) if isinstance(out, OrderedDict) else (
                out.first if isinstance(out, Pair) else out[0].t)
            loss.backward()
            opt.step()
            opt.zero_grad()
    events, tensors, _ = load_rank(open_run(tmp_path / "run"), 0)
    root = events.filter(pl.col("boundary") == "_Returns")
    for step in (0, 1):
        phases = root.filter(pl.col("step") == step)["phase"].to_list()
        assert {"data", "forward", "backward"} <= set(phases), (step, phases)
    forward = root.filter((pl.col("phase") == "forward") & (pl.col("step") == 0))["seq"][0]
    outputs = tensors.filter((pl.col("seq") == forward) & (pl.col("role") == "output"))
    assert outputs.height == 2 and outputs["unobserved"].null_count() == 2, outputs


class _Layer:
    def __init__(self, keys):
        self.keys = keys


class _Cache:
    """As transformers' DynamicCache: no container pytree knows, its tensors in objects it holds."""

    def __init__(self, *keys):
        self.layers = [_Layer(k) for k in keys]
        self.seen_tokens = 3


def test_the_tensors_an_object_among_the_arguments_holds_are_flattened_not_dropped():
    """helper 14 (peft prefix tuning): a DynamicCache among a call's arguments had no row at all, so
    a difference in it was blamed on the code that read it."""
    a, b = torch.zeros(2), torch.ones(3)
    flat = flatten({"x": a, "cache": _Cache(a, b), "mode": "train", "layer": torch.nn.Linear(2, 2)})
    assert type(flat) is list and [(p, t.shape) for p, t in flat] == [
        ("['x']", a.shape), ("['cache'].layers[0].keys", a.shape), ("['cache'].layers[1].keys", b.shape)], flat
    # what cannot be walked whole (a set has no order) is said so, with what could be read
    odd = _Cache(a)
    odd.extra = {b}
    flat = flatten((a, odd))
    assert type(flat) is NotFlattened and [p for p, _ in flat] == ["[0]", "[1].layers[0].keys"]
    assert flat.path == "[1]" and "set" in flat.reason, flat.reason


def test_an_object_walked_already_is_passed_over_where_the_collector_says_so():
    """The collector walks an object where a step first meets it: transformers hands one cache to
    every layer, and walking it at each would cost rows quadratic in the layers."""
    a = torch.zeros(2)
    cache, walked = _Cache(a), {}
    assert [p for p, _ in flatten({"c": cache}, walked=walked)] == ["['c'].layers[0].keys"]
    assert flatten({"c": cache}, walked=walked) == [] and flatten((a, cache), walked=walked) == [("[0]", a)]
    assert [p for p, _ in flatten({"c": _Cache(a)}, walked=walked)] == ["['c'].layers[0].keys"]  # another object
    assert [p for p, _ in flatten({"c": cache})] == ["['c'].layers[0].keys"]  # (without `walked`: always)
