"""Shared by the fingerprint kernel tests: one way to compare digests, with both shown in hex."""

import pytest


def hex_digest(d: tuple[int, int]) -> str:
    return f"(xor={d[0]:#018x}, pos={d[1]:#018x})"


@pytest.fixture
def same_digest():
    """`same_digest(got, want, what)`: assert equal digests; the message shows both in hex."""

    def check(got: tuple[int, int], want: tuple[int, int], what: str) -> None:
        assert tuple(got) == tuple(want), f"{what}: kernel {hex_digest(got)} != reference {hex_digest(want)}"

    return check
