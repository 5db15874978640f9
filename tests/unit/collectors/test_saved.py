"""What the training saves (collectors/saved.py): the tensors of a saved object are found in a fixed
order and named by where they are; the save functions are wrapped so that each save the user's code
makes is seen once, before it writes, and the save itself is untouched."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
import torch.nn as nn

from bitguard.collectors import saved
from bitguard.collectors.saved import SaveWatch, tensors_in
from bitguard.schema import KEYS_MARK, NAME_MARK
from bitguard.timed import clock_at, clock_of


def _values_of(obj, **kwargs):
    """`tensors_in`, without the rows of dicts' keys (schema 12: their own test below)."""
    pairs, why = tensors_in(obj, **kwargs)
    return [(p, t) for p, t in pairs if not p.endswith(KEYS_MARK)], why


def test_a_checkpoint_s_tensors_numbers_and_strings_are_named_by_where_they_are_and_times_and_paths_left_out():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "time": 1.5e9,
                  "note": "x", "act": "gelu", "saved_to": "/runs/a/ckpt.pt", "output_dir": "runs", "at": repr(object()),
                  "extra": [torch.ones(1), (torch.zeros(2),)]}
    checkpoint["again"] = checkpoint  # a container holding itself is walked once
    pairs, truncated = _values_of(checkpoint)
    paths = [p for p, _ in pairs]
    assert truncated is None
    # a save's dicts in the order of their keys (helper 42: Pyro saves its optimizers' states in an order that
    # changes from run to run)
    assert [p for p in paths if p.startswith("['model']")][:3] == [
        "['model']['0.bias']", "['model']['0.weight']", "['model']['1.bias']"]
    assert paths == sorted(paths, key=lambda p: p.split("]")[0]), paths
    assert "['optimizer']['state'][0]['exp_avg']" in paths and "['extra'][1][0]" in paths
    assert not any("time" in p or "again" in p or "saved_to" in p or "output_dir" in p or "'at'" in p for p in paths)
    assert "['act'] (python str)" in paths and "['note'] (python str)" not in paths  # (schema 11: saved_string_compared)
    assert all(isinstance(t, torch.Tensor) for _, t in pairs)
    # its numbers are taken (helper 13: a Lightning checkpoint that would resume at another learning rate
    # compared identical; helper 17: an Opacus accountant's history and Python's RNG state did too)
    assert dict(pairs)["['epoch'] (python int)"].item() == 3
    lr = dict(pairs)["['optimizer']['param_groups'][0]['lr'] (python float)"]
    assert lr.dtype == torch.float64 and lr.item() == 1e-3
    assert "['optimizer']['param_groups'][0]['amsgrad'] (python bool)" in paths
    # a module saved whole: its parameters and buffers; a tensor saved alone
    assert [p for p, _ in tensors_in(model)[0]][:2] == [".0.weight", ".0.bias"]
    assert [p for p, _ in tensors_in(torch.ones(2))[0]] == ["[]"]
    # NumPy arrays of numbers are taken (an object array is not); a long list of ints is one tensor
    pairs, truncated = _values_of({"rng": ("MT19937", np.arange(4, dtype=np.uint32)), "objects": np.array([None]),
                                   "indices": list(range(2 * saved.MAX_VISITS))})
    assert [p for p, t in pairs] == ["['indices'] (python int)", "['rng'][0] (python str)", "['rng'][1]"]
    assert truncated is None and pairs[2][1].tolist() == [0, 1, 2, 3] and pairs[0][1].shape == (2 * saved.MAX_VISITS,)


def test_every_number_of_a_save_is_taken_but_times_and_among_a_call_s_arguments_only_an_optimizer_s():
    import random

    state = {"accountant": {"history": [(1.1, 0.01, 5)], "mechanism": "rdp"}, "scaler": {"scale": np.float32(2.0)},
             "python": random.getstate(), "seed": 2 ** 70, "train_runtime": 3.5, "stats": {"samples_per_second": 9.0},
             "saved_at": 1.7e9, "last_update": 4, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}}
    numbers = dict(_values_of(state)[0])
    assert [p for p in numbers] == [
        "['accountant']['history'][0][0] (python float)", "['accountant']['history'][0][1] (python float)",
        "['accountant']['history'][0][2] (python int)", "['last_update'] (python int)",
        "['optimizer']['param_groups'][0]['lr'] (python float)", "['python'][0] (python int)",
        "['python'][1] (python int)", "['scaler']['scale'] (python float)", "['seed'] (python int)"]
    assert numbers["['python'][1] (python int)"].tolist() == list(state["python"][1])  # the generator's 625 words
    assert numbers["['seed'] (python int)"].dtype == torch.uint8  # (past 64 bits: its digits)
    assert clock_of("['time_elapsed']") and clock_of(".tokens_per_sec") and not clock_of("['second_moment']")
    among_arguments = [p for p, _ in tensors_in(state, save=False)[0]]  # (flatten.held_by)
    assert among_arguments == ["['optimizer']['param_groups'][0]['lr'] (python float)"]


def test_an_object_kept_under_a_time_is_a_time_but_what_its_attributes_name():
    """Helper 59: mmengine's MessageHub saves each logged scalar as a HistoryBuffer object, the values in
    its `_log_history`: under `train/time` wall-clock durations, which made every two runs of an mmengine
    training with a checkpoint differ. An attribute that names no time, of an object under a duration,
    is that duration's (its `.seed` too); a dict's key keeps its own, and so does an object under another key."""

    class History:
        def __init__(self, values):
            self._log_history, self._count, self.seed = np.array(values), len(values), 7

    state = {"log_scalars": {"train/time": History([0.31, 0.29]), "train/loss": History([1.5, 1.2])},
             "runtime": {"seed": 3}}
    paths = [p for p, _ in _values_of(state)[0]]
    assert paths == ["['log_scalars']['train/loss']._log_history",
                     "['log_scalars']['train/loss']._count (python int)",
                     "['log_scalars']['train/loss'].seed (python int)",
                     "['runtime']['seed'] (python int)"], paths
    assert clock_at("['log_scalars']['train/time']._log_history") == "duration"

    class Stated(History):  # (mmengine's HistoryBuffer defines __getstate__: its state's keys are attributes)
        def __getstate__(self):
            return dict(self.__dict__)

    state = {"log_scalars": {"train/time": Stated([0.31]), "train/loss": Stated([1.5])}}
    paths = [p for p, _ in _values_of(state)[0]]
    assert all("train/loss" in p for p in paths) and len(paths) == 3, paths
    assert clock_at("['log_scalars']['train/time'].__getstate__()['_log_history']") == "duration"
    assert clock_at("['runtime']['seed']") is None and clock_at("['log_scalars']['train/loss']._count") is None


def test_a_module_among_a_call_s_arguments_is_not_walked_but_a_saved_one_is():
    """Helper 19: Keras' symbolic tensors hold the layer that made them, whose inputs hold theirs: a
    call's argument walked into modules ever deeper, past the depth limit, and every trusted-mode
    Keras run was inconclusive. A module's weights are its own events'; a save still holds them."""

    class Symbolic:  # (as a KerasTensor: the layer that made it, which holds its own input)
        def __init__(self, layer):
            self.history = (layer, 0, 0)

    symbol = None
    for _ in range(20):
        layer = nn.Linear(2, 2)
        layer.inputs = symbol
        symbol = Symbolic(layer)
    assert tensors_in(symbol, depth=8, save=False) == ([], None)
    pairs, why = _values_of({"model": nn.Linear(2, 2)})
    assert [p for p, _ in pairs][:2] == ["['model'].weight", "['model'].bias"] and why is None


def test_an_object_too_big_to_walk_is_marked_not_taken_whole(monkeypatch):
    monkeypatch.setattr(saved, "MAX_TENSORS", 3)
    pairs, truncated = tensors_in([torch.ones(1) for _ in range(5)])
    assert len(pairs) == 3 and "not looked at" in truncated


@dataclasses.dataclass(slots=True)
class _Slotted:
    ema: torch.Tensor


class _Stated:
    def __init__(self):
        self.kept = torch.ones(2)

    def __getstate__(self):  # pickle writes this, not __dict__
        return {"half": self.kept.half()}


def test_what_pickle_writes_is_walked_and_what_cannot_be_is_named():
    """Helpers 11 and 12: a module's own attributes, slots and a class's __getstate__ hold tensors
    pickle writes; a set has no order, and an object deeper or longer than the limits is not walked
    whole: each of those was passed over without a word, and a difference there compared identical."""
    model = nn.Linear(2, 2)
    model.scale = torch.ones(3)
    model.shadow = {"w": torch.zeros(1)}
    paths = [p for p, _ in _values_of(model)[0]]
    assert paths == [".weight", ".bias", ".in_features (python int)", ".out_features (python int)", ".scale",
                     ".shadow['w']"]
    assert [p for p, _ in _values_of({"s": _Slotted(torch.ones(1))})[0]] == ["['s'].ema"]
    (path, t), = _values_of(_Stated())[0]
    assert path == ".__getstate__()['half']" and t.dtype == torch.float16
    # each __getstate__() is a new dict: one walked and freed must not hide the next (its id is reused)
    assert [p for p, _ in _values_of([_Stated() for _ in range(3)])[0]] == [
        f"[{i}].__getstate__()['half']" for i in range(3)]
    assert "no order" in tensors_in({"s": {torch.ones(1)}})[1]
    deep = torch.ones(1)
    for _ in range(saved.MAX_DEPTH + 2):
        deep = {"d": deep}
    assert "deep" in tensors_in(deep)[1]


def test_what_a_class_s_own_reduce_writes_is_walked_and_a_graph_module_s_graph_is_not():
    """Helper 79: a checkpoint holding a torch.Generator (a sampler's) or NumPy's Generator seeded differently
    compared identical: C types with no `__dict__` (NumPy's `__getstate__` gives None), whose state only their
    `__reduce__` writes (a frozenset of numbers and a complex number were passed over too); and a model holding a torch.fx GraphModule (e3nn's) saved whole was inconclusive,
    its graph "more than 32 containers deep", which GraphModule's `__reduce__` leaves out."""
    import collections

    def state(obj):
        return {p: t.clone() for p, t in _values_of({"kept": obj})[0]}

    for make in (lambda seed: torch.Generator().manual_seed(seed), np.random.default_rng,
                 lambda seed: collections.deque([float(seed)], maxlen=3), lambda seed: frozenset({float(seed), "x"}),
                 lambda seed: complex(seed, 1)):
        one, same, other = state(make(1)), state(make(1)), state(make(2))
        assert one and one.keys() == same.keys() == other.keys(), one
        assert all(torch.equal(one[p], same[p]) for p in one)
        assert not all(torch.equal(one[p], other[p]) for p in one), one
    chain = nn.Sequential(nn.Linear(2, 2), *(nn.Tanh() for _ in range(saved.MAX_DEPTH + 4)))
    model = nn.Sequential(torch.fx.symbolic_trace(chain))
    pairs, why = tensors_in(model)
    assert why is None and [p for p, _ in pairs][:2] == [".0.0.weight", ".0.0.bias"]


def test_a_long_list_is_marked_where_it_is_cut(monkeypatch):
    monkeypatch.setattr(saved, "MAX_ITEMS", 10)
    assert "more than 10 items" in tensors_in({"items": [0] * 11 + [torch.ones(1)]})[1]


def test_each_save_of_the_user_is_seen_once_and_recorded_once_it_returned(tmp_path):
    seen, done, original = [], [], torch.save

    def prepare(boundary, obj):
        seen.append((boundary, type(obj).__name__))
        return lambda: done.append(boundary)

    watch = SaveWatch(prepare).install()
    try:
        buffer = io.BytesIO()
        torch.save({"w": torch.ones(2)}, buffer)
        assert seen == [("torch.save", "dict")] and done == ["torch.save"]
        assert torch.equal(torch.load(io.BytesIO(buffer.getvalue()))["w"], torch.ones(2))  # written as ever
        torch.serialization.save(torch.ones(1), io.BytesIO())  # (the same function, reached by its module)
        import safetensors.torch as st

        st.save_model(model=nn.Linear(2, 2), filename=str(tmp_path / "m.safetensors"))  # (keywords; one event)
        st.save_file(tensors={"a": torch.ones(1)}, filename=str(tmp_path / "a.safetensors"))
        with pytest.raises(RuntimeError):  # a save that fails wrote nothing: not recorded
            torch.save(torch.ones(1), tmp_path / "no" / "such" / "dir.pt")
    finally:
        watch.remove()
    assert seen == [("torch.save", "dict"), ("torch.save", "Tensor"), ("safetensors.save_model", "Linear"),
                    ("safetensors.save_file", "dict"), ("torch.save", "Tensor")]
    assert done == ["torch.save", "torch.save", "safetensors.save_model", "safetensors.save_file"]
    torch.save(torch.ones(1), io.BytesIO())
    assert len(seen) == 5 and torch.save is original  # removed: the original is back


def test_a_scheduler_s_state_holds_its_numbers():
    opt = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    opt.step()
    sched.step()
    numbers = {p: t.item() for p, t in _values_of({"scheduler": sched.state_dict(), "seen_at": 1.5e9})[0]}
    assert numbers["['scheduler']['_last_lr'][0] (python float)"] == 0.05
    assert numbers["['scheduler']['last_epoch'] (python int)"] == 1 and not any("seen_at" in p for p in numbers)


def test_what_a_setting_names_and_a_dict_s_keys_are_taken():
    """Helper 25: a save's enum members (the HF Trainer's `lr_scheduler_type`), dtypes, classes and
    functions held as settings, NumPy strings, and the keys of a dict (`label2id` with two labels
    swapped has the same values) compared identical when they differed (schema 12)."""
    import enum

    class Schedule(str, enum.Enum):
        COSINE = "cosine"
        LINEAR = "linear"

    def names(**settings):
        return dict(tensors_in(settings)[0])

    base = dict(schedule=Schedule.COSINE, dtype=torch.bfloat16, act=nn.GELU, fn=torch.tanh, np_dtype=np.dtype("f4"),
                label2id={"cat": 0, "dog": 1}, labels=np.array(["cat", "dog"]), label=np.str_("cat"))
    got = names(**base)
    assert {p for p in got if p.endswith((NAME_MARK, KEYS_MARK))} == {
        f"['schedule']{NAME_MARK}", f"['dtype']{NAME_MARK}", f"['act']{NAME_MARK}", f"['fn']{NAME_MARK}",
        f"['np_dtype']{NAME_MARK}", KEYS_MARK, f"['label2id']{KEYS_MARK}"}
    assert "['labels'][0] (python str)" in got and "['label'] (python str)" in got
    assert saved.name_of(Schedule.COSINE) == "test_what_a_setting_names_and_a_dict_s_keys_are_taken.<locals>." \
        "Schedule.COSINE" and saved.name_of(nn.GELU) == "torch.nn.modules.activation.GELU"
    for change in (dict(schedule=Schedule.LINEAR), dict(dtype=torch.float16), dict(act=nn.SiLU), dict(fn=torch.sigmoid),
                   dict(np_dtype=np.dtype("f8")), dict(label2id={"dog": 0, "cat": 1}),
                   dict(labels=np.array(["cat", "owl"])), dict(label=np.str_("owl"))):
        other = names(**{**base, **change})
        assert other.keys() == got.keys(), change
        assert any(not torch.equal(other[p], got[p]) for p in got), change
    assert all(torch.equal(names(**base)[p], t) for p, t in got.items())  # the same in another run
    # a dict's keys that are places, times or paths are not taken, nor any under a place's key
    assert f"['d']{KEYS_MARK}" not in names(d={"/data/a.bin": 1, "2026-12-06 04:00": 2})
    assert f"['output_dir']{KEYS_MARK}" not in names(output_dir={"a": 1})


def test_a_key_naming_a_place_is_no_key_of_a_saved_dict():
    """As the strings under it are left out (`outdir`, `_name_or_path`), so is the key from its dict's keys:
    a config that gains the folder it was loaded from is the same config (helper 43)."""
    def keys(obj):
        return [t.tolist() for p, t in tensors_in(obj)[0] if p.endswith(KEYS_MARK)]

    assert keys({"lr": 0.1, "outdir": "runs/a", "_name_or_path": "ckpt"}) == keys({"lr": 0.1})
    assert keys({"lr": 0.1, "act": "gelu"}) != keys({"lr": 0.1})


def test_the_strings_of_a_dict_by_index_are_compared_as_a_list_s():
    """Helper 61: a detector's class names kept as `{0: 'red', 1: 'green'}` (ultralytics' `model.names`,
    saved in best.pt): two names swapped compared identical, where the same names as a list differed."""
    pairs = dict(_values_of({"names": {0: "red", 1: "green"}, "by_key": {"a": "red"}})[0])
    assert [p for p in pairs] == ["['names'][0] (python str)", "['names'][1] (python str)"], list(pairs)
    swapped = dict(_values_of({"names": {0: "green", 1: "red"}})[0])
    assert not torch.equal(pairs["['names'][0] (python str)"], swapped["['names'][0] (python str)"])


def test_a_pickled_optimizers_state_keyed_by_its_parameters_is_walked_in_their_order():
    """Helper 75 (skorch): `torch.save` of an LR scheduler, which holds its optimizer, whose momentum state
    is a dict keyed by the parameters: sorting those keys compared tensors of two shapes (a RuntimeError), so
    the save "could not be looked into" and the run was inconclusive."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    pairs, why = _values_of({"sched": torch.optim.lr_scheduler.StepLR(opt, step_size=1)})
    assert why is None, why
    momenta = [t for p, t in pairs if p.endswith("['momentum_buffer']")]
    assert [tuple(t.shape) for t in momenta] == [tuple(p.shape) for p in model.parameters()], [p for p, _ in pairs]
    assert saved.in_key_order({"b": 1, "a": 2, 1: 3}) == [(1, 3), ("a", 2), ("b", 1)]  # (keys of one type by value)


class _Rep:
    """An escnn Representation in small: a name it prints, an array it holds."""

    def __init__(self, name: str, scale: float):
        self.name, self.basis = name, np.eye(2) * scale

    def __repr__(self):
        return f"C4|[{self.name}]"


def test_a_set_of_objects_that_print_differently_is_walked_in_that_order():
    """Helper 82: escnn's GeometricTensor, every module's output, holds a set of representations: two unchanged
    recordings were inconclusive ("a set of tensors or objects: no order"). Objects that each print differently,
    with no memory address, are walked in the order of what they print; others are still said unordered."""
    one = _values_of({_Rep("b", 1.0), _Rep("a", 1.0)}, save=False)
    other = _values_of({_Rep("a", 1.0), _Rep("b", 2.0)}, save=False)
    assert one[1] is None and [p for p, _ in one[0]] == ["[sorted][0].basis", "[sorted][1].basis"], one
    assert torch.equal(one[0][0][1], other[0][0][1]) and not torch.equal(one[0][1][1], other[0][1][1])
    assert "no order" in tensors_in({object(), object()})[1]
