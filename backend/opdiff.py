"""The first operation that differs between two op traces of one module call.

An op trace (`ops-rank-R.json`, schema `bitguard.ops/1`, written by collectors/drill.py in a
replay) lists every torch operation inside a drill's window: its name, the user frame that called
it, the module calls open around it, and the digests of its tensor inputs and outputs. `load()`
reads one without trusting it; `first_difference()` aligns two traces with the boundary events'
alignment (backend/alignment.py, on a key of the op's name, module chain and input shapes, and
a backward op's autograd node) and walks them in run A's order: the first op present on one side only (cause
`structure`), or the first paired op whose outputs differ (cause `digest`: with its inputs and
non-tensor arguments said equal or not), is the op-level pivot.

This module knows op traces; not how they were recorded, nor numeric differences (signature.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bitguard import runfiles
from bitguard.backend.alignment import align
from bitguard.errors import CorruptRun

OPS_SCHEMA = "bitguard.ops/1"
MAX_TRACE_BYTES = 1 << 30


def trace_path(replay_dir: Path, rank: int) -> Path:
    return replay_dir / f"ops-rank-{rank}.json"


def load(replay_dir: Path, rank: int) -> dict | None:
    """The op trace of `rank` in a replay directory; None when the replay wrote none."""
    path = trace_path(replay_dir, rank)
    data = runfiles.read(replay_dir, path, MAX_TRACE_BYTES, what="op trace")
    if data is None:
        return None
    try:
        trace = runfiles.loads(data)
    except runfiles.JSONRefused as exc:
        raise CorruptRun(f"{path} is not valid JSON ({exc}); drill again") from None
    if not isinstance(trace, dict) or trace.get("schema") != OPS_SCHEMA or not isinstance(trace.get("ops"), list):
        raise CorruptRun(f"{path} is not a {OPS_SCHEMA} op trace; drill again with this bitguard")
    return trace


def _key(op: dict) -> int:
    shapes = tuple(tuple(t.get("shape") or ()) for t in op.get("inputs") or ())
    # not the calling function: the same op called from refactored or monkeypatched code (a forward
    # replaced by another function) must pair, its digests say whether it computes the same; a
    # backward op: its autograd node too
    node = (op["node"],) if op.get("node") else ()
    text = repr((op.get("op"), tuple(op.get("modules") or ()), shapes) + node)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _same(x: dict | None, y: dict | None) -> bool:
    if x is None or y is None:
        return x is y
    return all(x.get(k) == y.get(k) for k in ("xor", "pos", "dtype", "shape"))


def _pairs(xs: list, ys: list) -> list[dict]:
    n = max(len(xs), len(ys))
    out = []
    for i in range(n):
        x = xs[i] if i < len(xs) else None
        y = ys[i] if i < len(ys) else None
        out.append({"index": i, "a": x, "b": y, "differs": not _same(x, y)})
    return out


@dataclass
class OpDifference:
    cause: str  # "digest" | "structure"
    side_only: str | None  # structure: "a" | "b"; digest: None
    index_a: int | None
    index_b: int | None
    op_a: dict | None
    op_b: dict | None
    inputs: list[dict]
    outputs: list[dict]
    inputs_differ: bool
    args_differ: bool
    other_side: list[dict]  # structure: the other run's unpaired ops at that place
    paired_before: int  # ops paired and equal before it
    moved: dict | None = None  # structure: the same op where the other run calls it, in another order

    @property
    def op(self) -> dict:
        return self.op_a if self.op_a is not None else self.op_b

    @property
    def first_output(self) -> int | None:
        """Index of the first differing output (digest cause)."""
        return next((p["index"] for p in self.outputs if p["differs"]), None)


def _place(op: dict) -> tuple:
    """Which op, called from which line."""
    return op.get("op"), op.get("file"), op.get("line")


def _brief(op: dict) -> dict:
    return {k: op.get(k) for k in ("i", "op", "file", "line", "function")}


def differences(ops_a: list[dict], ops_b: list[dict]):
    """Every op that differs, in A's order: ops one side alone runs (a B-only op before A's next
    paired op comes first) and paired ops whose outputs differ."""
    keys_a = np.array([_key(o) for o in ops_a], dtype=np.uint64)
    keys_b = np.array([_key(o) for o in ops_b], dtype=np.uint64)
    al = align(keys_a, keys_b)
    # a pair the alignment's reorder pass made whose outputs differ is two ops, each run alone at its place:
    # the order differs, and what the moved op computed (helper 71: B's norm_first layer norm, run before the
    # attention A runs first, paired with A's later one, left the attention's inputs differing unexplained)
    kept = np.array([not (moved and any(p["differs"] for p in _pairs(ops_a[i].get("outputs") or [],
                                                                      ops_b[j].get("outputs") or [])))
                     for i, j, moved in zip(al.a_idx, al.b_idx, al.reordered)], dtype=bool)
    match_a = np.full(len(ops_a), -1, dtype=np.int64)
    match_a[al.a_idx[kept]] = al.b_idx[kept]
    paired_b = np.zeros(len(ops_b), dtype=bool)
    paired_b[al.b_idx[kept]] = True
    moved_a = dict(zip(al.a_idx[~kept].tolist(), al.b_idx[~kept].tolist()))
    moved_b = {j: i for i, j in moved_a.items()}
    i = j = equal = 0
    while i < len(ops_a) or j < len(ops_b):
        if j < len(ops_b) and not paired_b[j] and (i >= len(ops_a) or match_a[i] > j):
            yield _structure("b", None, j, None, ops_b[j], [], equal, _moved(ops_a, moved_b.get(j)))  # before A's next
            j += 1
            continue
        if i >= len(ops_a):
            break
        if match_a[i] < 0:
            run_b = []
            for k in range(j, len(ops_b)):
                if paired_b[k] or len(run_b) == 8:
                    break
                run_b.append(_brief(ops_b[k]))
            # B runs the same op at the same line a little later, after ops of its own: those come first (an
            # extra `ei[:, :-1]` in B made B's next op read other shapes, and A's op was said to be run A's alone)
            later = next((k for k in range(1, len(run_b)) if _place(run_b[k]) == _place(ops_a[i])), None)
            if later is not None and _place(run_b[0]) != _place(ops_a[i]):
                yield _structure("b", None, j, None, ops_b[j], [], equal)
                j += 1
                continue
            yield _structure("a", i, None, ops_a[i], None, run_b, equal, _moved(ops_b, moved_a.get(i)))
            i += 1
            continue
        a, b = ops_a[i], ops_b[match_a[i]]
        outputs = _pairs(a.get("outputs") or [], b.get("outputs") or [])
        if any(p["differs"] for p in outputs):
            inputs = _pairs(a.get("inputs") or [], b.get("inputs") or [])
            yield OpDifference("digest", None, i, int(match_a[i]), a, b, inputs, outputs,
                               any(p["differs"] for p in inputs), a.get("args") != b.get("args"), [], equal)
        else:
            equal += 1
        j = max(j, int(match_a[i]) + 1)
        i += 1


def first_difference(ops_a: list[dict], ops_b: list[dict]) -> OpDifference | None:
    """The first op that differs, in A's order (None: the traces are the same op for op)."""
    return next(differences(ops_a, ops_b), None)


def first_value_difference(ops_a: list[dict], ops_b: list[dict]) -> OpDifference | None:
    """The first paired op whose outputs differ (after a structural difference: where the two
    streams join again and what the other code computed differently)."""
    return next((d for d in differences(ops_a, ops_b) if d.cause == "digest"), None)


def _moved(ops: list[dict], index: int | None) -> dict | None:
    return None if index is None else {"index": index, **_brief(ops[index])}


def _structure(side, index_a, index_b, op_a, op_b, other, equal, moved=None) -> OpDifference:
    op = op_a if op_a is not None else op_b
    def one_side(tensors: list, differs: bool | None) -> list[dict]:
        return [{"index": k, "a": t if side == "a" else None, "b": t if side == "b" else None, "differs": differs}
                for k, t in enumerate(tensors or [])]

    return OpDifference("structure", side, index_a, index_b, op_a, op_b, one_side(op.get("inputs"), None),
                        one_side(op.get("outputs"), True), False, False, other, equal, moved)
