"""One attribute of a class or module replaced by a wrapper while a recording runs, and given back
when it ends: `GradScaler.step` (scaler.py), `BaseProcess.start` (processes.py), `Module.compile`
and `torch.compile` (compiled.py), the savers (saved.py, with the names other modules bound them to:
`bound_elsewhere`). Knows nothing of what the wrappers do.
"""

from __future__ import annotations

import sys
from functools import wraps


class Patch:
    """`owner.name` replaced by `make(original, patch)` (wrapped to carry the original's name and
    docstring) until `remove()`. Removed, the original is put back only if `owner.name` is still
    this wrapper: code that wrapped it again since keeps our wrapper in its chain, so a wrapper
    must pass calls straight to the original once `patch.active` is False."""

    def __init__(self, owner, name: str, make):
        self.owner, self.name = owner, name
        self.original = getattr(owner, name)
        self.active = True
        self.wrapper = wraps(self.original)(make(self.original, self))
        setattr(owner, name, self.wrapper)

    def remove(self) -> None:
        if self.active and self.owner.__dict__.get(self.name) is self.wrapper:
            setattr(self.owner, self.name, self.original)
        self.active = False


def bound_elsewhere(originals, skip: tuple[str, ...] = ()) -> list[tuple[object, str, object]]:
    """(module, name, original) for every module-level name that holds one of `originals` in a module
    loaded now, but those whose name starts with one of `skip`: where `from safetensors.torch import
    save_file as safe_save_file` bound a function before a recording began (accelerate does at its
    import), patching the function's own module does not reach the call. Reads each module's
    namespace as it is (a lazy module's attributes are not loaded)."""
    wanted = {id(f): f for f in originals if callable(f)}
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.startswith(skip):
            continue
        try:  # (a copy: another thread may bind a name meanwhile)
            namespace = vars(module).copy()
        except (TypeError, AttributeError):  # (an object standing in for a module, without a namespace)
            continue
        if wanted.keys().isdisjoint(map(id, namespace.values())):  # (in C: most modules hold none)
            continue
        for name, value in namespace.items():
            if wanted.get(id(value)) is value is not None:
                found.append((module, name, value))
    return found
