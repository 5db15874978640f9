"""The op tracer: every torch function the user's code calls inside one module call, as op records.

`OpTracer` is a `torch.overrides.TorchFunctionMode` that collectors/drill.py pushes for the
duration of the drill's window call. Each torch function call that reaches it from user code
(not from torch's own Python, not from bitguard: the collector digesting, the drill keeping bytes)
and returns at least one tensor (or writes one: `x[i] = y`, whose written tensor is then its output)
becomes one op record (schema in docs/DRILL.md, `bitguard.ops/1`):
its readable name, the module calls open around it (the collector's frames, window first), the
innermost user frame and the user frames from the window's forward down to it, its arguments with
tensors as `<tN>`, and its tensor inputs (digested before the call) and outputs (digested after,
with their bytes kept by a `Keeper`). The handler calls `func(*args, **kwargs)` with the mode
popped, as torch does for any mode, so the call dispatches exactly as it would untraced.

What it does not see: anything below the torch function boundary (the ops a C++ or Python torch
function runs inside, kernels; autograd's backward is backward_ops.py's), torch functions called
with torch function disabled (`torch._C.DisableTorchFunction`), compiled code (a torch.compile'd
module inside the window is one op, `compiled region <type>`, with its inputs and outputs:
drill.py; compiled code the drill cannot call with the mode off, a compiled function or
`module.compile()`, is traced as the graphs' Python runs it and the trace says it may differ from
the record), and calls on other threads (a mode is per thread). Collectives (torch.distributed) are not torch functions:
their writes into a tensor are not op records.

This module knows torch functions and frames; not which call is traced (drill.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from bitguard.collectors.compiled import is_compiling
from bitguard.cuda.fingerprint import digest, local_values
from bitguard.cuda.tensor_bytes import tensor_bytes

CHUNK_BYTES = 1 << 20  # a tensor over the caps is described by the digests of its chunks of this size
MAX_ARGS_CHARS = 200  # an op's `args` text at most
MAX_VALUE_CHARS = 60  # one non-tensor argument's repr at most
MAX_STACK = 64  # user frames kept in an op's `stack` (innermost ones)

# Frame kinds (`_kind`): torch's own Python, bitguard's own code, a bitguard frame a module call
# passes through (the collector's and the drill's module-call wrappers), the user's code, and
# torch's own Python of dynamo (a call of compiled code: torch's otherwise).
TORCH, OWN, TRANSPARENT, USER, DYNAMO = range(5)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DYNAMO_DIR = os.path.join(_TORCH_DIR, "_dynamo", "")
# dynamo's files of plain helpers the model's code calls as it runs, no compiled code (helper 87: torchvision's
# roi_align calls torch._dynamo.utils.is_compile_supported, and the drill said compiled code ran in its window)
_DYNAMO_HELPERS = frozenset(("utils.py", "external_utils.py"))
_TRANSPARENT: set = set()  # code objects of bitguard's module-call wrappers (`transparent`)
_TRANSPARENT_NAMES = {"hooks.py": ("_call_impl",), "compiled.py": ("observed", "<lambda>")}
_kinds: dict = {}  # code object -> kind


def _package_dirs(*names: str) -> tuple[str, ...]:
    import importlib.util

    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            dirs.append(os.path.join(os.path.realpath(location), ""))
    return tuple(dirs)


# bitguard's own code, and inside it (an installed bitguard) the sample scripts, which are users'
_OWN_DIRS = _package_dirs("bitguard", "bitguard.collectors", "bitguard.cuda", "bitguard.backend")
_SAMPLE_DIRS = _package_dirs("bitguard.sample_traces")


def transparent(*functions) -> None:
    """Mark functions a module call runs through on its way to the module's forward: their frames
    are skipped like torch's when looking for an op's caller."""
    for fn in functions:
        _TRANSPARENT.add(fn.__code__)


def _kind(code) -> int:
    kind = _kinds.get(code)
    if kind is None:
        path = code.co_filename
        real = os.path.realpath(path) if os.path.isabs(path) else path
        if code in _TRANSPARENT:
            kind = TRANSPARENT
        elif real.startswith(_TORCH_DIR) or path.startswith(_TORCH_DIR):
            in_dynamo = (real.startswith(_DYNAMO_DIR) or path.startswith(_DYNAMO_DIR)) \
                and os.path.basename(real) not in _DYNAMO_HELPERS
            kind = DYNAMO if in_dynamo and not _disabling(code) else TORCH
        elif real.startswith(_OWN_DIRS) and not real.startswith(_SAMPLE_DIRS):
            names = _TRANSPARENT_NAMES.get(os.path.basename(real), ())
            kind = TRANSPARENT if code.co_name in names and os.path.basename(os.path.dirname(real)) == "collectors" \
                else OWN
        else:
            kind = USER
        _kinds[code] = kind
    return kind


def _disabling(code) -> bool:
    """Is `code` the wrapper `torch._dynamo.disable` puts around a function (`torch.utils.checkpoint`
    runs through one: helper 24)? It turns compiling off; nothing compiled runs in it."""
    context = getattr(sys.modules.get("torch._dynamo.eval_frame"), "DisableContext", None)
    return code in getattr(getattr(getattr(context, "__call__", None), "__code__", None), "co_consts", ())


# -- names -------------------------------------------------------------------------------------
_NAMESPACES = {"torch._C._nn": "torch.nn.functional", "torch._C._linalg": "torch.linalg", "torch._C._fft": "torch.fft",
               "torch._C._special": "torch.special", "torch._C._nested": "torch.nested", "torch.functional": "torch"}
_names: dict = {}  # func -> readable name (funcs are long-lived torch objects)


def op_name(func) -> str:
    """torch's function as a user writes it: `torch.add`, `torch.Tensor.add`, `torch.Tensor.T`
    (a property read), `torch.nn.functional.gelu` (whatever C module holds it)."""
    try:
        return _names[func]
    except (KeyError, TypeError):
        pass
    name = getattr(func, "__name__", None) or type(func).__name__
    owner = getattr(func, "__self__", None)
    objclass = getattr(func, "__objclass__", None)
    module = getattr(func, "__module__", None) or ""
    qualname = getattr(func, "__qualname__", None) or name
    if name in ("__get__", "__set__", "__delete__") and owner is not None:  # a property of Tensor
        readable = f"torch.Tensor.{getattr(owner, '__name__', '?')}" + ("" if name == "__get__" else f".{name}")
    elif objclass in (torch._C.TensorBase, torch.Tensor):
        readable = f"torch.Tensor.{name}"
    elif module == "torch._tensor" and qualname.startswith("Tensor."):
        readable = f"torch.{qualname}"
    elif qualname.startswith("_VariableFunctionsClass."):
        readable = f"torch.{name}"
    elif module in _NAMESPACES:
        public = _NAMESPACES[module]
        readable = f"{public}.{name}" if public != "torch.nn.functional" or getattr(F, name, None) is func \
            else f"{module}.{name}"
    else:
        readable = f"{module}.{qualname}" if module else qualname
    try:
        _names[func] = readable
    except TypeError:
        pass
    return readable


# Functions that never write a tensor: their inputs are digested after the call, and only when
# it returned a tensor (most return none: sizes, flags, conversions to Python values).
_PURE = frozenset({"size", "dim", "numel", "stride", "is_contiguous", "data_ptr", "element_size", "storage_offset",
                   "item", "tolist", "__len__", "__bool__", "__index__", "__int__", "__float__", "__complex__",
                   "__format__", "__repr__", "__hash__", "get_device", "is_floating_point", "is_complex",
                   "nelement", "ndimension", "has_names", "is_nonzero", "equal", "untyped_storage", "numpy",
                   "__reduce_ex__", "__array__", "__contains__", "__get__", "is_set_to", "is_same_size",
                   "is_inference", "is_pinned", "is_shared", "is_signed", "dim_order"})


# Functions that write an input they do not return without moving its version counter (batch
# norm's running statistics): their inputs are digested again after the call.
_WRITES_QUIETLY = frozenset({"batch_norm", "instance_norm", "native_batch_norm", "_native_batch_norm_legit",
                             "cudnn_batch_norm", "miopen_batch_norm", "_batch_norm_impl_index"})


# -- tensors -----------------------------------------------------------------------------------
def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def describe(t: torch.Tensor, path: str) -> dict:
    """A tensor as the trace holds it: path, shape, dtype and the recorder's digests (hex), or
    `unobserved` with the reason when it cannot be read."""
    entry = {"path": path, "shape": list(t.shape), "dtype": _dtype(t), "xor": None, "pos": None, "bytes": None}
    try:
        x, p = digest(t)
        entry["xor"], entry["pos"] = f"{x:016x}", f"{p:016x}"
    except Exception as exc:  # noqa: BLE001 - marked, never dropped
        entry["unobserved"] = f"{type(exc).__name__}: {exc}"
    return entry


class Keeper:
    """Keeps tensors' logical row-major bytes as raw files in one folder, within two caps: bytes of
    one tensor, and bytes in all. Over a cap, a tensor is described by the digests of its 1 MiB
    chunks instead (`kept: "none"`, `chunks`)."""

    def __init__(self, folder: Path, relative: str, max_tensor_bytes: int, max_total_bytes: int,
                 windows: dict[str, tuple[int, ...]] | None = None):
        self.folder = folder  # where the files go (made on the first one)
        self.relative = relative  # the folder as the trace names it (relative to the replay dir)
        self.max_tensor_bytes = max_tensor_bytes
        self.max_total_bytes = max_total_bytes
        self.windows = windows or {}  # name -> chunks whose bytes to keep of a tensor over the caps
        self.total = 0  # bytes kept so far

    def keep(self, t: torch.Tensor, name: str, entry: dict) -> None:
        """Keep `t`'s bytes as `name`.bin, or its chunk digests (and the bytes of the chunks the
        spec's `windows` name for it, as `name`.cI.bin); says which in `entry`."""
        entry["kept"] = "none"
        entry["name"] = name
        if entry.get("unobserved"):
            return
        data = tensor_bytes(local_values(t))
        n = data.numel()
        if n <= self.max_tensor_bytes and self.total + n <= self.max_total_bytes:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f"{name}.bin", "wb") as f:
                f.write(data.cpu().numpy().tobytes() if n else b"")
            self.total += n
            entry["bytes"] = f"{self.relative}/{name}.bin"
            entry["kept"] = "full"
            return
        chunks = []
        for start in range(0, n, CHUNK_BYTES):
            x, p = digest(data[start:start + CHUNK_BYTES])
            chunks.append([f"{x:016x}", f"{p:016x}"])
        entry["chunks"] = chunks
        wanted = [i for i in self.windows.get(name, ()) if i * CHUNK_BYTES < n]
        if wanted:  # a window around the differing elements: the chunks another pass found differing
            self.folder.mkdir(parents=True, exist_ok=True)
            files = []
            for i in wanted:
                with open(self.folder / f"{name}.c{i}.bin", "wb") as f:
                    f.write(data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES].cpu().numpy().tobytes())
                files.append(f"{self.relative}/{name}.c{i}.bin")
            entry["window"] = {"chunks": wanted, "bytes": files, "chunk_bytes": CHUNK_BYTES}


# -- arguments ---------------------------------------------------------------------------------
def _short(value) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - an object whose repr fails is named by its type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS - 3] + "..."


def walk(obj, path: str, tensors: list, text: bool = True, depth: int = 0) -> str:
    """Collect the tensors in `obj` (tuples, lists, dicts, nested) as (path, tensor) into `tensors`
    and return `obj`'s repr with each tensor as `<tN>` (N: its index in `tensors`)."""
    if isinstance(obj, torch.Tensor):
        tensors.append((path, obj))
        return f"<t{len(tensors) - 1}>" if text else ""
    if isinstance(obj, (tuple, list)) and depth < 8 and not isinstance(obj, torch.Size):
        parts = [walk(x, f"{path}[{i}]", tensors, text, depth + 1) for i, x in enumerate(obj)]
        if not text:
            return ""
        inner = ", ".join(parts)
        return f"[{inner}]" if isinstance(obj, list) else f"({inner}{',' if len(parts) == 1 else ''})"
    if isinstance(obj, dict) and depth < 8:
        parts = [f"{k!r}: {walk(v, f'{path}[{k!r}]', tensors, text, depth + 1)}" for k, v in obj.items()]
        return "{" + ", ".join(parts) + "}" if text else ""
    return _short(obj) if text else ""


def call_text(args: tuple, kwargs: dict, tensors: list) -> str:
    """`(a, b, k=v)` of a call, its tensors collected into `tensors` (positional: `[i]`, keyword:
    `['k']`), bounded to MAX_ARGS_CHARS."""
    parts = [walk(a, f"[{i}]", tensors) for i, a in enumerate(args)]
    parts += [f"{k}={walk(v, f'[{k!r}]', tensors)}" for k, v in kwargs.items()]
    text = "(" + ", ".join(parts) + ")"
    return text if len(text) <= MAX_ARGS_CHARS else text[:MAX_ARGS_CHARS - 4] + "...)"


def _version(t: torch.Tensor):
    try:
        return t._version
    except Exception:  # noqa: BLE001 - inference tensors and some subclasses have none
        return None


# -- the mode ----------------------------------------------------------------------------------
class OpTracer(TorchFunctionMode):
    """Records the torch functions user code calls while the mode is on (see the module docstring).

    `frames` is the collector's module-call stack of this thread, `depth` the window's place in
    it, `stop` the frame below which the window's call runs (drill.py's, that pushed the mode).
    Bytes of outputs go to `keeper`; a failure of the tracer itself goes to `fail(where, exc)` and
    turns the tracer off (`active`): the call goes on untraced."""

    phase = "forward"  # the ops' `phase` (backward_ops.py traces the backward)

    def __init__(self, frames: list, depth: int, stop, keeper: Keeper, fail):
        super().__init__()
        self.frames = frames
        self.depth = depth
        self.stop = stop
        self.keeper = keeper
        self.fail = fail
        self.active = True
        self.ops: list[dict] = []
        self.compiled = False  # an op ran under a compiled call (reported once)
        self.observe = None  # called with (op record, its outputs, its inputs) after each op is recorded

    def _attends(self) -> bool:
        """Is a torch function called now one of the traced place's (a subclass narrows it)?"""
        return True

    def _fields(self) -> dict:
        """The op record's fields that say where it ran: its phase and the module calls open."""
        return {"phase": self.phase, "modules": [f.name for f in self.frames[self.depth:]]}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active or is_compiling() or not self._attends():
            return func(*args, **kwargs)
        try:
            where = self._where(sys._getframe(1), getattr(func, "__code__", None))
        except Exception as exc:  # noqa: BLE001 - the training goes on, untraced from here
            self._failed(op_name(func), exc)
            return func(*args, **kwargs)
        if where is None:  # bitguard's own call (the collector, the drill): not an op of the model
            return func(*args, **kwargs)
        name = getattr(func, "__name__", None)
        # (this handler runs with the mode popped, as torch runs every mode: dispatch is the untraced one)
        return self._call(op_name(func), func, args, kwargs, where, name in _PURE, name in _WRITES_QUIETLY)

    def region(self, name: str, f, call, args: tuple, kwargs: dict):
        """A compiled region's call inside the window (`call(*args, **kwargs)`, run with this mode
        off: dynamo must not see it) as one op: its inputs and outputs, under `name`. `f` is the
        drill's frame that runs the region's module call."""
        where = self._where(f, None, region=True) if self.active else None
        if where is None:
            return call(*args, **kwargs)
        return self._call(name, call, args, kwargs, where, False, False)

    def _call(self, name: str, func, args: tuple, kwargs: dict, where: tuple, pure: bool, quiet: bool):
        try:
            tensors: list = []
            text = call_text(args, kwargs, tensors)
            inputs = None if pure else [describe(t, p) for p, t in tensors]
            versions = [_version(t) for _, t in tensors]
        except Exception as exc:  # noqa: BLE001 - the training goes on, untraced from here
            self._failed(name, exc)
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        try:
            self._record(name, quiet, where, text, tensors, inputs, versions, result)
        except Exception as exc:  # noqa: BLE001
            self._failed(name, exc)
        return result

    def _failed(self, name: str, exc: BaseException) -> None:
        self.active = False
        self.fail(f"op tracer at {name}", exc)

    def _record(self, name: str, quiet: bool, where, text: str, tensors: list, inputs, versions: list,
                result) -> None:
        outs: list = []
        walk(result, "", outs, text=False)
        if not outs and not any(v is not None and _version(t) != v for (_, t), v in zip(tensors, versions)):
            return  # (a call that returns no tensor is an op when it wrote one: `x[i] = y`, __setitem__)
        if inputs is None:  # a function that writes nothing: its inputs as they are now
            inputs = [describe(t, p) for p, t in tensors]
        # an input the op wrote: its version moved (or, without a version counter, it is returned)
        changed = {id(t) for (_, t), v in zip(tensors, versions) if v is None or _version(t) != v}
        inplace = any(id(t) in changed for _, t in outs)
        out_ids = {id(t) for _, t in outs}
        # inputs the op wrote without returning them (running statistics, ...): outputs too
        written = [(f"input{p}", t) for (p, t), v in zip(tensors, versions)
                   if v is not None and id(t) not in out_ids and _version(t) != v]
        if quiet:
            seen = {id(t) for _, t in written} | out_ids
            for (p, t), before in zip(tensors, inputs):
                after = describe(t, p)
                if id(t) not in seen and (after["xor"], after["pos"]) != (before["xor"], before["pos"]):
                    written.append((f"input{p}", t))
                    seen.add(id(t))
        i = len(self.ops)
        outputs = []
        for k, (path, t) in enumerate(outs + written):
            entry = describe(t, path)
            self.keeper.keep(t, f"op{i:05d}-out{k}", entry)
            outputs.append(entry)
        file, line, function, stack = where
        record = {"i": i, "op": name, **self._fields(), "file": file, "line": line, "function": function,
                  "stack": stack, "args": text, "inputs": inputs, "outputs": outputs,
                  "inplace": inplace or bool(written)}
        self.ops.append(record)
        if self.observe is not None:
            self.observe(record, outs, tensors)

    def _where(self, f, own_code, region: bool = False):
        """(file, line, function, stack) of the op's caller: the innermost user frame and the user
        frames from the window's forward down to it; None when the first frame that is not
        torch's is bitguard's own (not an op of the model). In a window without user code (a
        torch module such as nn.LayerNorm) the op's place is the user's call of the window, and
        its stack that call and the innermost torch frame (other than the function's own)."""
        user: list = []
        fallback = None
        stop = self.stop
        while f is not None and f is not stop:
            code = f.f_code
            kind = _kinds.get(code)
            if kind is None:
                kind = _kind(code)
            if kind == USER:
                if len(user) < MAX_STACK:
                    user.append((code.co_filename, f.f_lineno, code.co_name))
            elif kind == OWN:
                if not user:
                    return None
            elif kind == DYNAMO and not region:  # (a region's call: its OptimizedModule's frames)
                if not self.compiled:
                    self._compiled_call(code)
                if not user:  # dynamo's own work (compiling): not an op of the model
                    return None
            elif kind == TORCH and fallback is None and code is not own_code \
                    and not code.co_filename.endswith(("overrides.py", os.path.join("modules", "module.py"))):
                fallback = (code.co_filename, f.f_lineno, code.co_name)
            f = f.f_back
        if not user:  # a window without user code: the user's call of the window, then torch's frame
            if fallback is None:
                return None
            caller = self._caller(f)
            user = [fallback] if caller is None else [fallback, caller]
            return *user[-1], [f"{fi}:{li} in {fn}" for fi, li, fn in reversed(user)]
        file, line, function = user[0]
        return file, line, function, [f"{fi}:{li} in {fn}" for fi, li, fn in reversed(user)]

    def _compiled_call(self, code) -> None:
        """Compiled code runs inside the window with the tracer on (a function compiled with
        torch.compile, or a module compiled in place with `module.compile()`, which the drill
        cannot call with the tracer off): dynamo compiles it with a torch function mode on the
        stack (graph breaks at the mode: other graphs), so the traced ops and numbers may not be
        those of the record. The ops the graphs' Python runs are traced anyway; said once (the
        trace is then not complete)."""
        self.compiled = True
        self.fail("op tracer", RuntimeError(
            f"compiled code ({os.path.basename(code.co_filename)}:{code.co_name}) ran inside the window with the op "
            f"tracer on: dynamo compiles it otherwise with a torch function mode on, so its ops and numbers may "
            f"differ from the record's; compile the module (torch.compile(module)) or drill a run without compile"))

    @staticmethod
    def _caller(f):
        """The innermost user frame above the window's call (`f`: the drill's frame that runs it)."""
        f = f.f_back if f is not None else None
        while f is not None:
            code = f.f_code
            if (_kinds.get(code) or _kind(code)) == USER:
                return code.co_filename, f.f_lineno, code.co_name
            f = f.f_back
        return None
