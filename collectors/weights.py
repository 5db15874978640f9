"""What the collector records of the weights outside module calls: the `params` event at a root's
first call in a step, the optimizer's `step` events (and the step's end), the `final` state when
the recording ends (of every root, of the tensors only an optimizer holds, of models the training
keeps but never calls), and the `saved` events of what the training saves.

`WeightEvents` is a part of `hooks.Collector` (its state lives there; see its __init__).
"""

from __future__ import annotations

import gc
import itertools
import sys
import time
import weakref
from collections.abc import Mapping, Sequence

import torch
from torch.nn.parameter import is_lazy

from bitguard.collectors import kept
from bitguard.collectors.beside import json_values
from bitguard.collectors.compiled import eager_name, is_compiling, original
from bitguard.collectors.flatten import NotFlattened
from bitguard.collectors.observation import plain_digests, unwrapped
from bitguard.collectors.recompute import in_backward_pass
from bitguard.collectors.saved import child_saves, note_child_save, tensors_in
from bitguard.collectors.sharded import clean_name, mark
from bitguard.errors import NotSupported
from bitguard.schema import FIRST_STEP, JSON_FILE


def tensor_versions(tensors) -> int:
    """The sum of the version counters of `tensors` (-1 when one has none): it moves when one of
    them is written in place, but for writes through `.data`."""
    try:
        return sum(t._version for t in tensors)
    except Exception:  # noqa: BLE001 - a tensor without a version counter: always taken as changed
        return -1


def module_versions(module: torch.nn.Module) -> int:
    """`tensor_versions` of `module`'s parameters."""
    return tensor_versions(module.parameters())


def buffered_below(module: torch.nn.Module) -> list[tuple[str, weakref.ref]]:
    """The modules below `module` (not itself) that hold buffers, with their paths from it (what the
    recorder reports of them when a call of `module` left them unobserved: collectors/hooks.py,
    `_unobserved_buffers`), held weakly (a memory bank kept alive with a dropped model would leak).
    torch's own walk: a library's override may take other arguments (torchrl)."""
    return [(clean_name(eager_name(path)), weakref.ref(sub)) for path, sub in torch.nn.Module.named_modules(module)
            if sub is not module and any(b is not None for b in sub._buffers.values())]


def saved_apart(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors `module`'s state_dict holds beyond its parameters and buffers: those the parts that
    write their own state add (`_save_to_state_dict` overridden, or `get_extra_state`): torch.ao's
    quantized modules keep their scale, zero point and packed weights apart from both (helper 53: a
    model converted in place differed only there, and compared identical). Python numbers as 0-d rows."""
    base = torch.nn.Module
    out = []
    for path, part in base.named_modules(module):
        kind = type(part)
        if kind._save_to_state_dict is base._save_to_state_dict and kind.get_extra_state is base.get_extra_state:
            continue
        written: dict = {}
        try:
            part._save_to_state_dict(written, "", keep_vars=True)
        except Exception:  # noqa: BLE001 - a part that cannot say its state here: its parameters and buffers still are
            continue
        own = set(part._parameters) | set(part._buffers)
        where = f".{clean_name(eager_name(path))}." if path else "."
        for key, value in written.items():
            if key not in own:
                found = [("", value)] if isinstance(value, torch.Tensor) else tensors_in(value, f"{where}{key}")[0]
                out += [(f"{where}{key}{sub}", t) for sub, t in found]
    return out


def _emptied_slot(module: torch.nn.Module, own: dict, name: str) -> torch.Tensor | None:
    """The tensor a call of `module` reads for parameter `name` whose slot in `own` (its `_parameters`) is
    empty: tensordict's to_module puts a plain tensor given in the module's `__dict__`; not a pruned slot
    (`weight_orig` holds the parameter, and pruning's pre-hook computes `weight`)."""
    if name in own or f"{name}_orig" in own:
        return None
    p = module.__dict__.get(name)
    return p if isinstance(p, torch.Tensor) else None


def initialising_step(frames: int = 8) -> bool:
    """Is the optimizer step() now running torch's own initialisation of the optimizer's state, not a
    training step? `torch.distributed.checkpoint.state_dict` (`set_optimizer_state_dict`, and a get of
    the state before the first step) calls step() once with zero gradients and the learning rates at 0
    before it loads a state (helper 60: composer's autoresume; the resumed run's step 0 was that call, its
    parameters named after the optimizer, its root renamed, and nothing of the runs could be paired).
    Read from the callers' frames: the hooks run a few frames below it."""
    f = sys._getframe(2)
    for _ in range(frames):
        if f is None:
            return False
        code = f.f_code
        if code.co_name == "_init_optim_state" and code.co_filename.replace("\\", "/").endswith("checkpoint/state_dict.py"):
            return True
        f = f.f_back
    return False


def is_distributed(module: torch.nn.Module) -> bool:
    """A wrapper of torch.distributed's (DDP's reducer, FSDP's state): not held past the script's
    own lifetime for it, since destroyed after the script's destroy_process_group() its threads
    abort the process ("terminate called without an active exception")."""
    return type(module).__module__.startswith(("torch.nn.parallel", "torch.distributed"))


def library_name(p: torch.Tensor) -> str | None:
    """The name a library the training uses gives a tensor no module holds, where it gives one:
    Pyro's param store, `pyro.param('w_loc')` (the unconstrained tensor pyro.optim steps, one optimizer
    each, made in the order a set of tensors is iterated: named by their place in it, identical reruns
    diverged, helper 42). None otherwise."""
    primitives = sys.modules.get("pyro.primitives")
    if primitives is None:
        return None
    try:
        name = primitives.get_param_store().param_name(p)
    except Exception:  # noqa: BLE001 - another version's store: named by the optimizer's place
        return None
    return f"pyro.param['{name}']" if isinstance(name, str) else None


def _torch_shaped(optimizer) -> bool:
    """Does `optimizer` (not torch.optim's) hold its parameters as torch.optim does: `param_groups`, a list of
    dicts whose "params" are tensors, and a `state` mapping (fastai's `Optimizer`; not Keras')?"""
    try:
        groups, state = optimizer.param_groups, optimizer.state
    except Exception:  # noqa: BLE001 - a property of another library's that fails: not that shape
        return False
    return isinstance(groups, list) and isinstance(state, Mapping) and all(
        isinstance(g, Mapping) and isinstance(g.get("params"), Sequence) and not isinstance(g["params"], str)
        and all(isinstance(p, torch.Tensor) for p in g["params"]) for g in groups)  # (fastai's are fastcore `L`s)


class WeightEvents:
    """The weight events of `hooks.Collector`, which holds their state (slots: none here)."""

    __slots__ = ()

    # -- the final state -------------------------------------------------------------------
    def _let_go(self) -> None:
        """Take the final state of each held root that nothing but this collector holds any more
        (the script dropped it: a model trained and discarded before the next one), and let go of
        it. One held by a reference cycle of its own stays held until the recording ends."""
        held = self._held
        for i in range(len(held) - 1, -1, -1):
            if sys.getrefcount(held[i][0]) <= 2:  # the tuple's reference and the call's argument: no other
                module, name = held.pop(i)
                if self._in_window():
                    self._final(module, name)
                self._roots = [(ref, n) for ref, n in self._roots if ref() is not module]
                del module

    def _emit_final(self) -> None:
        """When the recording ends: one `final` event per root module with every parameter and
        buffer as it is then. What changed the weights outside torch.optim (a manual update, an
        EMA, an edit after the last step()) or a buffer (running statistics) is seen here at
        the latest."""
        self._maybe_advance()  # the final state belongs after the last step
        if not self._in_window():  # a step window that ended before the training (--steps A:B): taken then
            return
        self._finals(sys._getframe(1))
        lost = [name for name, ids in self._unheld.items() if not ids <= self._finaled]
        if lost:
            self._fail("final state", NotSupported(
                f"{', '.join(lost[:3])} (wrapped by DDP or FSDP, not held past the script) was gone when the recording "
                f"ended, and destroy_process_group() was not called while it lived: its final weights are not "
                f"observed (Lightning and Fabric unwrap it at the end)"))
        if self._foreign is not None and not self._steps_taken:
            self._fail("final state", NotSupported(
                f"{self._foreign} ran on tensors in place of its parameters (functional_call) and no optimizer step "
                f"updated them: its final weights are not observed"))
        elif self._backwards and not self._grads and not self._steps_taken:
            self._fail("final state", NotSupported(
                f"gradients flowed back through the recorded modules ({self._backwards} backward events), but none "
                f"reached a parameter of theirs and no optimizer step ran: what was trained, if anything, is tensors "
                f"the modules do not hold (Keras' stateless_call, torch.func.grad of weights kept apart), and its "
                f"weights are not observed"))

    def _finals(self, frame) -> None:
        """The `final` events of every root, kept model and tensor only an optimizer holds, as they are
        now (`frame`: the user's code, where kept models made since the last look are found): when the
        recording ends, or when a step window ends (`_window_ends`)."""
        # what was made after the last look (an EMA made at the end), or with no look at all: a model no torch.optim
        # step trained (BoTorch's fit_gpytorch_mll drives SciPy's optimizer, and gpytorch's modules are called past
        # nn.Module's call: helper 83, its weights edited after the fit compared identical). The code ending a `with
        # bitguard.record()` still holds it; of `bitguard record`, the script's globals (its frame has returned).
        users = kept.user_frames(frame, self.began)
        if self.script_globals is not None:
            users.append(kept.Globals(self.script_globals))
        self._guard(self._adopt_kept)(users)
        gc.collect()  # a model only a reference cycle kept alive is gone in every run alike, not by chance
        for ref, name in self._roots:
            module = ref()
            if module is not None:
                self._final(module, name)
        self._final_stepped()

    def _window_ends(self) -> None:
        """The last step of a step window (--steps A:B) is over, and the training goes on: the state it
        left, which the steps after it, unrecorded, would read (an EMA updated after its optimizer's
        step, weights edited between steps), is the window's final state. Without it a difference
        there compared identical "within the recorded steps"."""
        if self._in_window():
            self._finals(sys._getframe(1))

    def _before_destroy(self, original, patch):
        """destroy_process_group, taking first the final state of the roots that hold a wrapper of
        torch.distributed's (DDP, FSDP) when the default group goes."""
        def destroy_process_group(*args, **kwargs):
            group = args[0] if args else kwargs.get("group")
            if patch.active and (group is None or group is getattr(torch.distributed.group, "WORLD", None)):
                self._guard(self._final_distributed)()
            return original(*args, **kwargs)
        return destroy_process_group

    def _final_distributed(self) -> None:
        """The `final` event of each root holding a DDP or FSDP wrapper, taken while the process
        group still works: this collector does not hold such a model (see `is_distributed`), and a
        script often keeps it local to its main(), gone when the recording ends. Taken once: such a
        root is not visited again at the end."""
        self._maybe_advance()  # the final state belongs after the last step
        if not self._in_window():
            return
        left = []
        for ref, name in self._roots:
            module = ref()
            if module is not None and any(map(is_distributed, module.modules())):
                self._final(module, name)
            else:
                left.append((ref, name))
        self._roots = left

    def _final_stepped(self) -> None:
        """The `final` event of the tensors an optimizer stepped that no root module holds (named by
        their place in the optimizer, `_adopt`): weights trained through torch.func, stacked for
        vmap (an ensemble run on a base model on the meta device), or a list of tensors. Only their
        optimizer steps saw them, before an edit after the last one. Also those of a root that is gone
        without a final event (a DDP wrapper Lightning unwrapped at the end), while their optimizer lives."""
        for ref, label in list(self._optimizers.values()):  # (after every live root's final event)
            optimizer = ref()
            pairs = [] if optimizer is None else [
                (f".param_groups[{g}][{j}]", p) for g, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"]) if id(p) not in self._finaled]
            named = {id(p): library_name(p) for _, p in pairs}  # (Pyro's: each its own event, by its name)
            # (digested now, as every final row is: a digest `_row` kept from their last step would be
            # stale after a write through `.data`, which leaves the version counter as it was: helper 72)
            for name, p in ((named[id(p)], p) for _, p in pairs if named[id(p)]):
                self._finaled.add(id(p))
                self._emit("optimizer", "final", name, "optimizer", 0, time.time_ns(), self._param_digested([("", p)]))
            pairs = [(path, p) for path, p in pairs if not named[id(p)]]
            if pairs:
                self._finaled.update(id(p) for _, p in pairs)
                self._emit("optimizer", "final", label, "optimizer", 0, time.time_ns(), self._param_digested(pairs))

    def _optimizer_state_ids(self) -> set[int]:
        """The ids of the tensors in the state of each optimizer the training stepped (`_optimizers`)."""
        ids = set()
        for ref, _ in list(self._optimizers.values()):
            optimizer = ref()
            for state in (getattr(optimizer, "state", None) or {}).values() if optimizer is not None else ():
                if isinstance(state, dict):
                    ids.update(id(t) for t in state.values() if isinstance(t, torch.Tensor))
        return ids

    def _final(self, module: torch.nn.Module, name: str) -> None:
        """The `final` event of root module `module`: every parameter and buffer as it is now (none
        for a module whose every tensor is on the meta device: a base model that holds no values,
        run through functional_call on weights of its own)."""
        if isinstance(module, kept.KeptTensors):
            module.refresh()  # (an EMA may have put new tensors in its container)
            state = self._optimizer_state_ids()
            if all(id(t) in state for t in module.buffers()):
                # (an optimizer's own state, whose final event is the optimizer's: a loaded checkpoint's dict, which
                # load_state_dict made an optimizer's state without a copy, kept in one run only was "the final state
                # of ck.opt2.state.0", a structure divergence: helper 79)
                return
        self._finaled.update(id(p) for p in module.parameters())
        if all(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
            return
        buffers = [(f".{clean_name(eager_name(n))}", b) for n, b in module.named_buffers()] + saved_apart(module)
        rows, _ = self._param_rows(module)
        if not rows and not buffers:
            return
        t0 = time.time_ns()
        rows += self._rows(buffers, "state")
        self._emit("optimizer", "final", name, type(module).__name__, 0, t0, rows)

    def _saved(self, boundary: str, obj):
        """The `saved` event of a save the training makes (collectors/saved.py): every tensor the
        saved object holds, digested as the save begins; the event is queued by the function returned,
        once the save has returned (None: nothing to record). Its module type is the saved object's
        type. Contains its own failures (SaveWatch calls it directly)."""
        if not self.enabled or is_compiling():
            if self._in_child:  # a DataLoader worker's save: said to the parent, not observed
                note_child_save(self.store.path, boundary)
            return None
        try:
            self._maybe_advance()  # (a save after step k's update belongs to step k + 1, as the next forward)
            if not self._in_window():
                return None
            t0 = time.time_ns()
            pairs, truncated = tensors_in(obj)
            if truncated is not None:
                pairs = NotFlattened(pairs, "[...]", truncated)
            if not pairs and truncated is None:
                return None
            rows = self._rows(pairs, "state")
            stack = self._stacks.capture()
            return self._guard(lambda: self._emit("optimizer", "saved", boundary, type(obj).__name__, 0, t0, rows,
                                                  stack))
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail("saved", exc)
            return None

    def _json_written(self, ended: bool = False) -> None:
        """At a step's end, and when the recording ends (`ended`): a `saved` event of module type
        JSON_FILE for each JSON file the training wrote and closed since (collectors/beside.py), with the
        call stack that opened it, holding its numbers and strings, their paths beginning with the
        file's name (`adapter_config.json['r'] (python int)`); one that could not be read holds an
        unobserved row saying why."""
        if ended:
            self._maybe_advance()  # (one written after the last step belongs after it, as a save there does)
        written = self._json.written(ended) if self._json is not None else ()
        for name, value, why, stack, opened in written if self._in_window() else ():
            pairs, truncated = json_values(value) if why is None else ([], why)
            pairs = [(name + path, t) for path, t in pairs]  # (the name is no key: a file named after its run pairs)
            if truncated is not None:
                pairs = NotFlattened(pairs, name + "[...]", truncated)
            elif not pairs:  # nothing compared
                continue
            self._emit("optimizer", "saved", JSON_FILE, JSON_FILE, 0, opened, self._rows(pairs, "state"), stack)

    def _json_in_child(self, name: str) -> None:
        """A forked child (a DataLoader worker) wrote a JSON file: said to the parent, as its saves are."""
        if self._in_child:
            note_child_save(self.store.path, f"open() of the JSON file {name}")

    def _child_saves(self) -> None:
        """The saves processes the training started made (saved.note_child_save), as a collector error."""
        message = child_saves(self.store.path)
        if message is not None:
            self._fail("child process", NotSupported(message))

    def _params_due(self, module: torch.nn.Module) -> int | None:
        """Whether root `module`'s call is due a params event (its parameters' `module_versions` then),
        None when not: at its first call in a step, and at a later one after a backward when the
        parameters may have changed since: before any optimizer step (step 0, or a loop that
        updates by hand, maybe through .data, which no version counter shows) always, otherwise
        when a version counter moved (an optimizer that calls its closure again, LBFGS); at a later
        one without a backward since when a version counter moved (weights swapped in place between
        two calls: a schedule-free optimizer's `train()`/`eval()`, helper 77: one run took the event
        because its mode changed too, the other not, and the pivot said its weights had not moved);
        and at the first call after the module's mode changed (an evaluation between two training
        calls of a step, Lightning's validation: weights edited or swapped for it, maybe through .data)."""
        at = self._params_at.get(id(module))
        if at is None or at[1] != self.step or at[0]() is not module:
            return module_versions(module)
        if self._foreign is not None and not isinstance(next(module.parameters(), None), torch.nn.Parameter):
            return module_versions(module)  # tensors in place of its parameters (functional_call): each call's own weights
        if module.training is not at[4]:
            return module_versions(module)
        versions = module_versions(module)
        if at[2] == self._grads:
            return versions if versions != at[3] and versions >= 0 and at[3] >= 0 else None
        return versions if self.step == 0 or versions < 0 or versions != at[3] else None

    def _start_params(self, module: torch.nn.Module, name: str, module_type: str, t0: int,
                      versions: int) -> dict | None:
        """The `params` event of root module `module` at its first call in a step: every parameter
        as the step's forward meets it. A difference here that no optimizer step showed was made
        between steps by code outside torch.optim (an initialisation, a clamp through `.data`, a
        hand-written update, a loaded checkpoint), and is blamed so instead of on the first module
        that reads the weight. Notes the step and `versions` (its `module_versions`) in `_params_at`, which
        `_params_due` and `_uncalled_roots` read. Returns what the API recorder's params row can take of it:
        id of a parameter -> its digest (a whole, observed parameter's only)."""
        first = id(module) not in self._params_at
        self._params_at[id(module)] = (weakref.ref(module), self.step, self._grads, versions, module.training)
        rows, params = self._param_rows(module)
        if not rows:
            return None
        self._emit("optimizer", "params", name, module_type, 0, t0, rows)
        if first:
            self._never_written(name, params)
        self._note_met(params)
        swapped = [p for _, p in params if not isinstance(p, torch.nn.Parameter)]
        if swapped:
            self._foreign_call = self._generation  # (its parts' tensors are this event's: `_swapped_params`)
            # (torch.func.functional_call puts the tensors it is given in their place; under torch.func.grad, the
            # module's own parameters are given wrapped: they are still the weights its final event holds, helper 72)
            if self._foreign is None and not all(isinstance(unwrapped(p), torch.nn.Parameter) for p in swapped):
                self._foreign = name
        return {id(p): (r[8], r[9]) if type(r[8]) is int else r[8]
                for (_, p), r in zip(params, rows) if r[12] is None and r[13] is None}

    def _never_written(self, name: str, params: list) -> None:
        """Say so where a model's parameters hold NaN in every element at its first call: memory never written
        after torch.empty or `to_empty()` (a reset_parameters() forgotten), which torch's deterministic mode fills
        with NaN, where a plain run reads whatever the memory held (helper 92: every loss NaN, two recordings
        identical, the plain runs' numbers different each time). Once per model; it contains its failures."""
        try:
            empty = [path.lstrip(".") for path, p in params
                     if p.is_floating_point() and p.numel() and bool(torch.isnan(p.detach()).all())]
        except Exception:  # noqa: BLE001 - a parameter that cannot be read here (a meta tensor): nothing to say
            return
        if empty:
            filled = torch.are_deterministic_algorithms_enabled() and getattr(
                getattr(torch.utils, "deterministic", None), "fill_uninitialized_memory", False)
            print(f"bitguard: warning: {len(empty)} parameter(s) of {name} hold NaN in every element as it is first "
                  f"called ({', '.join(empty[:3])}{' ...' if len(empty) > 3 else ''}): never written since they were "
                  f"made (torch.empty, to_empty() without reset_parameters())" + (
                      ", which the determinism controls fill with NaN: a plain run reads whatever the memory held "
                      "there, other numbers each time" if filled else ""), file=sys.stderr)

    def _note_met(self, pairs: list) -> None:
        """The tensors of (path, tensor) `pairs` had a params event in this step (`_on_optimizer_pre` reads it)."""
        if self._met_step != self.step:
            self._met.clear()
            self._met_step = self.step
        self._met.update(id(p) for _, p in pairs)

    def _param_made(self, module: torch.nn.Module, name: str, param) -> None:
        """A parameter registered on `module` (torch's global hook): one made inside a module call in the
        step window, not already known, is noted on the innermost call in progress, whose end takes it
        (`_made_params`)."""
        frames = getattr(self._local, "frames", None)
        if not frames or param is None or frames[-1].recompute is not None or not self._in_window():
            return
        frame = frames[-1]
        entry = self._params.get(id(param))
        if (entry is None or entry[0]() is not param) and not type(frame.module).__module__.startswith(
                "torch.distributed"):  # (not one put back: FSDP's wrapper sets its views as parameters at each call)
            if frame.made is None:
                frame.made = (time.time_ns(), [])  # (when the first was made: the start of their event)
            frame.made[1].append((module, name, param))

    def _made_params(self, frame) -> None:
        """The `params` event of the parameters made during the call of `frame` (Pyro's AutoNormal makes its
        own in its first forward from the shapes it meets; a module that builds a layer when it first sees
        its input), taken as the call ends, before its forward event: they are the call's weights, and a
        difference in how they were made is theirs, not the call's computation (helper 78: an
        AutoNormal's init_scale was blamed on its forward). Its start is when the first was made, inside
        the call (backend/params_blame.py, `made_in_call`). Each is named by its path from the call's
        module, or its own name where that does not reach it."""
        (t0, made), frame.made = frame.made, None
        try:  # (those still in their place: not functional_call's, put back as it returns)
            ids = {id(p) for m, n, p in made if m._parameters.get(n) is p}
            module = frame.module
            pairs = [(f".{clean_name(eager_name(n))}", p) for n, p in module.named_parameters()
                     if id(p) in ids and not is_lazy(p)]
            reached = {id(p) for _, p in pairs}
            pairs += [(f".{n}", p) for _, n, p in made if id(p) in ids and id(p) not in reached and not is_lazy(p)]
            if not pairs:
                return
            self._emit("optimizer", "params", frame.name, type(module).__name__, 0, t0, self._param_digested(pairs))
            self._note_met(pairs)
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail("_made_params", exc)

    def _parts_of(self, root: torch.nn.Module) -> set[int]:
        """The ids of the parts of `root`, called outside any other module, found again at each step (a part
        added between steps); its call's frame holds them, and `_called_inside` tells a call inside it of a
        module that is not one of them."""
        parts = self._parts.get(id(root))
        if parts is None or parts[2] != self.step or parts[0]() is not root:
            parts = self._parts[id(root)] = (weakref.ref(root), {id(m) for m in root.modules()}, self.step)
        return parts[1]

    def _called_inside(self, module: torch.nn.Module, name: str, t0: int, parts: set[int]) -> None:
        """A module called inside a root's call that is not one of the root's parts (`parts`, which it joins
        for the rest of the step): a target network given to the policy's forward (Tianshou's DQN,
        `policy(batch, model=model_old)`), a teacher passed as an argument. Its weights are its call's as a
        root's are: a params event as a call of a step first meets them (`_params_due`). Helper 80: a target
        network synced at another step was blamed on its first Linear computing differently."""
        parts.update(id(m) for m in module.modules())
        if next(module.parameters(), None) is None:
            return
        versions = self._params_due(module)
        if versions is not None:
            self._start_params(module, name, type(module).__name__, t0, versions)

    def _swapped_params(self, module: torch.nn.Module, name: str, t0: int) -> None:
        """A `params` event for a call, inside another module's, of a module whose own parameters are
        tensors put in their place (`functional_call`, tensordict's `to_module`: a target network's
        weights kept apart and updated by hand, given to its module inside a loss's forward; helper
        47, torchrl's DQNLoss): a difference there is in the weights given, not in the module's
        code. Not where the call of the root around it took them (a root run through functional_call:
        its `params` event holds them)."""
        if self._foreign_call == self._generation:
            return
        own = module._parameters
        slots = self._slots_of.get(id(module))
        if slots is None or slots[0]() is not module:
            swapped = any(p is not None and not isinstance(p, torch.nn.Parameter) for p in own.values())
            pairs = [(f".{n}", p) for n, p in own.items() if p is not None] if swapped else ()
        else:  # another tensor in a slot than the parameter named there: functional_call's tensors, tensordict's
            swapped = False  # to_module's new Parameters (helper 62: torchrl's target networks); pairs only then
            for n, ref in slots[1]:
                p = own.get(n)
                if p is None:
                    p = _emptied_slot(module, own, n)
                if p is not None and p is not ref():
                    swapped = True
                    break
            if swapped:
                named = {n for n, _ in slots[1]}
                pairs = [(f".{n}", p) for n, _ in slots[1]
                         if (p := own.get(n)) is not None or (p := _emptied_slot(module, own, n)) is not None]
                pairs += [(f".{n}", p) for n, p in own.items() if p is not None and n not in named]
        if swapped:
            self._emit("optimizer", "params", name, type(module).__name__, 0, t0, self._rows(pairs, "param"))

    def _param_rows(self, module: torch.nn.Module) -> tuple[list, list]:
        """The `param` rows of every parameter of `module` (FSDP1 flat parameters split into the
        parameters they hold, `sharded.final_params`), and the (path, tensor) pairs they are of."""
        params = [(f".{clean_name(eager_name(n))}", p) for n, p in module.named_parameters() if not is_lazy(p)]
        if not params:
            return [], []
        params, marks = self._sharded.final_params(params)
        rows = self._param_digested(params)
        mark(rows, marks)
        return rows, params

    def _param_digested(self, pairs: list) -> list:
        """The `param` rows of (path, tensor) pairs, their host tensors digested in one call."""
        digests = plain_digests([t for _, t in pairs])
        return [self._row(t, "param", i, path, d) for i, ((path, t), d) in enumerate(zip(pairs, digests))]

    # -- optimizer -------------------------------------------------------------------------
    def _on_optimizer_pre(self, optimizer, args, kwargs) -> None:
        """Before an optimizer's step: the tensors it steps that nothing recorded holds, met for the
        first time, are adopted here, as `_emit_steps` would after the step, and a params event of
        theirs is taken before the update (`FIRST_STEP`): their values as the step found them. (Helper
        56: a model run only through `.forward()` initialised differently was blamed on its gradient, or
        on the input of the next module called, at step 0, where nothing had observed its parameters
        before the step had updated them.) Named apart from their params events at the start of each
        step after: a resumed run's first step takes this one after its batches, where the run it
        resumed took those before (compare leaves params events of the resumed step unpaired). An
        optimizer whose tensors were all known, and are as many, is passed over at once. Before a step window
        (a drill's replay of step K) they are adopted all the same, with no event: the window's first root call
        then takes their params event as the whole recording did (helper 92: a learned temperature's event was
        "missing from the replay", and drill said nondeterminism)."""
        if initialising_step():
            return
        in_window = self._in_window()
        size = sum(len(group["params"]) for group in optimizer.param_groups)
        known = self._known_at_step.get(id(optimizer))
        fresh = known is None or known[0]() is not optimizer or known[1] != size
        unnamed = [(g, j, p) for g, group in enumerate(optimizer.param_groups) for j, p in enumerate(group["params"])
                   if self._unnamed(p)] if fresh else []
        # (helper 68: a flow trained through its .inverse(), never called, had its tensors named by their places in
        # the optimizer, param_groups[0][20], in what compare says: a tensor a model the user's code holds holds has
        # its row in the optimizer's params event named as that model names it, `model.flows.2.s`)
        held = self._kept_names(sys._getframe(1)) if unnamed else {}
        # (args: the optimizer first; a closure calls the model inside step(): its gradients and params are made there)
        if in_window and not any(a is not None for a in args[1:]) and kwargs.get("closure") is None:
            self._take_given(optimizer)
            self._uncalled_roots(optimizer, size)
        if not fresh:
            return
        label, new = None, []
        for g, j, p in unnamed:
            label = label or self._optimizer_label(optimizer)
            self._adopt(p, f"{label}.param_groups[{g}][{j}]", held.get(id(p)))
            if id(p) in self._orphans:
                new.append(self._orphans[id(p)][1:] + (p,))
        self._known_at_step[id(optimizer)] = (weakref.ref(optimizer), size)
        if in_window:
            self._emit_orphans(new, time.time_ns(), FIRST_STEP)

    def _kept_names(self, frame) -> dict[int, str]:
        """id of each parameter of the models the user's frames above `frame` hold -> its name there (it contains
        its failures: none, then)."""
        try:
            names = {}
            for key, value, _ in self._kept_found(kept.user_frames(frame, self.began)):
                if isinstance(value, torch.nn.Module):
                    for p_name, p in value.named_parameters():
                        names.setdefault(id(p), f"{key}.{clean_name(eager_name(p_name))}")
            return names
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail("_kept_names", exc)
            return {}

    def _unnamed(self, p) -> bool:
        """A tensor stepped now that no root named (an FSDP1 flat parameter is named by what it holds)."""
        entry = self._params.get(id(p))
        return not (entry is not None and entry[0]() is p) and p.grad is not None and id(p) not in self._sharded.flats

    def _take_given(self, optimizer) -> None:
        """The gradients a step() is given, digested before it runs: its events' `grad` rows are what it
        used, where one read after it would be what it left in `.grad` (helper 54: Keller Jordan's Muon
        makes its update in the gradient, in place; another momentum was said to have changed the gradient
        between backward and step(), and the same update written out of place to differ). Not with a
        closure, whose calls inside step() make the gradients (LBFGS; the caller checks), nor of an FSDP1
        flat parameter."""
        flats = self._sharded.flats
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None and id(p) not in flats]
        self._given[id(optimizer)] = {id(g): (g, d) for g, d in zip(grads, plain_digests(grads)) if d is not None}

    def _uncalled_roots(self, optimizer, size: int) -> None:
        """A params event, as step() finds them, for each root module holding tensors `optimizer` steps whose
        params event this step has not taken: no call of it met in this step (helper 56: a model run only
        through its `.forward()`, as gpytorch's are, found as a kept model while a --steps window had not begun,
        had no params event in the window, and weights it was made with differently were blamed on the data; a
        GAN's generator called in the step its discriminator's step() ended). Which roots hold its tensors is
        looked for again when its tensors or the roots change."""
        roots = self._stepped_roots.get(id(optimizer))
        if roots is None or roots[0]() is not optimizer or roots[1] != size or roots[2] is not self._roots \
                or roots[3] != len(self._roots):
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            held = []
            for ref, name in self._roots:
                module = ref()
                stepped = [weakref.ref(p) for p in module.parameters() if id(p) in ids] \
                    if isinstance(module, torch.nn.Module) else []
                if stepped:
                    held.append((ref, name, stepped))
            roots = self._stepped_roots[id(optimizer)] = (weakref.ref(optimizer), size, self._roots, len(self._roots), held)
        t0 = None
        met = self._met if self._met_step == self.step else ()
        for ref, name, stepped in roots[4]:
            module = ref()
            at = self._params_at.get(id(module))
            if module is None or (at is not None and at[1] == self.step and at[0]() is module):
                continue
            if met and all(id(p()) in met for p in stepped):  # (its parts' own params events took them: a
                continue  # LightningModule whose training_step calls self.net)
            t0 = t0 or time.time_ns()
            self._start_params(module, name, type(module).__name__, t0, module_versions(module))

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if initialising_step():  # (no training step: torch fills the state in before loading one)
            return
        try:
            self._step_ended(optimizer)
        finally:
            self._given.pop(id(optimizer), None)

    def _foreign_step(self, optimizer) -> None:
        """An optimizer that is not torch.optim's updated the weights (Keras', fastai's: collectors/foreign_steps.py):
        the step ends as at torch.optim's. One that keeps torch.optim's shape (`param_groups` of parameters,
        `state` by parameter: fastai's) has an event per parameter it updated, as torch.optim's has: an update
        that differs is found at its step (helper 75: fastai's lr raised from step 4 was found at step 5, in the
        weights the next step began from, as "updated outside torch.optim"); another's (Keras') writes what the
        next step's params event reads."""
        if self.api is not None:
            self.api.foreign_stepped(optimizer)
        self._step_ended(optimizer if _torch_shaped(optimizer) else None)

    def _step_ended(self, optimizer) -> None:
        """A training step ends: an event per parameter torch.optim's `optimizer` updated (None:
        another library's, whose parameters are not known), then the step counter advances and the
        step's events go to the store, whatever failed on the way (an error here loses neither the
        step nor the other parameters' events)."""
        self._steps_taken += 1
        in_pass = optimizer is not None and self._step_in_pass()
        try:
            if not in_pass:
                self._flush_backward(ended=False)
            if optimizer is not None and self._in_window():
                self._emit_steps(optimizer)
            # Looked for at the first four steps, at every power of two, and at each step whose user frames hold
            # a variable or an attribute of their `self` the last look did not see (or one of another type):
            # an EMA made at step 5 of 7 was never found (helpers 27 and 29). A look costs 0.5 to 0.9 ms, the
            # check 5 to 30 us (a 12-layer MLP, 2026-12-06).
            taken, users = self._steps_taken, kept.user_frames(sys._getframe(1), self.began)
            if taken <= 4 or not taken & (taken - 1) or self._kept_changed(users):
                self._guard(self._adopt_kept)(users)
        finally:
            if not in_pass:
                self._end_step()

    def _step_in_pass(self) -> bool:
        """Does this step() run inside a backward pass, and will the training step end with the pass? An
        optimizer stepped from a gradient hook (optimizer-in-backward: one optimizer a parameter, stepped
        as its gradient is accumulated, torchtune's and PyTorch's tutorial's) ends no training step of its
        own: the step ends once, when the pass does (`_pass_ended`). Each such step() ended one, and four
        iterations of a six-parameter model were recorded as steps 0 to 23 (helper 66)."""
        if not in_backward_pass():
            return False
        if self._step_after_pass:
            return True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._pass_ended)
        except RuntimeError:  # (not inside a backward pass after all: the step ends here)
            return False
        self._step_after_pass = True
        return True

    def _pass_ended(self) -> None:
        """The backward pass in which optimizers stepped is over: the training step ends, once (unless
        the recording was paused or ended meanwhile). Autograd calls this directly."""
        self._step_after_pass = False
        self._guarded(self._flush_backward, False)
        self._guarded(self._end_step)

    def _kept_changed(self, users: list) -> bool:
        """Do the user's frames hold what they did not at the last look (`kept.marks`)? (It contains
        its failures: no, then.)"""
        try:
            return kept.marks(users, self._kept_holders) != self._kept_marks
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail("_kept_changed", exc)
            return False

    def _adopt_kept(self, users: list) -> None:
        """Models the training keeps but never calls, found among the variables of the user's code
        that called step() (`users`, `kept.user_frames`: their locals or globals, and the attributes
        of their `self`): a
        hand-written EMA copy, updated in place under no_grad and saved at the end, is one. Each is
        made a root and held, so that its final state is recorded; a model called later is a root
        already, named the same. Wrappers of torch.distributed's are left alone (not held)."""
        names, found = self._names, self._kept_found(users)
        self._kept_holders = frozenset(key.partition(".")[0] for key, _, _ in found)
        self._kept_marks = kept.marks(users, self._kept_holders)
        for key, value, place in found:
            try:
                if type(value) in (list, dict):  # an object's shadow weights (diffusers' EMAModel): a root of its own
                    entry = self._kept_lists.get(id(value))
                    if entry is not None and entry.kept is value:
                        continue
                    # a new list in the same place, an attribute or else a variable of the user's code, is the
                    # same root, which holds the newest only (helper 72: a dict of clones made at every step
                    # was a root a step, each held to the end: a copy of the weights a step)
                    slot = (id(place[0]), place[1]) if place is not None else key
                    entry = self._kept_places.get(slot)
                    if entry is not None and (place is None or entry.place[0] is place[0]):
                        self._kept_lists.pop(id(entry.kept), None)
                        if place is None:
                            entry.kept = value
                        entry.refresh()
                    else:
                        entry = kept.KeptTensors(value, place)
                        self._register_root(entry, key)
                        self._kept_places[slot] = entry
                    self._kept_lists[id(value)] = entry
                    continue
                entry = names.get(id(value))
                if (entry is None or entry[0]() is not value) and any(True for _ in value.parameters()) \
                        and not any(map(is_distributed, value.modules())):
                    self._register_root(value, key)
            except Exception as exc:  # noqa: BLE001 - one object that cannot be held: the others still are
                self._fail("_adopt_kept", exc)

    def _register_holder(self, module, frame) -> bool:
        """Register as a root, named as a called one is (by its class), the model the user's frames above
        `frame` hold that holds `module` as a part, where one does: `module` is met called outside any other
        (`vae.encoder(x)`, a flow's `.inverse()` calling its parts), and is named by its path in that model,
        `encoder`, as when the model calls it. Looked for at such a part's first call: the look for kept models
        after the early steps found the model and named it by its variable, so the part was `encoder` at step 0
        and `vae.encoder` from step 1 (a run resumed at step 2 named its first step's calls apart from the same
        step of the run it resumed, helper 68), and a variable renamed in a refactor renamed every event (helper
        70). Whether one was registered (it contains its failures: no)."""
        try:
            for _, value, _ in self._kept_found(kept.user_frames(frame, self.began)):
                if isinstance(value, torch.nn.Module) and value is not module and original(value) is value \
                        and any(m is module for m in value.modules()) and not any(map(is_distributed, value.modules())):
                    # (torch.compile's wrapper of the module called is that module, named as it is)
                    self._register_root(value)
                    return True
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self._fail("_register_holder", exc)
        return False

    def _kept_found(self, users: list) -> list[tuple[str, object, tuple | None]]:
        """What the user's frames `users` hold that the training keeps (`kept.found_in`), the models already
        roots left out by their parameters' shapes, each object under its shortest path first."""
        found, shapes = [], set()
        for module in (ref() for ref, _ in self._roots):
            if module is not None and not isinstance(module, kept.KeptTensors):
                params = [p for p in module.parameters() if not is_lazy(p)]  # (a lazy module never called: no shape)
                shapes.add(tuple(tuple(p.shape) for p in params))
                shapes.add(tuple(tuple(p.shape) for p in params if p.requires_grad))
        found += kept.found_in(list(users), shapes)
        # one object found along several paths is named by the shortest (helper 30: accelerate's save hook's
        # closure holds the EMA too, and a run that registers no hook named it otherwise)
        found.sort(key=lambda item: item[0].count("."))
        return found

    def _skipped_step(self) -> None:
        """`GradScaler.step` skipped the optimizer's step (an inf or NaN gradient): the step ends all
        the same, without optimizer events (collectors/scaler.py)."""
        if not self._advance:  # (another optimizer's step ended it already)
            self._flush_backward(ended=False)
            self._end_step()

    def _end_step(self) -> None:
        """The step counter advances, and the step's events go to the store."""
        if self._held:
            self._guard(self._let_go)()
        self._advance = True
        self._walked.clear()
        self._purge_dead()
        if self._json is not None and self._json.noted:
            self._guard(self._json_written)()
        self._drain()
        # End of a training step: the previous step is durable before this one's events go on.
        if not self.store.step_barrier():
            self._fail("step barrier", TimeoutError("writer did not commit within 30 s"))

    def _optimizer_label(self, optimizer) -> str:
        """Its class name, `Class#i` for the i-th (from 1) other optimizer of that class seen stepping:
        what names a parameter only an optimizer knows (`_adopt`), unique when each layer has its own."""
        entry = self._optimizers.get(id(optimizer))
        if entry is None or entry[0]() is not optimizer:
            kind = type(optimizer).__name__
            n = self._optimizers_seen[kind] = self._optimizers_seen.get(kind, -1) + 1  # (never by id: ids are reused)
            entry = self._optimizers[id(optimizer)] = (weakref.ref(optimizer), f"{kind}#{n}" if n else kind)
            unheld = set().union(*self._unheld.values()) if self._unheld else set()
            if any(id(p) in unheld for group in optimizer.param_groups for p in group["params"]):
                # its parameters' root (a DDP wrapper) is not held, and Lightning drops it and the
                # optimizer when the script ends: the optimizer keeps them for their final state
                self._held_optimizers.append(optimizer)
        return entry[1]

    def _emit_steps(self, optimizer) -> None:
        opt_type = type(optimizer).__name__
        label = self._optimizer_label(optimizer)
        stack = self._stacks.capture()  # one call: every parameter's event has this stack
        # every tensor of the step at once: one kernel call for the host ones
        steps = []
        for g, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                # the gradient as step() used it: after any reduction across ranks (DDP, FSDP), which
                # the gradient events, taken as autograd produced it, do not see (torch.optim leaves .grad)
                tensors = [("param", 0, "", p), ("grad", 0, "", p.grad)]
                if self.mode == "full":
                    state = optimizer.state.get(p)  # (None for a parameter ZeroRedundancyOptimizer's load_state_dict
                    if isinstance(state, Mapping):  # left to another rank's shard: helper 63)
                        tensors += [("state", i, f"['{k}']", v) for i, (k, v) in enumerate(
                            (k, v) for k, v in state.items() if isinstance(v, torch.Tensor))]
                parts = self._sharded.step_parts(p, tensors)
                for name, t, marks in [(None, tensors, None)] if parts is None else parts:
                    if name is None:  # (a FlatParameter's parts are named by the parameters they hold)
                        entry = self._params.get(id(p))
                        name = entry[1] if entry is not None and entry[0]() is p else \
                            self._adopt(p, f"{label}.param_groups[{g}][{j}]")
                    steps.append((t, name, marks))
        # (a gradient digested before the step as it was given, `_take_given`, is not digested again)
        given = self._given.pop(id(optimizer), None) or {}
        before, todo = [], []
        for tensors, *_ in steps:
            for role, _, _, t in tensors:
                taken = given.get(id(t)) if role == "grad" else None
                before.append(taken[1] if taken is not None and taken[0] is t else None)
                if before[-1] is None:
                    todo.append(t)
        fresh = iter(plain_digests(todo))
        digests = [b if b is not None else next(fresh) for b in before]
        at = 0
        for tensors, name, marks in steps:
            taken, at = digests[at:at + len(tensors)], at + len(tensors)
            try:
                self._emit_step(tensors, name, marks, taken, opt_type, stack)
            except Exception as exc:  # noqa: BLE001 - one parameter's event lost, said so; the others go on
                self._fail("optimizer step", exc)

    def _adopt(self, p: torch.nn.Parameter, where: str, held: str | None = None) -> str:
        """Name and watch a parameter an optimizer steps that no root registered: frozen when its
        root was first called and unfrozen since, or put into the model later
        (`load_state_dict(assign=True)`, a layer added). Named as the root that holds it now names
        it, else by its place in the optimizer (`where`): stable from run to run, where its id was not (two
        identical runs compared diverged). Its gradients are watched from now on; its name. One no root holds
        has its values in its optimizer's params event, its row there named `held` if given (the path a model
        the user's code holds gives it)."""
        for ref, _ in self._roots:
            module = ref()
            for p_name, q in (module.named_parameters() if module is not None else ()):
                if q is p:
                    return self._watch_at(module, p_name, p)
        where = library_name(p) or where
        # (its events named by its place, never by `held`: a variable renamed in the user's code would rename them,
        # and a refactor that changes nothing else compare diverged, helper 70)
        self._watch_param(p, where, "")
        self._orphans[id(p)] = (weakref.ref(p), where, held)
        return where

    def _orphans_due(self) -> bool:
        """Whether the params event of the tensors only an optimizer holds is due: a new step, or one
        of them written since it was taken (a clamp between a logging call and the training's, in one
        step: helper 46, gpytorch)."""
        return bool(self._orphans) and (self._orphans_step != self.step
                                        or self._orphan_versions() != self._orphans_versions)

    def _orphan_versions(self) -> int:
        return tensor_versions(p for p in (ref() for ref, *_ in self._orphans.values()) if p is not None)

    def _orphan_params(self, t0: int) -> None:
        """At a step's first root call, and at a later call once one of them was written: a `params`
        event per optimizer (module type `optimizer`) with the tensors it steps that no root module
        holds (`_adopt`: a learned temperature, SAC's `log_alpha`), as a root's params event has its
        parameters: an edit between two steps is blamed there, not on the loss that reads them."""
        self._orphans_step = self.step
        by_optimizer = []
        for key, (ref, where, held) in list(self._orphans.items()):
            p = ref()
            entry = self._params.get(key)
            if p is None or entry is None or entry[0]() is not p:  # gone, or its id reused
                del self._orphans[key]
                continue
            by_optimizer.append((where, held, p))
        self._emit_orphans(by_optimizer, t0)
        self._orphans_versions = self._orphan_versions()

    def _emit_orphans(self, named: list, t0: int, suffix: str = "") -> None:
        """One `params` event per optimizer of (name, held name, tensor) of tensors only it holds, named by it
        (`suffix` after its name: FIRST_STEP) and each by its held name, else its place in it (a library's name: an
        event of its own)."""
        by_optimizer: dict[str, list] = {}
        for where, held, p in named:
            label, mark_, place = where.partition(".param_groups")
            by_optimizer.setdefault(label, []).append(("." + held if held else mark_ + place, p))
        for label, pairs in by_optimizer.items():
            self._emit("optimizer", "params", label + suffix, "optimizer", 0, t0, self._param_digested(pairs))

    def _emit_step(self, tensors: list, name: str, marks: list | None, digests: list, opt_type: str, stack) -> None:
        t0 = time.time_ns()
        rows = [self._row(t, role, i, path, d) for (role, i, path, t), d in zip(tensors, digests)]
        if marks is not None:
            mark(rows, marks)
        self._emit("optimizer", "step", name, opt_type, 0, t0, rows, stack)
