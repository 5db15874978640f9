"""What the training saves: the tensors `torch.save` (also as `torch.serialization.save`),
safetensors' `save_file`, `save_model` and `save`, and torch.distributed.checkpoint's `save`,
`async_save` and `save_state_dict` are given, each call a `saved` event (hooks.py records it). A
checkpoint is what a training is run for, and some of what it holds is computed where no module
call or optimizer step meets it (an EMA made after the last step, a model averaged or converted
before it is written): without this a different saved file could compare identical.

`tensors_in(obj)` finds the tensors of a saved object in a fixed order, each named by where it is
(`['ema']['fc1.weight']`, `[0]`, `.fc1.weight` of a module saved whole): dicts in their order, lists
and tuples, modules' parameters, buffers and other attributes, plain objects' attributes and slots,
what a class's own `__getstate__` gives pickle, `MAX_DEPTH` levels down; NumPy arrays of numbers
are taken as the tensors of their memory. A saved object's Python numbers are taken too, each a
0-d tensor whose path ends in NUMBER_MARK (a long list or tuple of ints, as `random.getstate()`, is
one 1-d tensor): a checkpoint that would resume at another learning rate, privacy budget, loss
scale or random state is a different checkpoint. So are its strings that mean something to the
training (schema 11: `saved_string_compared`), each as a 64-bit hash whose path ends in STRING_MARK
(a long list or tuple of them, a vocabulary, as one 1-d tensor): those in a list or tuple (class
names: an exported model whose class names differ labels its predictions differently) and those
under a key naming an activation, a type, a mode, a token, a label... (_MEANING_WORDS). Left out:
a path, a URL, a date, a UUID, a hex id or an address, the strings under a key that names a place
(`output_dir`, `outdir`, `hostname`, `run_name`), other names (`experiment`, `wandb_id`: helper 25),
pathlib objects, and the numbers and strings under a key
that names a time (bitguard/timed.py: `time_elapsed`, `train_runtime`, `samples_per_second`,
`saved_at`), which differ from run to run by design. Among a call's
arguments (`save=False`, flatten.py) only an optimizer's or an LR scheduler's state has its
numbers taken (`training_state`), and a module is not walked (its weights are its own events').
What it cannot walk whole (a
set, which has no order; an object deeper or bigger than the limits) is named as the reason some
tensors may be missing: the event then holds an unobserved row, and the run is not certified.

`SaveWatch` wraps the save functions while a recording runs (torch.distributed.checkpoint when it is
imported: importing it costs a second); a save that torch's own code makes (distributed
checkpointing writes each item with `torch.save`) or one made inside another save is not an event
of its own. A forked child's saves, which it cannot record, are written down for its parent
(`note_child_save`, `child_saves`). Knows nothing of events or digests.
"""

from __future__ import annotations

import enum
import hashlib
import importlib.abc
import importlib.util
import inspect
import os
import re
import sys
import threading
import types
from functools import lru_cache
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from bitguard.collectors.patching import Patch, bound_elsewhere
from bitguard.schema import KEYS_MARK, NAME_MARK, NUMBER_MARK, STRING_MARK
from bitguard.timed import clock_below, compared

MAX_DEPTH = 32  # containers looked into below the saved object
MAX_TENSORS = 100_000  # tensors taken from one saved object
MAX_ITEMS = 1_000_000  # items of one container looked at
MAX_VISITS = 1_000_000  # values looked at in one saved object (an object holding a dataset is not walked whole)
_TORCH = torch.__name__ + "."
SCALARS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType, types.FunctionType,
            types.MethodType, types.BuiltinFunctionType, torch.dtype, torch.device)
_MODULE_OWN = frozenset(torch.nn.Module().__dict__)  # what every module holds (its parameters, hooks, ...)
_DCP = "torch.distributed.checkpoint"
_SAVERS = {  # module -> (attribute, boundary) of the functions wrapped there
    "torch": (("save", "torch.save"),),
    "torch.serialization": (("save", "torch.save"),),
    "safetensors.torch": (("save_file", "safetensors.save_file"), ("save_model", "safetensors.save_model"),
                          ("save", "safetensors.save")),
    _DCP: (("save", "dcp.save"), ("async_save", "dcp.async_save"), ("save_state_dict", "dcp.save_state_dict")),
    _DCP + ".state_dict_saver": (("save", "dcp.save"), ("async_save", "dcp.async_save"),
                                 ("save_state_dict", "dcp.save_state_dict")),
}


PACKED_INTS = 16  # a list or tuple of at least this many ints (an RNG state) is one tensor
# Strings not compared: under a key with one of these words (a folder, a file's path, a host, a run's
# name), and those with a slash (a path, a URL), a date or time (ISO, or as strftime and log names
# write it), a UUID, a long hex id, or a memory address (`<object at 0x7f...>`): they differ from
# run to run by design.
_PLACE_WORDS = frozenset({"dir", "directory", "path", "paths", "folder", "url", "uri", "host", "hostname",
                          "logdir", "cwd", "home", "run", "uuid"})
_STAMPED = re.compile(r"\d{4}-?\d{2}-?\d{2}[T _-]?\d{2}:?\d{2}|\d{4}-\d{2}-\d{2}$|\d{1,2}:\d{2}:\d{2}"
                      r"|[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}$|[0-9a-f]{16,}$", re.IGNORECASE)
_ADDRESS = re.compile(r"0x[0-9a-f]{6,}", re.IGNORECASE)
_TOKEN = re.compile(r"<[^<>\s]{1,30}>")  # a special token (`</s>`, `<|endoftext|>`): its slash is no path's
_WORDS = re.compile(r"[^a-z]+")
# A save's single strings are compared only under a key that names what they mean to the training
# (helper 25: a save holds names that differ from run to run under any key, `experiment`, `out`,
# `wandb_id`, `exp_name`, `created`, a temporary file's name; a JSON file's rule, above, is wider).
# Strings in a list or tuple (class names, a vocabulary, target modules) are compared under any key
# but a place's.
_MEANING_WORDS = frozenset({
    "act", "activation", "activations", "nonlinearity", "fn", "func", "function", "mode", "type", "kind",
    "method", "scheduler", "sched", "optimizer", "optim", "loss", "criterion", "objective", "norm",
    "normalization", "pool", "pooling", "padding", "pad", "token", "tokens", "label", "labels", "class",
    "classes", "vocab", "precision", "dtype", "strategy", "init", "initializer", "reduction", "arch",
    "backbone", "template", "metric", "prediction", "interpolation", "attention", "attn", "encoding",
    "embedding", "position", "aggregation", "gate", "bias", "eos", "bos", "unk", "sep", "cls", "mask"})
_CAMEL = re.compile(r"(?<=[a-z])(?=[A-Z])")


class _Walk:
    def __init__(self, what: str, depth: int, tensors: int, visits: int, save: bool):
        self.save = save  # a save's walk: every Python number, modules whole; else a call's arguments
        self.what = what  # what is walked, in the reasons (`the saved object`)
        self.depth = depth
        self.tensors = tensors
        self.found: list[tuple[str, torch.Tensor]] = []
        self.visits = visits
        self.max_visits = visits
        self.seen: set[int] = set()  # containers walked (one met again is not walked again) ...
        self.held: list = []  # ... and held until the walk ends: a temporary's id (a __getstate__() dict) is reused
        self.why: str | None = None  # why some tensors may be missing

    def missing(self, why: str) -> None:
        self.why = self.why or why

    def walk(self, value, path: str, depth: int, numbers: bool = False, clock: str | None = None,
             key: str = "", listed: bool = False) -> None:
        """`numbers`: inside an optimizer's or a scheduler's state, whose numbers are taken too; `clock`:
        under a key that names a time (bitguard/timed.py, `clock_of`), whose numbers `compared` tells;
        `key`: the name of the nearest key or attribute above, `listed`: an item of a list or tuple (a
        save's strings: `saved_string_compared`)."""
        if isinstance(value, np.generic) and value.dtype.kind in "biufU":  # (a NumPy scalar: as its Python value)
            value = value.item()
        if isinstance(value, os.PathLike):  # (a path: its parts, pathlib's `_parts`, differ from run to run by design)
            return
        if self.save and isinstance(value, NAMED):  # (what a setting names: an enum member, a dtype, a class)
            self.found.append((path + NAME_MARK, string_tensor(name_of(value))))
            return
        if isinstance(value, SCALARS):  # (not counted: a list of a dataset's indices is cheap to pass over)
            if numbers and isinstance(value, (int, float)) and compared(clock, value):
                kind = bool if isinstance(value, bool) else int if isinstance(value, int) else float
                self.found.append((path + NUMBER_MARK.format(kind.__name__), number_tensor(kind(value))))
            elif numbers and isinstance(value, complex) and clock != "duration":  # (helper 79: passed over)
                self.found.append((path + NUMBER_MARK.format("complex"), torch.tensor(value, dtype=torch.complex128)))
            elif self.save and type(value) is str and saved_string_compared(value, key, clock, listed):
                self.found.append((path + STRING_MARK, string_tensor(value)))
            return
        self.visits -= 1
        if len(self.found) >= self.tensors or self.visits < 0:
            self.missing(f"{self.what} holds more than {self.tensors:,} tensors or {self.max_visits:,} values: "
                         "the rest was not looked at")
            return
        if clock == "duration" and isinstance(value, (torch.Tensor, np.ndarray)):  # (times kept as an array)
            return
        if isinstance(value, torch.Tensor):
            self.found.append((path or "[]", value))
            return
        if not self.save and isinstance(value, torch.nn.Module):  # among a call's arguments: its weights are
            return  # its own events' (Keras' symbolic tensors hold the layers that made them, ever deeper)
        if isinstance(value, np.ndarray):  # saved beside the tensors (NumPy's RNG state, weights kept as arrays)
            if value.dtype.kind in "biufc":
                self.found.append((path or "[]", torch.from_numpy(value if value.flags.writeable else value.copy())))
            elif value.dtype.kind in "OU":  # (objects; strings: as a list of them)
                self.walk(value.ravel().tolist(), path, depth, numbers, clock, key)
            return
        if id(value) in self.seen:
            return
        if depth < 0:
            self.missing(f"{path} is more than {self.depth} containers deep: not looked into")
            return
        if numbers and type(value) in (list, tuple) and len(value) >= PACKED_INTS \
                and all(type(v) is int and compared(clock, v) for v in value):
            try:
                self.found.append((path + NUMBER_MARK.format("int"), torch.tensor(value, dtype=torch.int64)))
                return
            except (OverflowError, RuntimeError):  # (an int past 64 bits: taken one by one, as floats are not)
                pass
        if self.save and type(value) in (list, tuple) and len(value) >= PACKED_INTS \
                and all(type(v) is str and saved_string_compared(v, key, clock, True) for v in value):  # (a vocabulary)
            self.found.append((path + STRING_MARK, string_tensor(list(value))))
            return
        self.seen.add(id(value))
        self.held.append(value)
        reduced = self.save and _by_reduce(value)
        if self.save and isinstance(value, dict):  # (its keys: `label2id` with two labels swapped has the same values)
            keys = [k for k, _ in islice(in_key_order(value), MAX_ITEMS)
                    if type(k) is str and saved_string_compared(k, key, clock, True) and not _key_kind(k)[0]]
            if keys:
                self.found.append((path + KEYS_MARK, string_tensor(keys)))
        numbers = numbers or training_state(value)
        try:
            # (a dict by index, as a detector's class names `{0: 'red', 1: 'green'}`, is a list: helper 61, two names
            # swapped in ultralytics' best.pt compared identical)
            listed = type(value) in (list, tuple) or (type(value) is dict and bool(value)
                                                      and all(type(k) is int for k in islice(value, MAX_ITEMS)))
            for sub, item in (_reduce_items(value, path) if reduced else self.items(value, path)):
                self.walk(item, sub, depth - 1, numbers, clock_below(sub, clock) if self.save else clock,
                          _key_of(sub[len(path):], key), listed)
        except Exception as exc:  # noqa: BLE001 - an object that fails when looked at (a proxy)
            self.missing(f"{path or self.what} could not be looked into ({type(exc).__name__}: {exc})"[:300])

    def items(self, value, path: str):
        """(path, item) of what `value` holds, as pickle would write it."""
        if isinstance(value, torch.nn.Module):  # (torch's own walks: torchrl's LossModule overrides named_parameters
            # with the signature before remove_duplicate, and pickle writes what the module holds: helper 47)
            Module = torch.nn.Module
            yield from ((f"{path}.{n}", t) for n, t in Module.named_parameters(value, remove_duplicate=False))
            yield from ((f"{path}.{n}", t) for n, t in Module.named_buffers(value, remove_duplicate=False))
            for name, module in Module.named_modules(value, remove_duplicate=False):
                where = f"{path}.{name}" if name else path
                yield from ((f"{where}.{k}", v) for k, v in module.__dict__.items() if k not in _MODULE_OWN
                            and not (k == "_graph" and isinstance(module, torch.fx.GraphModule)))
                # (a GraphModule's graph: its __reduce__ leaves it out, its code is what pickle writes; e3nn's tensor
                # products hold them, and `torch.save(net)` was inconclusive, "more than 32 containers deep":
                # helper 79)
        elif isinstance(value, dict):  # (a save's in the order of its keys: see in_key_order)
            yield from self._counted((f"{path}[{k!r}]", v) for k, v in (in_key_order(value) if self.save else value.items()))
        elif isinstance(value, (list, tuple)):
            yield from self._counted((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, (set, frozenset)):
            ordered = _in_own_order(value)
            if ordered is None:
                self.missing(f"{path or self.what} is a set of tensors or objects: they have no order "
                             "to be compared in")
            else:  # (helper 79: numbers or strings passed over; helper 82: escnn's representations, inconclusive)
                yield f"{path}[sorted]", ordered
        else:
            own = getattr(type(value), "__getstate__", None)
            if own is not None and own is not getattr(object, "__getstate__", None):
                yield f"{path}.__getstate__()", value.__getstate__()  # (what pickle writes of it)
                return
            try:
                attributes = object.__getattribute__(value, "__dict__")  # (bypassing the class's own lookups)
            except AttributeError:  # slots only, or a builtin
                attributes = None
            if type(attributes) is dict:
                yield from self._counted((f"{path}.{k}", v) for k, v in attributes.items() if isinstance(k, str))
            for slot in _slots(type(value)):
                if hasattr(value, slot):
                    yield f"{path}.{slot}", getattr(value, slot)

    def _counted(self, pairs):
        pairs = iter(pairs)
        yield from islice(pairs, MAX_ITEMS)
        if any(not isinstance(v, SCALARS) for _, v in pairs):  # (past the limit, only numbers are passed over)
            self.missing(f"a container holds more than {MAX_ITEMS:,} items, not all of them numbers or strings: "
                         "the rest was not looked at")


def _in_own_order(items: set | frozenset) -> list | None:
    """The items of a set in an order of their own, the same in every run: numbers and strings by type and value,
    objects by what they print when each prints differently and no memory address (escnn's representations,
    `C4|[regular]:4`, in the field type of every output); None where there is none (tensors, default reprs)."""
    items = list(islice(items, MAX_ITEMS + 1))
    if any(isinstance(v, (torch.Tensor, np.ndarray)) for v in items):
        return None
    keys = [(type(v).__name__, repr(v)) for v in items]
    if len(set(keys)) < len(keys) or any(_ADDRESS.search(text) for v, (_, text) in zip(items, keys)
                                         if not isinstance(v, SCALARS)):
        return None
    return [v for _, v in sorted(zip(keys, items), key=lambda pair: pair[0])]


_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")  # (a default repr's `at 0x7f...`: another in every run)


def _by_reduce(value) -> bool:
    """Whether pickle writes what `value`'s class makes of it in its own `__reduce_ex__` or `__reduce__`
    (a torch.Generator, NumPy's Generator, whose `__getstate__` gives None, and its bit generator, a deque,
    `random.Random`, a `functools.partial`), not its `__getstate__` or `__dict__` (helper 79: a
    checkpoint's sampler generator seeded differently compared identical: nothing else shows its state)."""
    cls = type(value)
    return not isinstance(value, (torch.nn.Module, dict, list, tuple, set, frozenset)) and (
        cls.__reduce_ex__ is not object.__reduce_ex__ or cls.__reduce__ is not object.__reduce__)


def _reduce_items(value, path: str):
    """(path, item) of what pickle writes of `value` through its `__reduce_ex__`: the arguments it is made
    from, the state it is given, its items."""
    made = value.__reduce_ex__(2)
    if not isinstance(made, tuple):  # (a name: a module-level singleton)
        return
    parts = list(made) + [None] * (5 - len(made))
    yield f"{path}.__reduce__()", parts[1]
    if parts[2] is not None:
        yield f"{path}.__setstate__()", parts[2]
    if parts[3] is not None:
        yield f"{path}.__reduce__()[items]", list(islice(parts[3], MAX_ITEMS + 1))
    if parts[4] is not None:
        yield f"{path}.__reduce__()[dict]", dict(islice(parts[4], MAX_ITEMS + 1))


NAMED = (enum.Enum, type, torch.dtype, np.dtype, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def in_key_order(value: dict) -> list:
    """A saved dict's items in the order of their keys, not of their insertion: a checkpoint written as
    `{name: optimizer.state_dict()}` in the order the optimizers were made (Pyro's, made as a set of
    tensors is iterated: an order that changes from run to run) is read back by key, the same in every
    run (helper 42). Keys of one type sort by value, others by type name and repr. Tensors as keys (a
    pickled optimizer's state, keyed by its parameters) stay in the order they were put in: they compare
    element by element (a RuntimeError for two shapes, helper 75: `torch.save` of an LR scheduler with a
    momentum SGD made the run inconclusive), and their reprs are their values, which differ between runs."""
    items = list(value.items())
    if any(isinstance(k, torch.Tensor) for k, _ in items):
        return items
    try:
        return sorted(items, key=lambda kv: (type(kv[0]).__name__, kv[0]))
    except Exception:  # (keys of a type without an order, or whose comparison raises)
        try:
            return sorted(items, key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        except Exception:  # (a repr that raises)
            return items


def name_of(value) -> str:
    """What a setting held as an object names, the same in every run: an enum member's class and
    name (`SchedulerType.COSINE`), a dtype's name, a class's or a function's module and qualified
    name (`torch.nn.modules.activation.GELU`)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (torch.dtype, np.dtype)):
        return str(value)
    value = getattr(value, "__func__", value)  # (a bound method: its function)
    return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', None) or type(value).__qualname__}"


def number_tensor(value) -> torch.Tensor:
    """A Python int, float or bool as the 0-d tensor of its value (float64 or int64); an int past 64
    bits as the bytes of its digits."""
    if type(value) is int and not -(1 << 63) <= value < (1 << 63):
        return torch.frombuffer(bytearray(str(value).encode()), dtype=torch.uint8)
    return torch.tensor(value, dtype=torch.float64 if type(value) is float else torch.int64)


def _key_of(step: str, above: str) -> str:
    """The key a path step names (`['lr']`, `.vocab`); a list's index, `.__getstate__()` and an
    object's own attributes (`._val`, `._content` of an OmegaConf node: helper 25) keep the key above."""
    name = step[1:] if step.startswith(".") else step[2:-2] if step[:2] in ("['", '["') else ""
    return above if not name or name.startswith("_") else name


def _key_words(key: str) -> set[str]:
    """The words of a key: `outputDir` and `output_dir` are `output` and `dir`."""
    return set(_WORDS.split(_CAMEL.sub("_", key).lower())) - {""}


def _names_a_place(words: set[str]) -> bool:
    """A place's key, its words read whole or by their ends (`outdir`, `savedir`, `logfile`, `ckptpath`)."""
    return any(w in _SAVE_PLACES or w.endswith(_PLACE_ENDS) for w in words)


_SAVE_PLACES = _PLACE_WORDS | {"file", "filename", "files", "argv"}
_PLACE_ENDS = ("dir", "path", "file", "folder", "url", "host")


@lru_cache(maxsize=4096)
def _key_kind(key: str) -> tuple[bool, bool]:
    """(names a place, names a meaning) of a key: read once per key, not once per string under it
    (a vocabulary's, a dict's keys)."""
    words = _key_words(key)
    return _names_a_place(words), bool(_MEANING_WORDS.intersection(words))


def saved_string_compared(value: str, key: str, clock: str | None, listed: bool) -> bool:
    """Is a save's string `value` compared? As `string_compared` says, not under a place's key, and,
    unless it is an item of a list or tuple, only under a key that names what it means to the
    training (_MEANING_WORDS)."""
    place, meaning = _key_kind(key)
    return not place and (listed or meaning) and string_compared(value, key, clock)


def place_key(key: str) -> bool:
    """Does `key` name a place (a folder, a file's path, a host)? What it holds is not compared, and
    nor is it among its JSON object's keys: a config that gains `_name_or_path` once loaded from a
    checkpoint (diffusers' `register_to_config`, helper 43) is the same config. (A save's keys: by
    `_key_kind`, as the save's strings under them are.)"""
    return bool(_PLACE_WORDS.intersection(_WORDS.split(key.lower())))


def string_compared(value: str, key: str, clock: str | None) -> bool:
    """Is string `value`, under the nearest key named `key`, compared? Not under a key that names a
    time (`clock`) or a place, nor a path, a URL, a date, a UUID, a hex id or an address."""
    return (clock is None and ("/" not in value and "\\" not in value or _TOKEN.fullmatch(value) is not None)
            and not _STAMPED.match(value)
            and not _ADDRESS.search(value) and not place_key(key))


def string_tensor(value: str | list[str]) -> torch.Tensor:
    """A string as the 0-d int64 tensor of a 64-bit hash of its UTF-8 bytes (one shape for every
    string, so that another string differs by its value, not as another layout); a list of
    strings as the 1-d tensor of theirs."""
    if isinstance(value, list):
        return torch.tensor([_hashed(v) for v in value], dtype=torch.int64)
    return torch.tensor(_hashed(value), dtype=torch.int64)


def _hashed(value: str) -> int:
    digest = hashlib.blake2b(value.encode(errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def training_state(value) -> bool:
    """An optimizer's `state_dict()` (its `state` and `param_groups`) or an LR scheduler's (its
    `last_epoch` and learning rates): what a training resumes from, numbers included."""
    return type(value) is dict and (("state" in value and "param_groups" in value)
                                    or ("last_epoch" in value and ("base_lrs" in value or "_last_lr" in value)))


def tensors_in(obj, what: str = "the saved object", depth: int | None = None, tensors: int | None = None,
               visits: int | None = None, save: bool = True) -> tuple[list[tuple[str, torch.Tensor]], str | None]:
    """(path, tensor) of every tensor `obj` holds, as the module docstring says, and why some may
    be missing (None: none is): what cannot be walked whole is marked, never taken for all it holds.
    `what` names `obj` in the reasons; the limits are a saved object's unless given. `save`: what a
    save writes, its Python numbers too (but under a key that names a time) and a module's weights; else (an
    object among a call's arguments) only an optimizer's or a scheduler's numbers, and no module."""
    walk = _Walk(what, MAX_DEPTH if depth is None else depth, MAX_TENSORS if tensors is None else tensors,
                 MAX_VISITS if visits is None else visits, save)
    walk.walk(obj, "", walk.depth, save)
    return walk.found, walk.why


class SaveWatch:
    """`prepare(boundary, obj)` before each save the user's code makes, while installed, and the
    callable it returns (if any) once that save has returned: a save that raised wrote nothing."""

    def __init__(self, prepare):
        self._prepare = prepare
        self._patches: list[Patch] = []
        self._inside = threading.local()
        self._finder: AfterImport | None = None
        self._defined: dict[int, str] = {}  # id of a saver wrapped where it is defined -> its boundary

    def install(self) -> SaveWatch:
        lazy = []
        for module_name, savers in _SAVERS.items():
            module = sys.modules.get(module_name)
            if module is None and module_name == "safetensors.torch" and importlib.util.find_spec("safetensors"):
                try:
                    import safetensors.torch as module
                except Exception:  # noqa: BLE001 - a broken install: its saves are not seen (torch.save still is)
                    module = None
            if module is not None:
                self._wrap(module, savers)
            elif module_name.startswith(_DCP):
                lazy.append(module_name)
        if lazy:  # wrapped as soon as the training imports it
            self._finder = AfterImport(set(lazy), lambda m: self._wrap(m, _SAVERS[m.__name__]))
            sys.meta_path.insert(0, self._finder)
        # the names other modules gave the savers before the recording began (helper 30: accelerate's
        # `from safetensors.torch import save_file as safe_save_file`, imported before `with bitguard.record()`);
        # torch's own code is not (its saves are not the user's: see `save` below)
        for module, name, original in bound_elsewhere([p.original for p in self._patches],
                                                      skip=("torch.", "bitguard.", "safetensors.")):
            self._patches.append(Patch(module, name, self._make(self._defined[id(original)])))
        return self

    def remove(self) -> None:
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        for patch in self._patches:
            patch.remove()
        self._patches.clear()

    def _wrap(self, module, savers) -> None:
        for attribute, boundary in savers:
            if callable(getattr(module, attribute, None)):
                self._patches.append(Patch(module, attribute, self._make(boundary)))
                self._defined[id(self._patches[-1].original)] = boundary

    def _make(self, boundary: str):
        def make(original, patch):
            try:
                first = next(iter(inspect.signature(original).parameters))  # the saved object's parameter
            except (TypeError, ValueError, StopIteration):
                first = None

            def save(*args, **kwargs):
                if not patch.active or getattr(self._inside, "on", False) or _from_torch(sys._getframe(1)):
                    return original(*args, **kwargs)
                obj = args[0] if args else kwargs.get(first)
                self._inside.on = True
                try:
                    done = self._prepare(boundary, obj)  # (never raises: the collector contains its failures)
                    result = original(*args, **kwargs)
                finally:
                    self._inside.on = False
                if done is not None:
                    done()
                return result
            return save
        return make


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once each module named in `names` has been imported (its code run)."""

    def __init__(self, names: set[str], then):
        self._names, self._then = names, then

    def find_spec(self, name, path=None, target=None):
        if name not in self._names:
            return None
        self._names.discard(name)  # (the lookup below must not find this finder again)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, then = spec.loader, self._then

        class _Then(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                try:
                    then(module)
                except Exception:  # noqa: BLE001 - what `then` adds is then missing; the import itself stands
                    pass

        spec.loader = _Then()
        return spec


def _child_saves_path(rank_path) -> Path:
    return Path(rank_path).with_suffix(".child-saves")


def note_child_save(rank_path, boundary: str) -> None:
    """In a forked child (a DataLoader worker), whose collector is off: one line in
    `rank-N.child-saves` beside the rank file, for the parent (`child_saves`). Never raises."""
    try:
        fd = os.open(_child_saves_path(rank_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, f"{os.getpid()} {boundary}\n".encode())
        finally:
            os.close(fd)
    except Exception:  # noqa: BLE001 - the child's training goes on; only the report is lost
        pass


def child_saves(rank_path) -> str | None:
    """What the children's lines say, as one sentence (None: no child saved), the file removed:
    what they wrote is not observed, so the run is not certified."""
    marker = _child_saves_path(rank_path)
    try:
        lines = [line for line in marker.read_text().split("\n") if line.strip()]
    except OSError:
        return None
    marker.unlink(missing_ok=True)
    if not lines:
        return None
    pid, _, boundary = lines[0].partition(" ")
    more = f" ({len(lines)} saves in all)" if len(lines) > 1 else ""
    return (f"a process the training started (pid {pid}, a DataLoader worker or a forked child) called {boundary}"
            f"{more}: what it wrote is not observed")


def _slots(cls: type) -> list[str]:
    """The slot names of `cls` and its bases (a `@dataclass(slots=True)`'s fields)."""
    names = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
    return names


def _from_torch(frame) -> bool:
    """The save is torch's own (a distributed checkpoint's items), not the user's."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return isinstance(name, str) and name.startswith(_TORCH)
