"""The record schema: every column of a rank file, defined once.

A run directory holds `manifest.json` and one DuckDB file per rank (`rank-N.duckdb`). The
collectors write rows shaped by the tables below; ingest, the API models, the Perfetto mapping
and docs/SCHEMA.md derive from them (a test checks the docs against this module). This module
knows nothing about torch or about how rows are produced.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 13  # bump on any change to a table below; readers refuse newer versions
# 2: tensors.unobserved (version 1 files have no such column: read as NULL, every tensor digested)
# 3: tensors.shard (older files have no such column: read as NULL, every digest covers its whole tensor)
#    and phase comm (kind collective); optimizer step events hold a `grad` row (the gradient step() used)
# 4: tables alerts and sensor_stats (online mode, collectors/online/; older files have neither: read as empty)
#    and tables api_events and violations (training invariants, collectors/api_events.py; older files have
#    neither: read as empty, and an invariant check says no API events were recorded)
# 5: sensor_stats.steps (an operator's row may sum several steps; older files have no such column: read as
#    NULL, every row one step)
# 6: events of kind `params` (a root module's parameters at its first call in each step, phase optimizer;
#    older files have none: a comparison with one leaves them out of both sides)
# 7: a Python int, float or bool that a module call returns is a row of its forward event (the 0-d int64 or
#    float64 tensor of its value, its path ending in NUMBER_MARK), and a root call's keyword arguments are rows
#    of its batch event (paths `['name']...`); older files have neither: a comparison with one leaves them out
#    of both sides
# 8: events of kind `saved` (phase optimizer: the tensors a torch.save or safetensors save call of the training
#    wrote, collectors/saved.py), and a `final` event of module type `optimizer` for the tensors an optimizer
#    stepped that no root module holds; older files have neither: a comparison with one leaves them out of both sides
# 9: a `saved` event holds every Python number of the saved object (but those under a key naming a time), not only
#    an optimizer's or an LR scheduler's; a long list of ints (an RNG state) is one 1-d tensor; older files hold
#    only the latter: a comparison with one leaves the number rows of `saved` events out of both sides
# 10: `saved` events of module type JSON_FILE: the numbers and strings of a JSON file the training wrote with open()
#    (collectors/beside.py), and `params` events of module type `optimizer` (the tensors an optimizer steps that no
#    root module holds, at each step's first root call); older files have neither: a comparison with one leaves
#    them out of both sides. A save's numbers under a key whose time word is not its last (`time_embedding_dim`)
#    are taken (bitguard/timed.py); a comparison with a version-9 run leaves those rows out of both sides
# 11: a save's strings (collectors/saved.py), as a JSON file's: rows whose path ends in STRING_PATH (the 0-d int64
#    tensor of a 64-bit hash; a long list of strings, one 1-d tensor); older files have none in other `saved`
#    events than JSON files': a comparison with one leaves them out of both sides
# 12: a save's enum members, dtypes, classes and functions are rows whose path ends in NAME_MARK (the hash of
#    their qualified name), a NumPy string is a string, and the keys of a dict (a save's or a JSON file's) that
#    holds string keys are a row whose path ends in KEYS_MARK (the hashes of its keys as strings are compared);
#    `dur` and `fps` name a time, and `taken` or `spent` after a time word (bitguard/timed.py); older files have none of
#    these: a comparison with one leaves out of both sides those rows, the string rows of saves other than
#    JSON files, and the rows under a key that names a duration
# 13: a Python int, float or bool given to a module call as an argument (positional or keyword, a root call's
#    too) is an input row of its event, as a returned one is an output row (a temperature or a timestep passed
#    as a number); older files have none: a comparison with one leaves the input number rows out of both sides
JSON_FILE = "json file"  # the module type of a JSON file's `saved` event (its boundary: the file's name)
# what a `params` event of the tensors only an optimizer holds, taken before their first step, adds to its
# boundary (the optimizer's name: collectors/weights.py, `_on_optimizer_pre`)
FIRST_STEP = " (before its first step)"
NUMBER_MARK = " (python {})"  # {}: int, float or bool
NUMBER_PATH = r"(^| )\(python (int|float|bool)\)$"  # a path NUMBER_MARK ends (a regular expression)
STRING_MARK = " (python str)"  # the end of a compared string's path (a save's or a JSON file's)
STRING_PATH = r"(^| )\(python str\)$"  # a path STRING_MARK ends (a regular expression)
NAME_MARK = " (python name)"  # the end of the path of a save's enum member, dtype, class or function (12)
KEYS_MARK = " (python keys)"  # the end of the path of a dict's string keys, in their sorted order (12)
NAMES_PATH = r"(^| )\(python (name|keys)\)$"  # a path NAME_MARK or KEYS_MARK ends (a regular expression)
DIGEST = "xor64+pos-fmix64"  # names the digest definition (docs/DIGESTS.md); runs compare only under the same one
# the host digest kernel's revision: 2 keeps the OpenMP team's chunk table alive while the team reads it
# (2abed93); a run recorded before it (no `digest_build`) with more than one torch thread may hold wrong
# host digests, so it is never certified identical (certification.run_reasons)
DIGEST_BUILD = 2
MANIFEST_NAME = "manifest.json"
RANK_FILE = "rank-{rank}.duckdb"

PHASES = ("forward", "backward", "optimizer", "data", "recompute", "comm")
# comm: a collective (all-reduce, reduce-scatter, all-gather, broadcast, a DDP bucket) on this rank (collectors/comm.py)
# recompute: a module forward run again during backward by activation checkpointing (collectors/recompute.py)
ROLES = ("input", "output", "grad_input", "grad_output", "grad", "param", "state", "rng")
# The `state` row that marks a compiled region's forward event (torch.compile): unobserved, it says
# that the module boundaries inside the region were not observed (collectors/compiled.py).
COMPILED_REGION_PATH = "<compiled region>"
# final: a root module's parameters and buffers at the end; params: its parameters as each step's first call meets
# them; saved: the tensors of an object the training saved (torch.save, safetensors), role state, as written
KINDS = ("module", "grad", "step", "batch", "final", "collective", "params", "saved")
# Columns that every row must hold (a NULL there is a damaged rank file, not a value).
REQUIRED = {"events": ("seq", "step", "phase", "kind", "boundary", "call", "depth", "t_start_ns", "t_end_ns"),
            "tensors": ("seq", "role", "idx", "shape", "dtype", "xor", "pos")}


@dataclass(frozen=True)
class Column:
    name: str  # column name in DuckDB and in every export
    sql: str  # DuckDB type
    doc: str  # one line for docs/SCHEMA.md


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    columns: tuple[Column, ...]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    def ddl(self) -> str:
        cols = ",\n  ".join(f"{c.name} {c.sql}" for c in self.columns)
        return f"CREATE TABLE IF NOT EXISTS {self.name} (\n  {cols}\n)"


EVENTS = Table(
    "events",
    "One row per observed boundary crossing, in completion order on its rank.",
    (
        Column("seq", "BIGINT", "per-rank sequence number in completion order, from 0"),
        Column("rank", "INTEGER", "rank of the process that recorded the event"),
        Column("world_size", "INTEGER", "world size of the job"),
        Column("step", "INTEGER", "training step: 0 until the first optimizer.step() ends; step() belongs to the step it ends"),
        Column("phase", "VARCHAR", "forward | backward | optimizer | data | recompute (a module's forward run "
               "again during backward by activation checkpointing: the module's own boundary name, call counting "
               "its recomputes in the step, depth that of its original forward) | comm (a "
               "collective this rank took part in: inputs before it, outputs after it completed)"),
        Column("boundary", "VARCHAR", "dotted module path from named_modules() (root: its class name; a module called outside "
               "any module call from a method of a module holding it, outside `__init__`, has that module as its root: "
               "`net.0` for a LightningModule's training_step calling `self.net`; a module no root registers: its caller's path and "
               "`.<Class>`, named by each call's caller), or a parameter's dotted name for gradient and optimizer events, "
               "or for a collective `comm.<function>#<group>` (`comm.ddp_bucket<i>#<group>` for DDP's bucket i; the "
               "group as its global ranks, `0-3` or `0,2`)"),
        Column("module_type", "VARCHAR", "class name of the module (owning module for a parameter; optimizer class for optimizer events; "
               "for a collective its operation: sum, avg, ..., gather, `src N` for a broadcast, a DDP hook's name)"),
        Column("kind", "VARCHAR", "module | grad | step | batch | final | collective | params: what the event observed (final: a "
               "root module's parameters and buffers when the recording ended; params: its parameters at its first call "
               "in a step, before it runs; both phase optimizer)"),
        Column("call", "INTEGER", "occurrence of this boundary, phase and kind within the step, from 0"),
        Column("depth", "INTEGER", "module nesting depth at the call (root modules are 0)"),
        Column("thread", "VARCHAR", "name of the Python thread the event completed on (`native-N`: a thread "
               "Python does not know, such as autograd's device threads, numbered in order of appearance)"),
        Column("device", "VARCHAR", "device of the event's first tensor (cpu, cuda:0, ...)"),
        Column("stream", "BIGINT", "CUDA stream handle the digests ran on, NULL on CPU"),
        Column("t_start_ns", "BIGINT", "wall-clock start, ns since the epoch"),
        Column("t_end_ns", "BIGINT", "wall-clock end, ns since the epoch"),
        Column("stack_id", "INTEGER", "user call stack, key into stacks"),
    ),
)

TENSORS = Table(
    "tensors",
    "One row per tensor an event observed, with its two 64-bit digests.",
    (
        Column("seq", "BIGINT", "event the tensor belongs to"),
        Column("role", "VARCHAR", "input | output | grad_input | grad_output | grad | param | state | rng (an RNG state: in data events, and as an input of a call that drew random numbers)"),
        Column("idx", "INTEGER", "position among the event's tensors of this role (pytree flatten order)"),
        Column("path", "VARCHAR", "pytree key path inside the argument or output, e.g. [0] or .logits or ['mask']; "
               "a collective's rows end in `@N`: its position in its group's order within the step, the same on every rank; "
               "a Python number a module was given or returned ends in ` (python int)`, ` (python float)` or ` (python bool)` "
               "(a 0-d int64 or float64 row of its value); a module's buffer (role state) is `.name`, and that of a part below it "
               "that the call ran without calling it (through its `.forward()`, as a memory bank) `.part.name`"),
        Column("shape", "BIGINT[]", "tensor shape (-1 for a dimension without one size: a nested tensor's ragged one)"),
        Column("dtype", "VARCHAR", "torch dtype without the torch. prefix"),
        Column("strides", "BIGINT[]", "strides in elements as recorded (the digest reads logical row-major order); "
               "empty for a sparse COO tensor, whose digest reads its coalesced indices (int64) then its values"),
        Column("nbytes", "BIGINT", "number of bytes digested (a DTensor: its local shard's)"),
        Column("xor", "UBIGINT", "XOR of the 64-bit little-endian words of the bytes (zero-padded tail)"),
        Column("pos", "UBIGINT", "order-sensitive digest: sum of fmix64(w_i)*(2i+1) mod 2^64 (see docs/DIGESTS.md)"),
        Column("tid", "BIGINT", "tensor identity within the rank: the same tensor object keeps its id, linking producer and consumer events"),
        Column("storage", "BIGINT", "address of the tensor's storage (0 when unknown): links views of one buffer"),
        Column("unobserved", "VARCHAR", "NULL when the tensor was digested; otherwise why it could not be observed "
               "(nested or compressed-sparse layout, a tensor subclass that does not hold its values, the meta device, "
               "a digest that failed, a container that could not be flattened): its xor/pos are 0 and mean nothing"),
        Column("shard", "VARCHAR", "NULL when the digest covers the whole tensor; otherwise which part of it this rank "
               "holds and the digest read (the shape stays the whole tensor's, nbytes is the part's): a DTensor's "
               "placements, mesh, coordinate, local shape and offset, or an FSDP1 FlatParameter's elements of an "
               "original parameter (collectors/sharded.py)"),
    ),
)

STACKS = Table(
    "stacks",
    "Deduplicated user call stacks.",
    (
        Column("stack_id", "INTEGER", "key used by events.stack_id"),
        Column("frames", "VARCHAR", "JSON list of 'file:line in function', outermost first"),
    ),
)

META = Table(
    "meta",
    "Facts about the rank's recording, as JSON values (schema_version, mode, determinism, status...).",
    (
        Column("key", "VARCHAR", "name of the fact"),
        Column("value", "VARCHAR", "JSON-encoded value"),
    ),
)

DUMPS = Table(
    "dumps",
    "Full tensor bytes, only when recorded with --dump (small models: tolerance studies, debugging).",
    (
        Column("seq", "BIGINT", "event the tensor belongs to"),
        Column("role", "VARCHAR", "tensor role, as in tensors"),
        Column("idx", "INTEGER", "tensor index, as in tensors"),
        Column("data", "BLOB", "the tensor's bytes in logical row-major order"),
    ),
)

ALERTS = Table(
    "alerts",
    "Online mode (`--mode online`): one row per state change of an alert a sensor raised; the latest row of an "
    "`alert_id` is its state. Empty in the other modes.",
    (
        Column("alert_id", "BIGINT", "per-rank alert number, from 0"),
        Column("step", "INTEGER", "training step it was raised in (counted as events' steps)"),
        Column("rank", "INTEGER", "rank that raised it"),
        Column("sensor", "VARCHAR", "sensor name: checksum, recompute, crossrank, guard"),
        Column("boundary", "VARCHAR", "module path, parameter name, collective, `loss` or `grad_norm`"),
        Column("op", "VARCHAR", "operator: linear, matmul, bmm, linear.dgrad, linear.wgrad, allreduce, ..."),
        Column("severity", "VARCHAR", "alert (goes to the verifier) | warning (a lead, never confirmed)"),
        Column("state", "VARCHAR", "pending | confirmed | transient | cleared (a false alarm) | warning"),
        Column("evidence", "VARCHAR", "JSON: what was seen (gap, sampled rows, digests per rank, values; on a "
               "verdict row what the verifier found)"),
        Column("threshold", "DOUBLE", "the threshold in force when it was raised (NULL: none)"),
        Column("t_ns", "BIGINT", "wall clock of this state change, ns since the epoch"),
        Column("latency_steps", "INTEGER", "on a verdict row: steps from raising to the verdict"),
        Column("verifier_s", "DOUBLE", "on a verdict row: seconds the verifier spent on it"),
    ),
)

SENSOR_STATS = Table(
    "sensor_stats",
    "Online mode: per sensor, one row of its totals (op NULL) per step, written at the step's end, and its "
    "operators' rows: the checksum sensor writes an operator's row, summing the steps since its previous one, on a "
    "step the operator was checked in, every 32 steps and at the end; the other sensors one per step.",
    (
        Column("step", "INTEGER", "training step"),
        Column("rank", "INTEGER", "rank"),
        Column("sensor", "VARCHAR", "sensor name"),
        Column("op", "VARCHAR", "operator key (`linear:blocks.0.mlp.fc`, ...); NULL: the sensor as a whole"),
        Column("calls", "INTEGER", "protected operator calls seen in the step (in the steps the row covers)"),
        Column("checked", "INTEGER", "calls checked"),
        Column("rate", "DOUBLE", "sampling rate in force (fraction of the operator's work checked)"),
        Column("seconds", "DOUBLE", "seconds the sensor spent on the training's critical path"),
        Column("flops_seen", "DOUBLE", "FLOPs of the calls seen"),
        Column("flops_checked", "DOUBLE", "FLOPs of the work checked (rows checked of the calls checked)"),
        Column("threshold", "DOUBLE", "threshold in force at the step's end (NULL: none)"),
        Column("queue", "INTEGER", "verifier queue length at the step's end"),
        Column("steps", "INTEGER", "steps the row covers, the last being `step` (NULL in files before schema version "
               "5: one)"),
    ),
)

API_EVENTS = Table(
    "api_events",
    "Training API calls (zero_grad, backward, clipping, optimizer and scheduler steps, the loss scale) and, once per "
    "step, the parameters' and modules' state, recorded in every mode by collectors/api_events.py: the facts that "
    "training invariants are inferred from and checked on (docs/INVARIANTS.md).",
    (
        Column("step", "INTEGER", "training step, counted as events' steps (a call after an optimizer.step() ended "
               "belongs to the next step)"),
        Column("rank", "INTEGER", "rank that recorded it"),
        Column("ord", "BIGINT", "per-rank order of API events, from 0"),
        Column("kind", "VARCHAR", "zero_grad | backward | clip_grad_norm | clip_grad_value | optimizer_step | "
               "scheduler_init | scheduler_step | loss_scale | params | modes | read (a value the training's code "
               "read out of a tensor: `item()`, `float()`, `int()`, an f-string, `tolist()`, `numpy()`, `np.asarray()`, "
               "`print()` or `str()`, a condition (`bool()`, `if t > best:`), an index (`range(t)`), `equal()` or "
               "`allclose()` (methods or torch's functions), a torchmetrics `compute()`; the first 1,024 "
               "a step; its reader's `file:line` in `at`, and `timed` where that line names what it reads a time: not compared) | optimizer_settings (when the recording ends, or "
               "when it is freed before: each optimizer's param groups' settings and one digest of its state, `state`, "
               "none for one freed with state on a device) | scheduler_settings (likewise each LR scheduler's `class` "
               "and `state`: its `state_dict()` as JSON)"),
        Column("target", "VARCHAR", "optimizer or scheduler `Class#i` (i: the order it was first seen in; an "
               "optimizer of tensors Pyro's param store names: `Class(pyro.param['name'], ...)`), a module "
               "name (Module.zero_grad, params, modes: a root module), `loss` (backward), `clip`, or the method a "
               "read went through (`item`, `float`, `int`, `format`, `tolist`, `numpy`, `array`, `repr`, `bool`, "
               "`index`, `equal`, `allclose`, `Class.compute`; `more`: reads beyond the step's first 1,024)"),
        Column("value", "VARCHAR", "JSON, per kind: what the call was given and returned (scalars read at the "
               "step's end; format in collectors/api_events.py)"),
        Column("t_ns", "BIGINT", "wall clock of the call, ns since the epoch"),
    ),
)

VIOLATIONS = Table(
    "violations",
    "Invariants violated while recording with `--check inv.json` (one row per violation, written at the end of "
    "the step it was seen in). Empty without --check.",
    (
        Column("step", "INTEGER", "training step it was seen in"),
        Column("rank", "INTEGER", "rank that saw it"),
        Column("invariant_id", "VARCHAR", "the invariant's id in the invariants file"),
        Column("template", "VARCHAR", "Consistent | EventContain | Sequence | Update | Bound | Mode"),
        Column("message", "VARCHAR", "what was violated, in words"),
        Column("evidence", "VARCHAR", "JSON: the observations that violate it"),
        Column("t_ns", "BIGINT", "wall clock when it was found, ns since the epoch"),
    ),
)

TABLES = (EVENTS, TENSORS, STACKS, META, DUMPS, ALERTS, SENSOR_STATS, API_EVENTS, VIOLATIONS)


def markdown() -> str:
    """docs/SCHEMA.md, derived from the tables above. Regenerate with
    `python -c "from bitguard.schema import markdown; print(markdown(), end='')" > docs/SCHEMA.md`."""
    out = ["# Run directory schema", "",
           f"Schema version {SCHEMA_VERSION}. A run directory holds `{MANIFEST_NAME}` and one DuckDB file per rank",
           f"(`{RANK_FILE.format(rank='N')}`) with the tables below. This file is generated from",
           "`bitguard/schema.py`; a test fails when the two disagree.", "",
           "While a rank records, and after a recording was killed, `rank-N.journal` beside its DuckDB",
           "file holds the batches not yet folded into it (Arrow IPC, one group per batch, each with a CRC-32",
           "of its header and of its payload and the steps it holds; format in `collectors/journal.py`). The",
           "`bitguard record` launcher folds it when its child ends; readers never write: they read what the",
           "journal still holds in memory. The rank's `meta` table keeps the last group folded",
           "(`journal_folded`), so no row is ever taken twice; a group that fails its checksum is reported",
           "in `journal_damage` (from which step the rank is not whole) and the journal is kept as",
           "`rank-N.journal.damaged`: nothing recorded is deleted.", "",
           f"Phases: {', '.join(PHASES)}. Kinds: {', '.join(KINDS)}. Tensor roles: {', '.join(ROLES)}.",
           "Columns that must never be NULL: " + "; ".join(f"{t}: {', '.join(c)}" for t, c in REQUIRED.items()) + ".",
           ""]
    for table in TABLES:
        out += [f"## `{table.name}`", "", table.doc, "", "| column | type | meaning |", "| --- | --- | --- |"]
        out += [f"| `{c.name}` | {c.sql} | {c.doc.replace('|', chr(92) + '|')} |" for c in table.columns]
        out.append("")
    return "\n".join(out)
