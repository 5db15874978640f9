"""Collectives as boundaries: every all-reduce, reduce-scatter, all-gather and broadcast a
training issues becomes one `comm` event (kind `collective`) on each rank, with its inputs
digested before the call and its outputs after it completes.

What is observed, installed by `CommObserver.install()` and removed by `remove()`:
- the c10d calls `torch.distributed.<fn>` (all_reduce, broadcast, all_gather,
  all_gather_into_tensor / all_gather_single / _all_gather_base, reduce_scatter,
  reduce_scatter_tensor / reduce_scatter_single / _reduce_scatter_base), looked up through
  `torch.distributed` or `distributed_c10d` at call time (what FSDP1, FSDP2 and user code do).
  With `async_op=True` the caller gets its own work object back, untouched; the outputs are
  digested in a callback on the work's future. On gloo that callback runs before `wait()`
  returns (the future completes before the work does); a backend that releases `wait()` first
  could let the caller write the output before it is digested.
- the functional collectives `torch.distributed._functional_collectives.<fn>` (all_reduce,
  all_gather_single / all_gather_tensor, reduce_scatter_single / reduce_scatter_tensor,
  broadcast) called eagerly: the result is waited for
  at once (an AsyncCollectiveTensor is completed early; its values are the same), then digested.
  Calls of `torch.ops._c10d_functional.*` made directly, and every collective inside a graph
  torch.compile traced, are not observed.
- not observed either: the object collectives (all_gather_object, broadcast_object_list, ...: the
  tensor collectives they make inside carry pickled Python objects, which may hold host names or
  times), coalesced and point-to-point operations, all_to_all, and collectives made from C++
  (DDP's parameter and buffer broadcasts, `dist._broadcast_coalesced`).
- DDP's bucketed all-reduce, which runs in C++ without a Python call: through a DDP comm hook.
  A hook the user registers (`register_comm_hook`) is observed around it: the bucket as DDP
  hands it over, the tensor the hook's future delivers. When the user registers none, an
  observing hook is registered at the DDP module's first forward that computes exactly what
  the reducer's built-in reduction does (each gradient times 1/world_size as it is copied into
  the bucket, then a sum all-reduce): the bucket is multiplied by the same float in place, then
  all-reduced. The reducer divides instead (`div_`) for a gradient that is already a view of
  its bucket (gradient_as_bucket_view=True after the first step); that is the same bitwise only
  when the world size is a power of two, so with gradient_as_bucket_view and another world size,
  a sparse gradient, a join with a changing divisor, DDP's Python reducer or a built-in C++ hook
  (`_register_builtin_comm_hook`) the reduction is left alone and not observed (one line on
  stderr says so): the optimizer step events still hold each gradient as the optimizer used it.

The event: boundary `comm.<fn>#<group>` (`comm.ddp_bucket<i>#<group>` for DDP bucket i), the
group as its global ranks (`0-3`, or `0,2`); module_type the operation (`sum`, `avg`, `gather`,
`src 0` for a broadcast, a DDP hook's name, `allreduce_mean` for the built-in DDP reduction).
Rows: role `input` before, `output` after; each path ends in `@N`, the collective's position in
its group's order within the step, counted when it is issued: the same collective has the same
N on every rank of the group (backend/crossrank.py pairs them by it). A broadcast's input is
recorded on its source rank only. A DDP bucket has one row per parameter in it (path
`['module.head.weight']@N`: its part of the bucket), and so has a collective a comm hook makes
on the bucket itself (its all-reduce); one row for the whole bucket when the gradients are not
plain slices of it or a user's hook returns another layout. Collectives write their outputs without bumping the tensor's
version counter, so every tensor here is digested afresh, never from the digest cache.

Nothing here knows how events are stored or compared; the digests and rows are the Collector's.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
import weakref

import torch

from bitguard.schema import TENSORS

PHASE, KIND = "comm", "collective"
_XOR, _POS, _UNOBSERVED = (TENSORS.names.index(c) for c in ("xor", "pos", "unobserved"))  # slots of a row
BUILTIN_DDP = "allreduce_mean"  # module_type of DDP's own reduction, observed

# c10d functions: canonical name, the arguments that are inputs and outputs, and whether the
# operation has a reduce op (`op`).
_C10D = {
    "all_reduce": ("all_reduce", ("tensor",), ("tensor",)),
    "broadcast": ("broadcast", ("tensor",), ("tensor",)),
    "all_gather": ("all_gather", ("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": ("all_gather_into_tensor", ("input_tensor",), ("output_tensor",)),
    "all_gather_single": ("all_gather_into_tensor", ("input_tensor",), ("output_tensor",)),
    "_all_gather_base": ("all_gather_into_tensor", ("input_tensor",), ("output_tensor",)),
    "reduce_scatter": ("reduce_scatter", ("input_list",), ("output",)),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", ("input",), ("output",)),
    "reduce_scatter_single": ("reduce_scatter_tensor", ("input",), ("output",)),
    "_reduce_scatter_base": ("reduce_scatter_tensor", ("input",), ("output",)),
}
# c10d functions that move pickled Python objects: not tensor boundaries; the tensor collectives
# they make inside (of the pickled bytes, which may hold anything: host names, times) are not observed
_OBJECTS = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
            "send_object_list", "recv_object_list")
# functional collectives: canonical name and the name of their reduce op argument (None: none)
_FUNCOL = {
    "all_reduce": ("all_reduce", "reduceOp"),
    "all_gather_single": ("all_gather_into_tensor", None),
    "all_gather_tensor": ("all_gather_into_tensor", None),
    "reduce_scatter_single": ("reduce_scatter_tensor", "reduceOp"),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", "reduceOp"),
    "broadcast": ("broadcast", None),
}


def group_label(ranks) -> str:
    """A group's global ranks as a boundary suffix: `0-3` for a run of ranks, else `0,2,5`
    (read back by backend/crossrank.py `group_of`)."""
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _op_name(op) -> str:
    if op is None:
        return "sum"
    if isinstance(op, str):
        return op.lower()
    name = getattr(op, "name", None)
    if name is None:  # a ReduceOp object (premul_sum): its kind
        name = str(getattr(op, "op", op)).rpartition(".")[2]
    return str(name).lower()


def _binder(orig):
    """A fast `inspect.signature(orig).bind(...).arguments` with defaults applied (these functions
    take no *args or **kwargs; binding through inspect costs more than the rest of the event)."""
    params = list(inspect.signature(orig).parameters.values())
    names = [p.name for p in params]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def bind(args, kwargs) -> dict:
        bound = dict(defaults)
        bound.update(zip(names, args))
        bound.update(kwargs)
        return bound

    return bind


def _flat(value, name: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [("", value)]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
    return []


def _unobserved_note(why: str) -> None:
    print(f"bitguard: DDP's gradient all-reduce is not observed ({why}); each optimizer step event still "
          f"holds the reduced gradient step() used", file=sys.stderr)


class _Pending:
    """A collective issued and not yet completed: what its event needs when it does."""

    __slots__ = ("boundary", "op", "t0", "rows", "outputs", "issue", "stack")

    def __init__(self, boundary, op, t0, rows, outputs, issue, stack):
        self.boundary, self.op, self.t0, self.rows = boundary, op, t0, rows
        self.outputs, self.issue, self.stack = outputs, issue, stack


class _DDPState:
    """Per DDP module: the hook we registered (None: none yet) and the user's hook it runs."""

    __slots__ = ("ours", "user")

    def __init__(self):
        self.ours = False  # our observing hook is registered with the reducer
        self.user = None  # (state, hook) a user registered after ours: run inside ours


class CommObserver:
    """The collectives observer of one Collector (its `_row`, `_emit`, `_fail`, window)."""

    def __init__(self, collector):
        self.c = collector
        self._local = threading.local()
        self._lock = threading.Lock()
        self._issues: dict[str, int] = {}  # group label -> collectives issued on it in `_issue_step`
        self._issue_step = -1
        self._patched: list[tuple[object, str, object, object]] = []  # (owner, name, original, ours)
        self._ddp: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._originals: dict[str, object] = {}
        # DDP buckets being reduced: buffer address -> (numel, parts), so that a collective a comm
        # hook makes on the bucket is cut into the same per-parameter rows as the bucket's event
        self._buckets: dict[int, tuple[int, list]] = {}

    # -- installation ----------------------------------------------------------------------
    def install(self) -> CommObserver:
        try:
            import torch.distributed as dist
        except Exception:  # noqa: BLE001 - a torch without distributed: nothing to observe
            return self
        if not dist.is_available():
            return self
        from torch.distributed import distributed_c10d as c10d

        for name, spec in _C10D.items():
            orig = getattr(c10d, name, None)
            if orig is None:
                continue
            self._originals[name] = orig
            wrapper = self._c10d_wrapper(orig, *spec)
            for owner in (c10d, dist):
                if getattr(owner, name, None) is orig:
                    self._patch(owner, name, orig, wrapper)
        for name in _OBJECTS:
            orig = getattr(c10d, name, None)
            if orig is None:
                continue
            wrapper = self._unobserved(orig)
            for owner in (c10d, dist):
                if getattr(owner, name, None) is orig:
                    self._patch(owner, name, orig, wrapper)
        try:
            from torch.distributed import _functional_collectives as funcol
        except Exception:  # noqa: BLE001
            funcol = None
        for name, spec in _FUNCOL.items():
            orig = getattr(funcol, name, None) if funcol is not None else None
            if orig is not None:
                self._patch(funcol, name, orig, self._funcol_wrapper(orig, *spec))
        self._install_ddp()
        return self

    def remove(self) -> None:
        for owner, name, orig, ours in reversed(self._patched):
            if getattr(owner, name, None) is ours:  # (wrapped again since by someone else: left in their chain)
                setattr(owner, name, orig)
        self._patched.clear()

    def _patch(self, owner, name: str, orig, ours) -> None:
        setattr(owner, name, ours)
        self._patched.append((owner, name, orig, ours))

    # -- common ----------------------------------------------------------------------------
    def _observing(self) -> bool:
        """Record this call? Not while a collective is already being recorded on this thread (one
        c10d function calling another), not while torch.compile traces, not outside the window."""
        c = self.c
        return c.enabled and not getattr(self._local, "depth", 0) and c._in_window()

    def _issue(self, label: str) -> int:
        with self._lock:
            if self._issue_step != self.c.step:
                self._issues.clear()
                self._buckets.clear()  # (those of a hook that raised)
                self._issue_step = self.c.step
            n = self._issues.get(label, 0)
            self._issues[label] = n + 1
            return n

    def _fresh_rows(self, pairs, role: str, issue: int) -> list[list]:
        """Rows digested now, never from the digest cache: a collective writes its output without
        bumping the version counter, so a cached digest of the same version may be stale."""
        c = self.c
        rows = []
        for i, (path, t) in enumerate(pairs):
            entry = c._tids.get(id(t))
            if entry is not None and entry[0]() is t:
                entry[2] = None
            rows.append(c._row(t, role, i, f"{path}@{issue}"))
        return rows

    def _begin(self, canonical: str, group, inputs, outputs, op: str) -> _Pending | None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized() or c10d._rank_not_in_group(group):
            return None
        ranks = dist.get_process_group_ranks(group if group is not None else c10d._get_default_group())
        return self._pending(f"comm.{canonical}#{group_label(ranks)}", op, inputs, outputs, group_label(ranks))

    def _pending(self, boundary: str, op: str, inputs, outputs, label: str) -> _Pending:
        issue = self._issue(label)
        t0 = time.time_ns()
        rows = self._fresh_rows(inputs, "input", issue)
        return _Pending(boundary, op, t0, rows, outputs, issue, self.c._stacks.capture())

    def _end(self, p: _Pending, outputs=None, unobserved: str | None = None) -> None:
        """The collective completed: its event, with the outputs digested now."""
        c = self.c
        if not c.enabled:
            return
        pairs = p.outputs if outputs is None else outputs
        rows = self._fresh_rows(pairs, "output", p.issue)
        if unobserved is not None:  # rows with the tensors' names and shapes, marked: digests mean nothing
            for row in rows:
                row[_XOR], row[_POS], row[_UNOBSERVED] = 0, 0, unobserved
        c._emit(PHASE, KIND, p.boundary, p.op, 0, p.t0, p.rows + rows, p.stack)

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except _Theirs as theirs:  # the training's own failure, met by our wait: raised to it, as it is
            raise theirs.__cause__ from None
        except Exception as exc:  # noqa: BLE001 - the training must go on
            self.c._fail("comm", exc)
            return None

    # -- c10d ------------------------------------------------------------------------------
    def _wrapped(self, orig, begin, end):
        """`orig` observed: `begin(args, kwargs)` before the call (a `_Pending`, or None to let it
        pass), `end(pending, result)` after; a failure of either is the collector's, never the
        caller's, and the call itself is made exactly as the caller made it."""

        @functools.wraps(orig)
        def collective(*args, **kwargs):
            # first: dynamo, tracing a compiled function that calls this, folds it to the call of
            # `orig` (which it rewrites as a functional collective, as in a plain compiled run)
            if torch.compiler.is_compiling() or not self._observing():
                return orig(*args, **kwargs)
            pending = self._try(begin, args, kwargs)
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                result = orig(*args, **kwargs)
            finally:
                self._local.depth -= 1
            if pending is not None:
                self._try(end, pending, result)
            return result

        return collective

    def _unobserved(self, orig):
        """`orig`, with the collectives it makes inside not observed."""

        @functools.wraps(orig)
        def unobserved(*args, **kwargs):
            self._local.depth = getattr(self._local, "depth", 0) + 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._local.depth -= 1

        return unobserved

    def _c10d_wrapper(self, orig, canonical: str, in_args: tuple, out_args: tuple):
        return self._wrapped(orig, functools.partial(self._c10d_begin, _binder(orig), canonical, in_args, out_args),
                             self._c10d_end)

    def _c10d_begin(self, bind, canonical, in_args, out_args, args, kwargs) -> _Pending | None:
        a = bind(args, kwargs)
        group = a.get("group")
        inputs = self._cut([pair for name in in_args for pair in _flat(a.get(name), name)])
        outputs = self._cut([pair for name in out_args for pair in _flat(a.get(name), name)])
        if canonical == "broadcast":
            import torch.distributed as dist

            src = a.get("src")
            if src is None and a.get("group_src") is not None:
                src = dist.get_global_rank(group, a["group_src"]) if group is not None else a["group_src"]
            op = f"src {src}"
            if dist.is_initialized() and src != dist.get_rank():
                inputs = []  # what a receiving rank held before does not enter the result
        elif "op" in a:
            op = _op_name(a["op"])
        else:
            op = "gather"
        return self._begin(canonical, group, inputs, outputs, op)

    def _cut(self, pairs: list) -> list:
        """`pairs` with a DDP bucket being reduced cut into its parameters' parts."""
        if not self._buckets:
            return pairs
        out = []
        for path, t in pairs:
            known = self._buckets.get(t.data_ptr()) if t.dim() == 1 and t.is_contiguous() else None
            if known is not None and known[0] == t.numel():
                out += [(path + part, view) for part, view in _slices(t, known[1])]
            else:
                out.append((path, t))
        return out

    def _c10d_end(self, p: _Pending, result) -> None:
        if result is None or not hasattr(result, "get_future"):  # synchronous: complete now
            self._end(p)
            return
        try:
            future = result.get_future()
        except Exception as exc:  # noqa: BLE001 - a work without a future (send/recv-like backends)
            self._end(p, unobserved=f"asynchronous collective without a future ({type(exc).__name__}): its "
                                    f"output could not be digested when it completed")
            return
        future.then(functools.partial(self._completed, p))

    def _completed(self, p: _Pending, future) -> None:
        """Runs when an asynchronous collective completes (on the backend's thread)."""
        try:
            future.value()
        except Exception:  # noqa: BLE001 - it failed: the caller's wait() raises; no output to digest
            return
        self._try(self._end, p)

    # -- functional collectives ------------------------------------------------------------
    def _funcol_wrapper(self, orig, canonical: str, op_arg: str | None):
        return self._wrapped(orig, functools.partial(self._funcol_begin, _binder(orig), canonical, op_arg),
                             self._funcol_end)

    def _funcol_begin(self, bind, canonical, op_arg, args, kwargs) -> _Pending | None:
        import torch.distributed as dist
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized() or funcol._are_we_tracing():  # (tracing: fake tensors, no values)
            return None
        a = bind(args, kwargs)
        group = c10d._resolve_process_group(funcol._resolve_group_name(a["group"], a.get("tag", "")))
        x = a["self"]
        if isinstance(x, funcol.AsyncCollectiveTensor):
            x = _waited(x)
        if canonical == "broadcast":
            src = a["src"]
            op = f"src {src}"
            inputs = [("", x)] if src == dist.get_rank() else []
        else:
            op = _op_name(a[op_arg]) if op_arg else "gather"
            inputs = [("", x)]
        return self._begin(canonical, group, inputs, [], op)

    def _funcol_end(self, p: _Pending, result) -> None:
        from torch.distributed import _functional_collectives as funcol

        out = _waited(result) if isinstance(result, funcol.AsyncCollectiveTensor) else result
        if isinstance(out, torch.Tensor) and type(out) is not torch.Tensor and hasattr(out, "elem"):
            out = out.elem
        self._end(p, [("", out)])

    # -- DDP -------------------------------------------------------------------------------
    def _install_ddp(self) -> None:
        try:
            from torch.nn.parallel import DistributedDataParallel as DDP
        except Exception:  # noqa: BLE001
            return
        init, register, builtin = DDP.__init__, DDP.register_comm_hook, DDP._register_builtin_comm_hook
        observer = self

        @functools.wraps(init)
        def __init__(ddp, *args, **kwargs):
            observer._ddp[ddp] = _DDPState()  # first: a hook DDP's own __init__ registers is observed too
            init(ddp, *args, **kwargs)
            if observer.c.enabled:
                observer._try(observer._ddp_created, ddp)

        @functools.wraps(register)
        def register_comm_hook(ddp, state, hook):
            entry = observer._ddp.get(ddp)
            if entry is not None and entry.ours and entry.user is None:
                ddp._check_comm_hook(hook)  # registered after ours (after the first forward): ours runs it
                entry.user = (state, hook)
                ddp.logger._set_comm_hook_name(hook.__qualname__)
                ddp._comm_hooks.append((hook, state))
                return
            if entry is None or not observer.c.enabled:
                return register(ddp, state, hook)
            ddp._check_comm_hook(hook)
            register(ddp, state, observer._observed_hook(ddp, hook))
            ddp._comm_hooks[-1] = (hook, state)  # DDP's Python reducer calls hooks differently: the user's own
            entry.ours = True
            entry.user = (state, hook)
            return None

        @functools.wraps(builtin)
        def _register_builtin_comm_hook(ddp, comm_hook_type):
            entry = observer._ddp.get(ddp)
            if entry is not None and not entry.ours:
                entry.ours = None  # a C++ hook: DDP's reduction is not observed
                _unobserved_note(f"the built-in C++ comm hook {comm_hook_type}")
            return builtin(ddp, comm_hook_type)

        self._patch(DDP, "__init__", init, __init__)
        self._patch(DDP, "register_comm_hook", register, register_comm_hook)
        self._patch(DDP, "_register_builtin_comm_hook", builtin, _register_builtin_comm_hook)

    def _ddp_created(self, ddp) -> None:
        entry = self._ddp.get(ddp)
        if entry is not None and entry.ours is False and getattr(ddp, "_comm_hooks", None) == []:
            holder = []
            holder.append(ddp.register_forward_pre_hook(functools.partial(self._first_forward, holder)))

    def _first_forward(self, holder: list, ddp, args) -> None:
        """The DDP module's first forward: register the observing hook if no hook was registered."""
        holder.pop().remove()
        self._try(self._register_builtin_observer, ddp)

    def _register_builtin_observer(self, ddp) -> None:
        entry = self._ddp.get(ddp)
        if entry is None or entry.ours is not False or ddp._comm_hooks or not self.c.enabled:
            return
        size = ddp.process_group.size()
        join = getattr(ddp, "_join_config", None)
        why = next((reason for reason, applies in (
            (f"gradient_as_bucket_view with world size {size}, not a power of two",
             size & (size - 1) and ddp.gradient_as_bucket_view),
            ("a sparse gradient", any(getattr(m, "sparse", False) is True for m in ddp.module.modules())),
            ("a join with a changing divisor",
             join is not None and join.enable and not getattr(ddp, "_divide_by_initial_world_size", True)),
            ("DDP's Python reducer", getattr(ddp, "_use_python_reducer", False))) if applies), None)
        if why is not None:  # see the module docstring: DDP's own reduction stays, unobserved
            _unobserved_note(why)
            return
        import torch.distributed as dist

        dist._register_comm_hook(ddp.reducer, ddp.process_group, self._observed_hook(ddp, None))
        entry.ours = True

    def _builtin_reduction(self, group, bucket):
        """What DDP's reducer does without a hook, bitwise: each gradient times the float
        1/world_size (`at::mul_out(bucket_view, grad, 1/div_factor)`), then a sum all-reduce of
        the bucket (`_AllReduceBySumCommHook`)."""
        buffer = bucket.buffer()
        buffer.mul_(1.0 / group.size())
        work = self._originals["all_reduce"](buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def _observed_hook(self, ddp, hook):
        """A comm hook running `hook` (None: the built-in reduction, or the user's hook registered
        after ours) with the bucket digested before it and its result after."""
        ref = weakref.ref(ddp)
        name = getattr(hook, "__qualname__", None) if hook is not None else None

        def observed(state, bucket):
            run_state, run = state, hook
            if hook is None:  # ours: the built-in reduction, unless a user registered a hook since
                entry = self._ddp.get(ref())
                if entry is not None and entry.user is not None:
                    run_state, run = entry.user
            pending = self._try(self._bucket_begin, ref(), bucket,
                                name or (getattr(run, "__qualname__", "hook") if run is not None else BUILTIN_DDP))
            future = self._builtin_reduction(run_state, bucket) if run is None else run(run_state, bucket)
            if pending is None:
                return future
            try:
                return future.then(functools.partial(self._bucket_done, pending))
            except Exception as exc:  # noqa: BLE001 - the user's future, unobserved
                self.c._fail("comm", exc)
                return future

        if hook is not None:
            observed.__qualname__ = observed.__name__ = getattr(hook, "__qualname__", "hook")
        return observed

    def _bucket_begin(self, ddp, bucket, op: str) -> _Pending | None:
        if not self._observing() or ddp is None:
            return None
        import torch.distributed as dist

        label = group_label(dist.get_process_group_ranks(ddp.process_group))
        buffer = bucket.buffer()
        parts = self._bucket_parts(bucket, buffer)
        p = self._pending(f"comm.ddp_bucket{bucket.index()}#{label}", op, _slices(buffer, parts), [], label)
        p.outputs = parts  # (how the result is cut, read by _bucket_done)
        if parts is not None:
            self._buckets[buffer.data_ptr()] = (buffer.numel(), parts)
        return p

    def _bucket_parts(self, bucket, buffer: torch.Tensor) -> list[tuple[str, int, torch.Size]] | None:
        """(parameter name, offset, shape) of each gradient in the bucket, in bucket order, so that
        every parameter's part of it gets its own row; None when the gradients are not plain slices
        of the buffer (then the bucket is one row)."""
        if buffer.dim() != 1 or not buffer.is_contiguous():
            return None
        params = self.c._params
        base, ptr = buffer.storage_offset(), buffer.untyped_storage().data_ptr()
        parts = []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            entry = params.get(id(p))
            if g.untyped_storage().data_ptr() != ptr or not g.is_contiguous() or entry is None or entry[0]() is not p:
                return None
            parts.append((entry[1], g.storage_offset() - base, g.shape))
        return parts or None

    def _bucket_done(self, p: _Pending, future):
        value = future.value()  # (a failed reduction raises here, into DDP, as it would have)
        parts = p.outputs
        if parts is not None:
            self._buckets = {k: v for k, v in self._buckets.items() if v[1] is not parts}
        fits = (isinstance(value, torch.Tensor) and value.dim() == 1 and value.is_contiguous()
                and parts is not None and value.numel() == sum(shape.numel() for _, _, shape in parts)
                and len(p.rows) == len(parts))
        self._try(self._end, p, _slices(value, parts if fits else None) if isinstance(value, torch.Tensor)
                  else _flat(value, "result"))
        return value


class _Theirs(Exception):
    """A failure of the training's own met inside the observer (`__cause__`): `_try` raises it to the
    training instead of reporting it as the collector's."""


def _waited(t):
    """The result of an asynchronous functional collective, waited for: a failed collective (a peer
    gone) raises here, and that error is the training's. Swallowed, the training went on with the
    tensor as it was before the reduction (helper 63: tensor parallelism on one rank's garbage, since
    the wait it later made found nothing left to wait for)."""
    try:
        return t.trigger_wait()
    except Exception as exc:
        raise _Theirs() from exc


def _slices(flat: torch.Tensor, parts) -> list[tuple[str, torch.Tensor]]:
    """A DDP bucket's flat tensor cut into its parameters' parts (path `['name']`), or whole."""
    if parts is None:
        return [("", flat)]
    return [(f"[{name!r}]", flat[offset:offset + shape.numel()].view(shape)) for name, offset, shape in parts]
