"""collectors/patching.py: a wrapper installed while a recording runs is given back, and one that
other code wrapped again in the meantime passes calls straight through."""

from __future__ import annotations

from bitguard.collectors.patching import Patch


class _Owner:
    def greet(self, who):
        """Says hello."""
        return f"hello {who}"


def _shouting(seen):
    def make(original, patch):
        def greet(self, who):
            if not patch.active:
                return original(self, who)
            seen.append(who)
            return original(self, who).upper()
        return greet
    return make


def test_installed_then_given_back_with_the_original_name():
    original, seen = _Owner.greet, []
    patch = Patch(_Owner, "greet", _shouting(seen))
    assert _Owner().greet("a") == "HELLO A" and seen == ["a"]
    assert _Owner.greet.__name__ == "greet" and _Owner.greet.__doc__ == "Says hello."
    patch.remove()
    assert _Owner.greet is original and _Owner().greet("b") == "hello b"


def test_wrapped_again_by_others_it_stays_in_their_chain_and_passes_through():
    original, seen = _Owner.greet, []
    patch = Patch(_Owner, "greet", _shouting(seen))
    ours = _Owner.greet
    _Owner.greet = lambda self, who: "[" + ours(self, who) + "]"  # someone else's wrapper, installed after ours
    try:
        patch.remove()
        assert _Owner.greet is not original  # theirs is left in place
        assert _Owner().greet("c") == "[hello c]" and seen == []  # ours passes the call through
    finally:
        _Owner.greet = original
