"""What the training keeps but never calls: a hand-written EMA copy of the model (deepcopy, updated
in place under no_grad, saved at the end), timm's ModelEmaV2, diffusers' EMAModel (a plain object
whose `shadow_params` list of tensors is updated in place), a dict of shadow tensors by parameter
name. No module call meets them, so without this their final state, the weights a user saves, was
never compared.

`found_in(frames, shapes)` looks through the frames' variables, each one's `self`'s attributes, and,
DEPTH containers down, the dicts, lists, tuples, deques, plain objects, modules, functions' closures and
default arguments (a hook's), partials' arguments, and the attributes of the user's own classes and the
globals of the user's own modules (not an installed library's) they hold (a module's own attributes: an
EMA object kept as `model.ema`; `Registry.ema`; `emalib._STATE["ema"]`, reached by `import emalib` or by
a function imported from it), for modules, and for lists or dicts of tensors that need no gradient and
have, in order, the shapes of a model's parameters or of two or more consecutive ones (`shapes`: an
EMA's shadow weights, of the model or of a part of it, not a batch of data); each named by where it was
found (`state.ema`, `self.ema.m` as `ema.m`, `ema_unet.shadow_params`, `net.ema.shadow_params`). A weak
proxy is passed over (its object is found where it is held). The collector (weights.py) makes each a
root held to the end of the recording. Knows nothing of events.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections import deque
from itertools import islice

import torch

from bitguard.collectors.callstack import _is_user

MAX_ITEMS = 64  # items of one container looked at (a list of a dataset's batches is not walked)
DEPTH = 5  # containers looked into below a variable (composer's `trainer.state.algorithms[0].ema_model.named_parameters_dict`)
MAX_VISITS = 8192  # values looked at in one look, over every frame (an HF Trainer's attributes are not walked whole)
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)  # what every module holds: not looked into


class KeptTensors(torch.nn.Module):
    """A list or dict of tensors an object keeps (`ema.shadow_params`), as the buffers of a module
    (named by position), so that its final state is recorded as a root's; the tensors are the
    container's own, not copies, taken again by `refresh` (an EMA that puts a new tensor in its
    place), and so is the container, from the attribute that held it (`place`: the object and the
    attribute's name; diffusers' `EMAModel.to()` makes a new list, as an EMA offloaded between
    steps does at every step, helper 30)."""

    def __init__(self, tensors: list | dict, place: tuple[object, str] | None = None):
        super().__init__()
        self.kept = tensors  # (the container itself, held: a later look finds it again by identity)
        self.place = place  # (the object holding it, held too: what the training still updates)
        self.refresh()

    def refresh(self) -> None:
        if self.place is not None:
            now = held_at(self.place)
            if type(now) is type(self.kept):
                self.kept = now
        values = list(self.kept.values()) if type(self.kept) is dict else list(self.kept)
        self._buffers.clear()
        for i, t in enumerate(values):
            if isinstance(t, torch.Tensor):
                self.register_buffer(str(i), t)


class Globals:
    """A script's globals where its frame has returned (`bitguard record`, runpy's result), looked through
    as a frame's variables are."""

    __slots__ = ("f_locals",)
    f_code = None

    def __init__(self, variables: dict):
        self.f_locals = variables


def user_frames(frame, began=None) -> list:
    """`frame` and the frames that called it, innermost first, but bitguard's, torch's and the standard
    library's (callstack.py). Past `began`, the frame that began the recording (`with
    bitguard.record()`), where it is still running: only module-level frames (a script's globals);
    its callers' variables are not the recorded training's (pytest's, a notebook kernel's: thirty
    frames of objects walked at every look). Where it has returned (a recording begun by a
    framework's callback), every frame."""
    out, past = [], False
    while frame is not None:
        if _is_user(frame.f_code.co_filename) and (not past or frame.f_code.co_name == "<module>"):
            out.append(frame)
        past = past or frame is began
        frame = frame.f_back
    return out


def held_at(place: tuple[object, str]):
    """What attribute `place[1]` of object `place[0]` holds now (None: nothing)."""
    try:
        attributes = object.__getattribute__(place[0], "__dict__")
    except Exception:  # noqa: BLE001 - an object without its own attributes
        return None
    return attributes.get(place[1]) if type(attributes) is dict else None


def marks(frames, holders: frozenset = frozenset()) -> tuple:
    """What the frames hold, cheaply: each one's code, its variables' names and types, and the names
    and types of its `self`'s attributes. A model or shadow weights made since the last look (`ema =
    [p.clone() ...]`, `self.ema = deepcopy(model)`) changes it; a step's new batch and loss do not.
    Of the variables and attributes named in `holders` (those the last look found a kept model
    through), the objects themselves: one made anew in the same variable (`ema = EMAModel(...)` again,
    helper 30) changes it too."""
    out = []
    for frame in frames:
        try:
            variables = frame.f_locals
            owner = variables.get("self")
            attributes = getattr(owner, "__dict__", None) if owner is not None else None
            attributes = attributes if type(attributes) is dict else {}
            held = tuple(id(where[name]) for where in (variables, attributes) for name in holders if name in where) \
                if holders else ()
            out.append((frame.f_code, tuple(variables), tuple(map(type, variables.values())),
                        tuple(attributes), tuple(map(type, attributes.values())), held))
        except Exception:  # noqa: BLE001 - an odd frame or `self`: it marks nothing
            out.append(None)
    return tuple(out)


def found_in(frames, shapes: set[tuple] = frozenset()) -> list[tuple[str, object, tuple | None]]:
    """(name, module or list or dict of tensors, place) of what the variables of `frames` (one frame, or
    several, innermost first) keep, as the module docstring says (`shapes`: the parameters' shapes of each
    model the training holds, in order; `place`: the object and attribute holding a list or dict, None
    for the rest); an object that fails when looked at (a lazy import) is passed over. Breadth first,
    over every frame at once: every variable of every frame before what any of them holds, so a budget
    spent inside one large object (a script's ArgumentParser of a dozen options: helper 74, whose EMA, a
    later global, was never found, and a reset of it compared identical) is spent after the shallower
    places of every other; one budget for the look (a budget a frame cost a look under pytest, whose
    thirty frames were all walked where the recording's block had returned, up to 120,000 values)."""
    queue = deque()
    for frame in frames if isinstance(frames, (list, tuple)) else (frames,):
        try:
            variables = list(frame.f_locals.items())
        except Exception:  # noqa: BLE001 - nothing found there is the safe answer
            continue
        queue.extend((key, value, DEPTH, key == "self", None) for key, value in variables
                     if isinstance(key, str) and key.isidentifier() and not key.startswith("__"))
    found, budget, walked = [], MAX_VISITS, set()
    while queue and budget > 0:
        budget -= 1
        found += _kept(*queue.popleft(), shapes, queue, walked)
    return found


def _kept(name: str, value, depth: int, owner: bool, place: tuple | None, shapes,
          queue: deque, walked: set) -> list[tuple[str, object, tuple | None]]:
    """What `value` (found as `name`, as attribute `place[1]` of `place[0]` where it is one) is, if it is
    kept, with what it holds put on `queue`, `depth` containers down at most; `owner`: the frame's
    `self`, whose attributes are named by themselves (a method's `self.ema` is `ema`); `walked`: the ids
    of the modules and classes whose attributes this look has queued already (each of a module's
    functions leads to it again)."""
    try:
        if type(value) in weakref.ProxyTypes:  # (Lightning's profiler holds one of the model)
            return []
        if _shadow(value, shapes):
            return [(name, value, place)]
        if _is_module(value):
            if depth > 0:
                _attributes(name, value, depth, owner, queue, _MODULE_INTERNALS)
            return [] if owner else [(name, value, None)]
        if depth <= 0 or isinstance(value, torch.Tensor):
            return []
        if isinstance(value, (types.ModuleType, type)):
            if id(value) in walked:
                return []
            walked.add(id(value))
        if isinstance(value, types.ModuleType):  # (the user's own module's globals: `emalib._STATE["ema"]`, h76)
            # (read from its namespace: a lazy module's __getattr__ imports what it stands for, helper 82: SpeechBrain's
            # imported transformers, accelerate and a thousand modules more into the user's process)
            if _own(object.__getattribute__(value, "__dict__").get("__file__")):
                _attributes(name, value, depth, False, queue)
            return []
        if isinstance(value, type):  # (a class of the user's own code: its attributes, `Registry.ema`, h76)
            if value.__module__ == "__main__" or _own_module(value.__module__):
                items = [(f"{name}.{k}", v) for k, v in islice(vars(value).items(), MAX_ITEMS)
                         if isinstance(k, str) and not k.startswith("__") and not isinstance(v, _CODE)]
                queue.extend((n, v, depth - 1, False, None) for n, v in items)
            return []
        if isinstance(value, types.FunctionType):  # (a hook's closure: `register_step_post_hook(update)`)
            cells = islice(zip(value.__code__.co_freevars, value.__closure__ or ()), MAX_ITEMS)
            items = [(f"{name}.{var}", _contents(cell)) for var, cell in cells if var != "__class__"]
            # (and its defaults: `def hook(opt, args, kwargs, _ema=EMAModel(...))`, helper 89)
            code, defaults = value.__code__, value.__defaults__ or ()
            names = code.co_varnames[code.co_argcount - len(defaults):code.co_argcount]
            items += [(f"{name}.{var}", v) for var, v in zip(names, islice(defaults, MAX_ITEMS))]
            items += [(f"{name}.{k}", v) for k, v in islice((value.__kwdefaults__ or {}).items(), MAX_ITEMS)]
            module = value.__module__  # (`from emalib import update`: the globals it updates, by the module's name)
            if module != "__main__" and _own_module(module):
                items.append((module, sys.modules[module]))
        elif isinstance(value, types.MethodType):  # (a bound method kept as a hook: its object)
            items = [(name, value.__self__)]
        elif isinstance(value, functools.partial):  # (a hook bound to its arguments: what it was given, h76)
            items = [(f"{name}.{i}", v) for i, v in enumerate(islice(value.args, MAX_ITEMS))]
            items += [(f"{name}.{k}", v) for k, v in islice(value.keywords.items(), MAX_ITEMS)]
            items.append((name, value.func))
        elif isinstance(value, dict):  # (string keys; int keys, a module's or an optimizer's hooks by the number
            # of their handle, which counts every hook the process made, by position)
            pairs = enumerate(islice(value.items(), MAX_ITEMS))
            items = [(f"{name}.{k if type(k) is str else i}", v) for i, (k, v) in pairs if type(k) in (str, int)]
        elif type(value) in (list, tuple, deque):
            items = [(f"{name}.{i}", v) for i, v in enumerate(islice(value, MAX_ITEMS))]
        else:
            _attributes(name, value, depth, owner, queue)
            return []
        queue.extend((n, v, depth - 1, False, None) for n, v in items)
    except Exception:  # noqa: BLE001 - __slots__ only, an object whose lookups raise: nothing kept there
        pass
    return []


_CODE = (types.FunctionType, types.BuiltinFunctionType, staticmethod, classmethod, property, type)  # (a class's methods)


def _own(filename: str | None) -> bool:
    """Whether a module's file is of the user's own code: neither an installed library's (its globals are
    many, and an EMA is not kept there) nor the standard library's, torch's or bitguard's."""
    return bool(filename) and _is_user(filename) and "site-packages" not in filename \
        and "dist-packages" not in filename


def _own_module(name: str) -> bool:
    """Whether the module imported as `name` is of the user's own code (`_own`)."""
    return _own(getattr(sys.modules.get(name), "__file__", None))


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # (a cell not yet filled)
        return None


def _attributes(name: str, value, depth: int, owner: bool, queue: deque, skip: frozenset = frozenset()) -> None:
    """The attributes of object `value` (but those named in `skip`) put on `queue`, each one container down."""
    attributes = object.__getattribute__(value, "__dict__")  # (bypassing the class's own lookups)
    if type(attributes) is not dict:
        return
    queue.extend((key if owner else f"{name}.{key}", v, depth - 1, False, (value, key))
                 for key, v in islice(((k, v) for k, v in attributes.items()
                                       if isinstance(k, str) and k not in skip and not k.startswith("__")), MAX_ITEMS))


def _shadow(value, shapes) -> bool:
    """A list, or a dict by name, of floating-point tensors that need no gradient and have, in
    order, the shapes of a model's parameters (an EMA's shadow weights; a batch is not one), or, two
    or more, of a run of them: a part's (helper 89: diffusers' EMAModel of `model.up_blocks` compared
    identical whatever its decay; a part's parameters follow one another in its model's)."""
    if type(value) is dict:
        value = list(value.values())
    elif type(value) is not list:
        return False
    if not value or len(value) > 100_000:
        return False
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_floating_point() and not t.requires_grad
               for t in value):
        return False
    mine = tuple(tuple(t.shape) for t in value)
    return mine in shapes or (len(mine) > 1 and any(_runs_in(mine, model) for model in shapes))


def _runs_in(part: tuple, whole: tuple) -> bool:
    """Whether `part` is a run of consecutive items of `whole`."""
    n = len(part)
    return any(whole[i:i + n] == part for i in range(len(whole) - n + 1) if whole[i] == part[0])


def _is_module(value) -> bool:
    try:
        return isinstance(value, torch.nn.Module)
    except Exception:  # noqa: BLE001 - an object whose __class__ raises
        return False
