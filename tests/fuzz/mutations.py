"""What the fuzz tier feeds bitguard: byte mutations of files, hostile manifests, hostile folder names.

Every generator is a pure function of its arguments (a `random.Random` seeded by the caller), so a
case is reproduced from the seed and its id alone. Nothing here runs bitguard or judges an outcome.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable

OPS = ("truncate", "bitflip", "insert", "zero")


@dataclass(frozen=True)
class Mutation:
    op: str
    offset: int
    size: int  # bytes cut off, bits flipped, bytes inserted or bytes zeroed
    payload: bytes = b""  # the inserted bytes, or the flipped bit positions (little endian u32 each)

    def describe(self) -> str:
        return f"{self.op} size={self.size} at byte {self.offset}"


def plan(op: str, length: int, rng: random.Random) -> Mutation:
    """A mutation of a file of `length` bytes: half of the offsets fall in the first 4 KiB (headers)."""
    span = length if rng.random() < 0.5 else min(length, 4096)
    offset = rng.randrange(max(span, 1))
    if op == "truncate":
        return Mutation(op, offset, length - offset)
    if op == "bitflip":
        bits = [rng.randrange(max(length, 1) * 8) if rng.random() < 0.5 else offset * 8 + rng.randrange(64)
                for _ in range(rng.choice((1, 1, 2, 8)))]
        bits = [b for b in bits if b < length * 8] or [offset * 8]
        return Mutation(op, offset, len(bits), b"".join(b.to_bytes(4, "little") for b in bits))
    if op == "insert":
        n = rng.choice((1, 4, 64))
        return Mutation(op, offset, n, bytes(rng.randrange(256) for _ in range(n)))
    if op == "zero":
        return Mutation(op, offset, min(rng.choice((1, 8, 512, 4096)), length - offset))
    raise ValueError(f"unknown mutation {op!r}; use one of {OPS}")


def apply(data: bytes, m: Mutation) -> bytes:
    if m.op == "truncate":
        return data[:m.offset]
    if m.op == "bitflip":
        out = bytearray(data)
        for i in range(0, len(m.payload), 4):
            bit = int.from_bytes(m.payload[i:i + 4], "little")
            out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)
    if m.op == "insert":
        return data[:m.offset] + m.payload + data[m.offset:]
    if m.op == "zero":
        return data[:m.offset] + bytes(m.size) + data[m.offset + m.size:]
    raise ValueError(f"unknown mutation {m.op!r}")


# -- hostile manifests ------------------------------------------------------------------------
# (id, what it does to the manifest, what the input calls for):
#   "false"   the edit says the run is not (known to be) whole: not complete, other status, ranks
#             missing, not a bitguard run. "identical" for it is a false verdict.
#   "refuse"  a value of the wrong type or one that cannot be parsed: only a clean error (exit 2)
#             is right; any verdict means an invalid manifest was accepted (a wrong answer).
#   "any"     a field the verdict does not rest on: any verdict but "diverged", or a clean error.

def _set(key, value) -> Callable[[dict], bytes]:
    return lambda m: json.dumps({**m, key: value}).encode()


def _drop(key) -> Callable[[dict], bytes]:
    return lambda m: json.dumps({k: v for k, v in m.items() if k != key}).encode()


def _deep(depth: int, key: str = "x") -> Callable[[dict], bytes]:
    return lambda m: json.dumps(m)[:-1].encode() + f', "{key}": '.encode() + b"[" * depth + b"]" * depth + b"}"


def _literal(key, text: str) -> Callable[[dict], bytes]:
    """`key` set to raw JSON text (a number Python would refuse to print, NaN...)."""
    return lambda m: json.dumps({**m, key: "\0"}).replace('"\\u0000"', text).encode()


def _raw(text: bytes) -> Callable[[dict], bytes]:
    return lambda m: text


def _padded(n: int) -> Callable[[dict], bytes]:
    return lambda m: json.dumps({**m, "padding": "x" * n}).encode()


def _non_utf8(m: dict) -> bytes:
    return json.dumps(m).encode().replace(b'"bitguard"', b'"bitguard\xff\xfe"', 1)


def _latin1_value(m: dict) -> bytes:
    return json.dumps({**m, "command": ["python", "train.py"]}).encode().replace(b"train.py", b"tr\xe4in.py")


HOSTILE_MANIFESTS: list[tuple[str, Callable[[dict], bytes], str]] = [
    ("world_size-abc", _set("world_size", "abc"), "refuse"),
    ("world_size-list", _set("world_size", [1]), "refuse"),
    ("world_size-5000-digits", _set("world_size", "9" * 5000), "refuse"),
    ("world_size-5000-digit-int", _literal("world_size", "9" * 5000), "refuse"),
    ("world_size-negative", _set("world_size", -1), "refuse"),
    ("world_size-zero", _set("world_size", 0), "refuse"),
    ("world_size-bool", _set("world_size", True), "refuse"),
    ("world_size-float", _set("world_size", 1.5), "refuse"),
    ("world_size-2-one-rank", _set("world_size", 2), "false"),
    ("world_size-huge", _set("world_size", 10 ** 18), "false"),
    ("world_size-null", _set("world_size", None), "refuse"),
    ("determinism-string", _set("determinism", "on"), "refuse"),
    ("determinism-list", _set("determinism", [1, 2]), "refuse"),
    ("determinism-deep", lambda m: json.dumps({**m, "determinism": {"torch_threads": {"a": [[[]]]}}}).encode(), "any"),
    ("versions-string", _set("versions", "torch 2"), "refuse"),
    ("versions-list", _set("versions", ["torch"]), "refuse"),
    ("status-object", _set("status", {}), "false"),
    ("status-list", _set("status", ["complete"]), "false"),
    ("status-number", _set("status", 5), "false"),
    ("status-unknown-word", _set("status", "done-ish"), "false"),
    ("status-null", _set("status", None), "false"),
    ("complete-false", _set("complete", False), "false"),
    ("schema_version-string", _set("schema_version", "1"), "refuse"),
    ("schema_version-float", _set("schema_version", 1.0), "any"),
    ("schema_version-bool", _set("schema_version", True), "refuse"),
    ("schema_version-huge", _set("schema_version", 10 ** 30), "refuse"),
    ("schema_version-zero", _set("schema_version", 0), "refuse"),
    ("tool-other", _set("tool", "notbitguard"), "false"),
    ("exit_status-string", _set("exit_status", "zero"), "any"),
    ("signal-object", _set("signal", {"x": 1}), "any"),
    ("command-object", _set("command", {"argv": 1}), "any"),
    ("collector_errors-string", _set("collector_errors", "boom"), "refuse"),
    ("collector_errors-objects", _set("collector_errors", [{"x": 1}, None, 5]), "refuse"),
    ("deep-nesting-1e5", _deep(100_000), "refuse"),
    ("deep-nesting-1e3", _deep(1_000), "any"),
    ("huge-string-8MiB", _padded(8 << 20), "any"),
    ("non-utf8-bytes", _non_utf8, "refuse"),
    ("latin1-in-a-value", _latin1_value, "any"),
    ("utf8-bom", lambda m: b"\xef\xbb\xbf" + json.dumps(m).encode(), "any"),
    ("nan-world_size", lambda m: json.dumps({**m, "world_size": float("nan")}).encode(), "refuse"),
    ("infinity-schema_version", lambda m: json.dumps({**m, "schema_version": float("inf")}).encode(), "refuse"),
    ("duplicate-keys", lambda m: json.dumps(m)[:-1].encode() + b', "world_size": "two"}', "refuse"),
    ("top-level-list", lambda m: json.dumps([m]).encode(), "refuse"),
    ("top-level-string", _raw(b'"bitguard"'), "refuse"),
    ("top-level-null", _raw(b"null"), "refuse"),
    ("empty-file", _raw(b""), "refuse"),
    ("truncated-json", lambda m: json.dumps(m).encode()[:-7], "refuse"),
    *[(f"missing-{k}", _drop(k), {"tool": "refuse", "schema_version": "refuse", "world_size": "refuse",
                                  "status": "false"}.get(k, "any"))
      for k in ("tool", "schema_version", "world_size", "status", "digest", "determinism", "versions", "command",
                "devices", "mode")],
]


# -- hostile folder names -----------------------------------------------------------------------
INJECTION = "x' AS z; COPY (SELECT 1) TO 'pwned.csv'; --"
HOSTILE_NAMES: list[tuple[str, str]] = [
    ("single-quote", "q'dir"),
    ("double-quote", 'q"dir'),
    ("sql-injection", INJECTION),
    ("sql-injection-double-quoted", 'x" AS z; COPY (SELECT 1) TO "pwned.csv"; --'),
    ("semicolons", "a;b;c"),
    ("spaces", "run with  spaces "),
    ("unicode", "прогон-ü-—-🙂"),
    ("newline", "run\nname"),
    ("tab-cr", "run\t\rname"),
    ("leading-dash", "-run"),
    ("double-dash", "--json"),
    ("backslash", "a\\b"),
    ("percent-dollar", "%s$HOME${x}"),
    ("glob-chars", "*?[]{}"),
    ("long-255-bytes", "L" * 255),
    ("long-utf8-name", "é" * 127),
    ("dots", "..."),
    ("html", "<img src=x onerror=alert(1)>"),
]
