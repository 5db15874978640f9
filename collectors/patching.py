"""One attribute of a class or module replaced by a wrapper while a recording runs, and given back
when it ends: `GradScaler.step` (scaler.py), `BaseProcess.start` (processes.py), `Module.compile`
and `torch.compile` (compiled.py). Knows nothing of what the wrappers do.
"""

from __future__ import annotations

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
