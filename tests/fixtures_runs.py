"""Synthetic run directories written straight from `bitguard.schema`, for the explorer's tests.

A run is a toy network of `layers` Linear blocks plus a side-branch `model.probe` whose output
nobody consumes, trained for `steps` steps on `world_size` ranks. Each step records, in
completion order: the forward of every block (the probe right after block 0), the root module,
one gradient event per block weight in reverse order, and one optimizer step. Tensor ids chain
block i's output into block i+1's input, so a digest change propagates the way it would in a
real run.

`write_run(dir, taint=...)` makes the suspect side of a pair: a `Taint` changes the output
digest of one boundary at one step, and everything that consumes it (the later blocks of that
step, the backward, the optimizer and every later step) changes with it, except the probe,
whose output goes nowhere. `drop` removes events (gaps). The builder knows nothing about how
bitguard compares runs; tests assert on what the engine makes of these pairs.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field

import duckdb
import pyarrow as pa

from bitguard.collectors.store import arrow_schema
from bitguard.schema import (DIGEST_BUILD, EVENTS, MANIFEST_NAME, META, RANK_FILE, SCHEMA_VERSION, STACKS, TABLES,
                             TENSORS)

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Taint:
    step: int  # training step whose forward first differs
    boundary: str  # e.g. "model.layers.2" or "model.probe"
    rank: int | None = None  # None: every rank


@dataclass
class RunSpec:
    layers: int = 4  # Linear blocks in the toy network
    steps: int = 3  # training steps recorded
    world_size: int = 1  # one rank file per rank
    taints: tuple[Taint, ...] = ()  # digest changes of the suspect side
    drop: frozenset = frozenset()  # (step, boundary, phase) events left out (gaps)
    jitter_ns: int = 0  # shift of every timestamp, so that two sides differ in time
    extra_manifest: dict = field(default_factory=dict)  # merged into manifest.json
    scalar_loss: bool = False  # the root's output is a 0-d float32 loss (its xor digest is its bits), drifting
    # away from the reference's by 1e-6 x 8^k, k steps after the suspect's first tainted step
    nested: bool = False  # the root's forward call encloses its blocks' in time, as a recorded one does: nesting edges


def _digest(*key) -> int:
    h = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & _MASK


def _step_plan(layers: int) -> list[tuple]:
    """(phase, boundary, module_type, kind, depth, layer) for one step, in completion order."""
    plan = [("forward", "model.layers.0", "Linear", "module", 1, 0)]
    plan.append(("forward", "model.probe", "Probe", "module", 1, -1))
    plan += [("forward", f"model.layers.{i}", "Linear", "module", 1, i) for i in range(1, layers)]
    plan.append(("forward", "Net", "Net", "module", 0, layers))
    plan += [("backward", f"model.layers.{i}.weight", "Linear", "grad", 1, i) for i in reversed(range(layers))]
    plan.append(("optimizer", "SGD", "SGD", "step", 0, layers + 1))
    return plan


def _loss_bits(value: float) -> int:
    """The xor digest of a 0-d float32 tensor holding `value`: its 4 bytes, zero-padded to one word."""
    return int.from_bytes(struct.pack("<f", value) + bytes(4), "little")


def _table(table, rows: list[tuple]) -> pa.Table:
    schema = arrow_schema(table)
    columns = list(zip(*rows)) if rows else [() for _ in table.columns]
    return pa.Table.from_arrays([pa.array(list(c), type=t) for c, t in zip(columns, schema.types)], schema=schema)


def _rank_chunks(spec: RunSpec, rank: int, chunk_steps: int = 2000):
    """Yield {table: arrow rows} for `chunk_steps` steps at a time (a 1M-event run fits in memory)."""
    events: list[tuple] = []
    tensors: list[tuple] = []
    plan = _step_plan(spec.layers)
    # a taint at (step, layer) changes that layer's output and all that follows in the step
    taints = [t for t in spec.taints if t.rank in (None, rank)]
    t0 = 1_700_000_000_000_000_000 + spec.jitter_ns
    seq = 0
    tid_base = 0
    for step in range(spec.steps):
        if step and step % chunk_steps == 0:
            yield {EVENTS.name: _table(EVENTS, events), TENSORS.name: _table(TENSORS, tensors)}
            events, tensors = [], []
        tainted_from = None  # layer index from which this step's block outputs differ
        probe_tainted = False
        step_tainted = any(t.step < step and t.boundary != "model.probe" for t in taints)
        for t in taints:
            if t.step == step:
                if t.boundary == "model.probe":
                    probe_tainted = True
                else:
                    layer = int(t.boundary.rsplit(".", 1)[1])
                    tainted_from = layer if tainted_from is None else min(tainted_from, layer)
        step_start = t0 + seq * 10_000
        for phase, boundary, module_type, kind, depth, layer in plan:
            if (step, boundary, phase) in spec.drop:
                continue
            t_start = t0 + seq * 10_000
            t_end = t_start + 8_000
            if spec.nested and phase == "forward" and layer == spec.layers:
                t_start = step_start - 1_000  # the root began before its blocks and ends after them
            events.append((seq, rank, spec.world_size, step, phase, boundary, module_type, kind, 0, depth,
                           "MainThread", "cpu", None, t_start, t_end, 1 + (layer % 3 if layer >= 0 else 3)))
            if phase == "forward" and spec.scalar_loss and layer == spec.layers:
                first_bad = min((t.step for t in taints if t.boundary != "model.probe"), default=None)
                bad = first_bad is not None and step >= first_bad
                x = _loss_bits(0.1 + 2.5 * 0.8 ** step + (1e-6 * 8 ** (step - first_bad) if bad else 0.0))
                tensors.append((seq, "output", 0, "", [], "float32", [], 4, x, _digest("pos", x),
                                tid_base + 1500, 0, None, None))
            elif phase == "forward":
                if layer == -1:  # the probe reads block 0's output and writes a tensor nobody reads
                    in_tid, out_tid = tid_base + 1, tid_base + 1000
                    in_bad = step_tainted or tainted_from == 0
                    out_bad = in_bad or probe_tainted
                else:
                    in_tid, out_tid = tid_base + layer, tid_base + layer + 1
                    in_bad = step_tainted or (tainted_from is not None and layer > tainted_from)
                    out_bad = step_tainted or (tainted_from is not None and layer >= tainted_from)
                for role, tid, bad in (("input", in_tid, in_bad), ("output", out_tid, out_bad)):
                    x = _digest(rank, step, boundary, role, bad)
                    tensors.append((seq, role, 0, "[0]", [8, 16], "float32", [16, 1], 512,
                                    x, _digest("pos", x), tid, 0, None, None))
            else:
                bad = step_tainted or tainted_from is not None
                role = "grad" if phase == "backward" else "state"
                x = _digest(rank, step, boundary, role, bad)
                tensors.append((seq, role, 0, "", [16, 16], "float32", [16, 1], 1024,
                                x, _digest("pos", x), tid_base + 500 + max(layer, 0), 0, None, None))
            seq += 1
        tid_base += 2000
    stacks = [(i, json.dumps([f"train.py:{40 + i} in main", f"model.py:{10 + i} in forward"])) for i in range(1, 5)]
    meta = [("schema_version", json.dumps(SCHEMA_VERSION)), ("status", json.dumps("complete")),
            ("mode", json.dumps("full")), ("rank", json.dumps(rank))]
    yield {EVENTS.name: _table(EVENTS, events), TENSORS.name: _table(TENSORS, tensors),
           STACKS.name: _table(STACKS, stacks), META.name: _table(META, meta)}


def write_rank_file(path: str, chunks) -> None:
    con = duckdb.connect(path)
    try:
        for table in TABLES:
            con.execute(table.ddl())
        for tables in chunks:
            for name, data in tables.items():
                con.register("_rows", data)
                con.execute(f"INSERT INTO {name} SELECT * FROM _rows")
                con.unregister("_rows")
        con.execute("CHECKPOINT")
    finally:
        con.close()


def write_manifest(run_dir: str, world_size: int, **extra) -> None:
    manifest = {"tool": "bitguard", "schema_version": SCHEMA_VERSION, "digest_build": DIGEST_BUILD, "world_size": world_size,
                "status": "complete", "complete": True, "exit_status": 0, "command": ["python", "train.py"],
                "mode": "full", "steps": None, "start_time": "2026-11-29T10:00:00+0000", **extra}
    with open(os.path.join(run_dir, MANIFEST_NAME), "w") as f:
        json.dump(manifest, f, indent=2)


def write_run(run_dir: str, spec: RunSpec | None = None, **kw) -> str:
    """Write a complete run directory and return its path."""
    spec = spec or RunSpec(**kw)
    os.makedirs(run_dir, exist_ok=True)
    write_manifest(run_dir, spec.world_size, **spec.extra_manifest)
    for rank in range(spec.world_size):
        write_rank_file(os.path.join(run_dir, RANK_FILE.format(rank=rank)), _rank_chunks(spec, rank))
    return run_dir


def write_pair(root: str, name: str, suspect: RunSpec, reference: RunSpec | None = None) -> tuple[str, str]:
    """`root/name/reference` and `root/name/suspect`, the two sides of a scenario."""
    reference = reference or RunSpec(layers=suspect.layers, steps=suspect.steps, world_size=suspect.world_size,
                                     scalar_loss=suspect.scalar_loss, nested=suspect.nested)
    a = write_run(os.path.join(root, name, "reference"), reference)
    b = write_run(os.path.join(root, name, "suspect"), suspect)
    return a, b


# -- the scenarios the explorer's tests use, named by what they show -----------------------------

def benign_probe_then_real(root: str) -> tuple[str, str]:
    """Step 0: only the unconsumed probe differs (benign); step 1: block 2 really diverges."""
    return write_pair(root, "benign_probe_then_real", RunSpec(
        layers=5, steps=3, taints=(Taint(0, "model.probe"), Taint(1, "model.layers.2")), jitter_ns=3_000))


def identical(root: str) -> tuple[str, str]:
    """Two runs that compute the same thing."""
    return write_pair(root, "identical", RunSpec(layers=3, steps=2))


def gap_then_divergence(root: str) -> tuple[str, str]:
    """The suspect skips the probe at step 0, then block 1 diverges at step 1, on two ranks."""
    return write_pair(root, "gap_then_divergence", RunSpec(
        layers=4, steps=3, world_size=2, taints=(Taint(1, "model.layers.1", rank=1),),
        drop=frozenset({(0, "model.probe", "forward")})), RunSpec(layers=4, steps=3, world_size=2))


def nested_propagation(root: str) -> tuple[str, str]:
    """Block 2 diverges at step 1 inside a root call that encloses its blocks: the propagation has
    dataflow edges (block to block, the last block into the root) and nesting edges (each block into the root)."""
    return write_pair(root, "nested_propagation", RunSpec(layers=5, steps=3, nested=True,
                                                          taints=(Taint(1, "model.layers.2"),)))
