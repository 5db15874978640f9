"""The rank journal's format: batches of rows as checksummed groups, and what a damaged journal lost.

`rank-N.journal` is a sequence of groups, one per batch the writer journaled (store.py). A group
(format BGJ2) is:

    header   "BGJ2", group number (u64), part count (u32), payload length (u64),
             first and last step of its events (i64, -1 when it has none), flags (u8: 1 = the
             batch ends a training step), CRC-32 of the header's bytes before it (u32)
    payload  per non-empty table: table index (u8), length (u64), the table as an Arrow IPC stream
    end      "BGJE", group number (u64), CRC-32 of the payload (u32)

A group is taken only when its header, payload and end all check. A bad group (a flipped bit,
a zeroed or inserted range, a cut) is reported with the steps its header names when the header
checks, and decoding resumes at the next header that checks, so the groups after it are kept.
Journals from before checksums (BGJ1: the same without step range, flags and CRCs) are still
read, up to their first undecodable group.

`Journal.damage(folded, ...)` says what the journal cannot account for: the group numbers above
the rank file's last folded group (`journal_folded`) that are neither whole here nor in the rank
file, and from which step the rank's events can no longer be trusted complete. Group numbers
start at 1 and rise by one per batch, so a gap is a lost batch.

This module knows the tables a batch carries and nothing about DuckDB, torch or runs.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from bitguard.schema import ALERTS, API_EVENTS, DUMPS, EVENTS, SENSOR_STATS, STACKS, TENSORS, VIOLATIONS

ARROW_TYPES = {
    "BIGINT": pa.int64(),
    "INTEGER": pa.int32(),
    "VARCHAR": pa.string(),
    "UBIGINT": pa.uint64(),
    "BIGINT[]": pa.list_(pa.int64()),
    "BLOB": pa.binary(),
    "DOUBLE": pa.float64(),
}


def arrow_schema(table) -> pa.Schema:
    return pa.schema([(c.name, ARROW_TYPES[c.sql]) for c in table.columns])


# the tables a batch carries, in journal order (new ones go at the end: a part names its table by index)
ROW_TABLES = (EVENTS, TENSORS, STACKS, DUMPS, ALERTS, SENSOR_STATS, API_EVENTS, VIOLATIONS)
SCHEMAS = {t.name: arrow_schema(t) for t in ROW_TABLES}
# Columns a table gained after schema 1: a journal written before them lacks them (read as NULL).
LATER_COLUMNS = {TENSORS.name: {"unobserved", "shard"}, SENSOR_STATS.name: {"steps"}}

MAGIC, END_MAGIC, MAGIC_V1 = b"BGJ2", b"BGJE", b"BGJ1"
_HEAD = struct.Struct("<4sQIQqqBI")  # magic, number, parts, payload length, first step, last step, flags, CRC
_END = struct.Struct("<4sQI")  # end magic, number, payload CRC
_PART = struct.Struct("<BQ")  # table index in ROW_TABLES, length of its Arrow IPC stream
_HEAD_V1 = struct.Struct("<4sQI")  # magic, group number, number of tables
_END_V1 = struct.Struct("<4sQ")  # end magic, group number
ENDS_STEP = 1  # header flag: the batch was the last of a training step


@dataclass
class Group:
    """A whole group: its number, tables (views of the journal's bytes) and step range."""

    number: int
    tables: dict[str, pa.Table]
    first_step: int | None  # None: the group holds no events
    last_step: int | None
    ends_step: bool  # the batch ended a training step (BGJ1 journals: unknown, False)
    offset: int  # where it starts in the journal


@dataclass
class Bad:
    """A stretch of the journal that is not a whole group."""

    offset: int
    length: int
    why: str  # what is wrong, completing "group 7 (steps 3-4) ..." or "bytes 10-20 ..."
    number: int | None = None  # the group number, when its header checks
    first_step: int | None = None
    last_step: int | None = None

    def describe(self, after_step: int | None = None) -> str:
        """What is wrong, with the steps the group held (its header checked) or the step the last
        whole group before it ended with (`after_step`)."""
        if self.number is None:
            after = "" if after_step is None else f" (after step {after_step})"
            return f"bytes {self.offset}-{self.offset + self.length}{after} {self.why}"
        steps = "no events" if self.first_step is None else (
            f"step {self.first_step}" if self.first_step == self.last_step else
            f"steps {self.first_step}-{self.last_step}")
        return f"group {self.number} ({steps}) {self.why}"


@dataclass
class Journal:
    groups: list[Group] = field(default_factory=list)  # whole groups in file order, each number once
    bad: list[Bad] = field(default_factory=list)  # what is not, in file order
    version: int = 0  # 2: BGJ2, 1: BGJ1, 0: empty or no group found

    def damage(self, folded: int, folded_last_step: Callable[[], int | None]) -> dict | None:
        """{"from_step", "reason"} when groups above `folded` may be lost; None when every group
        above it is here whole. `folded_last_step()` gives the last step the rank file holds
        (None: no events); it is called only when the loss starts right after the folded groups.
        from_step is the first step whose events cannot be trusted complete, None when no step
        before the loss is known (the whole rank)."""
        start = max(folded, 0) + 1
        good = {g.number: g for g in self.groups}
        headed = {b.number: b for b in self.bad if b.number is not None and b.number >= start
                  and b.number not in good}
        top = max([*good, *headed, start - 1])
        lost = [m for m in range(start, top + 1) if m not in good]
        last_numbered_at = max([g.offset for g in self.groups] + [headed[n].offset for n in headed], default=-1)
        if any(b.number is None and b.offset > last_numbered_at for b in self.bad):
            lost.append(top + 1)  # a tail that cannot be read may have held groups after the last known one
        if not lost:
            return None
        first = min(lost)
        if first in headed and headed[first].first_step is not None:
            from_step = headed[first].first_step
        else:
            p = first - 1
            while p in good and good[p].last_step is None:  # batches of call stacks only
                p -= 1
            if p in good:
                from_step = good[p].last_step + (1 if good[p].ends_step else 0)
            elif p < 1:
                from_step = None  # nothing before the loss: the whole rank
            else:  # the loss follows the folded groups: their last step may go on in it
                from_step = folded_last_step()
        problems = [b.describe(self._step_before(b.offset)) for b in self.bad]
        unexplained = [m for m in lost if m <= top and m not in headed]
        if unexplained and not any(b.number is None for b in self.bad):
            problems.append("group(s) " + ", ".join(map(str, unexplained[:5])) + " missing (batches never "
                            "written whole)")
        reason = problems[0] + (f"; and {len(problems) - 1} more problem(s)" if len(problems) > 1 else "")
        return {"from_step": from_step, "reason": reason}

    def _step_before(self, offset: int) -> int | None:
        """The last step of the last whole group with events before `offset` in the file."""
        before = [g for g in self.groups if g.offset < offset and g.last_step is not None]
        return max(before, key=lambda g: g.offset).last_step if before else None


def _steps(tables: dict[str, pa.Table]) -> tuple[int, int]:
    """The step range of a batch's events (online mode, which records none: of its sensor rows)."""
    events = next((t for t in (tables.get(n.name) for n in (EVENTS, SENSOR_STATS, ALERTS, API_EVENTS, VIOLATIONS))
                   if t is not None and t.num_rows), None)
    if events is None:
        return -1, -1
    bounds = pc.min_max(events.column("step"))
    return bounds["min"].as_py(), bounds["max"].as_py()


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def encode_group(number: int, tables: dict[str, pa.Table], ends_step: bool = False) -> bytes:
    """One BGJ2 group: the batch's non-empty tables between a checked header and a checked end."""
    parts = []
    for i, t in enumerate(ROW_TABLES):
        if t.name in tables and tables[t.name].num_rows:
            data = _ipc(tables[t.name])
            parts += [_PART.pack(i, len(data)), data]
    payload = b"".join(parts)
    first, last = _steps(tables)
    head = _HEAD.pack(MAGIC, number, len(parts) // 2, len(payload), first, last,
                      ENDS_STEP if ends_step else 0, 0)[:-4]
    return b"".join([head, struct.pack("<I", zlib.crc32(head)), payload,
                     _END.pack(END_MAGIC, number, zlib.crc32(payload))])


def _check_schema(name: str, table: pa.Table) -> None:
    """ValueError unless `table` has the columns and types the writer gives table `name`, and its
    buffers are consistent (offsets in range, UTF-8 text): a journal from before checksums can hold
    anything, and a table is only read once it is known to be whole."""
    table.validate(full=True)
    expected = SCHEMAS[name]
    later = LATER_COLUMNS.get(name, set())
    for f in table.schema:
        i = expected.get_field_index(f.name)
        if i < 0 or expected.field(i).type != f.type:
            raise ValueError(f"column {name}.{f.name} of type {f.type} is not one bitguard writes")
    missing = set(expected.names) - set(table.schema.names) - later
    if missing:
        raise ValueError(f"table {name} lacks column(s) {', '.join(sorted(missing))}")


def _parts(buf: pa.Buffer, at: int, end: int, count: int) -> dict[str, pa.Table]:
    """The tables of one payload; ValueError when it is not `count` well-formed parts ending at `end`."""
    tables = {}
    for _ in range(count):
        if at + _PART.size > end:
            raise ValueError("a part runs past its group")
        index, length = _PART.unpack(buf[at:at + _PART.size])
        at += _PART.size
        if index >= len(ROW_TABLES) or ROW_TABLES[index].name in tables or at + length > end:
            raise ValueError("a part is not well formed")
        name = ROW_TABLES[index].name
        table = pa.ipc.open_stream(buf.slice(at, length)).read_all()
        _check_schema(name, table)
        tables[name] = table
        at += length
    if at != end:
        raise ValueError("bytes follow the last part")
    return tables


def _header(data: bytes, at: int) -> tuple | None:
    """The BGJ2 header at `at` when it is whole and checks; else None."""
    if at + _HEAD.size > len(data) or data[at:at + 4] != MAGIC:
        return None
    head = _HEAD.unpack_from(data, at)
    if zlib.crc32(data[at:at + _HEAD.size - 4]) != head[-1] or head[2] > len(ROW_TABLES):
        return None
    return head


def _resync(data: bytes, at: int) -> int:
    """The offset of the next header that checks, from `at` on (len(data): none)."""
    while True:
        at = data.find(MAGIC, at)
        if at < 0:
            return len(data)
        if _header(data, at) is not None:
            return at
        at += 1


def _decode_v2(data: bytes) -> Journal:
    journal, buf, at, seen = Journal(version=2), pa.py_buffer(data), 0, set()
    while at < len(data):
        head = _header(data, at)
        if head is None:
            nxt = _resync(data, at + 1)
            tail = nxt == len(data)
            why = ("are a group cut short" if tail and nxt - at < _HEAD.size and MAGIC.startswith(data[at:at + 4])
                   else "cannot be decoded")
            journal.bad.append(Bad(at, nxt - at, why))
            at = nxt
            continue
        _, number, count, length, first, last, flags, _ = head
        steps = (None if first < 0 else first, None if last < 0 else last)
        body, end = at + _HEAD.size, at + _HEAD.size + length
        why = None
        if end + _END.size > len(data):
            why = "is cut short (the file ends inside it)"
        else:
            end_magic, end_number, crc = _END.unpack_from(data, end)
            if end_magic != END_MAGIC or end_number != number:
                why = "has no intact end mark"
            elif zlib.crc32(data[body:end]) != crc:
                why = "fails its checksum"
            elif number in seen:
                why = "repeats an earlier group"
        if why is None:
            try:
                tables = _parts(buf, body, end, count)
            except Exception as exc:  # noqa: BLE001 - bytes that passed a CRC yet decode to nothing sane
                why = f"cannot be decoded ({str(exc)[:100]})"
        if why is not None:
            nxt = _resync(data, at + 1)
            journal.bad.append(Bad(at, nxt - at, why, number, *steps))
            at = nxt
            continue
        seen.add(number)
        journal.groups.append(Group(number, tables, *steps, bool(flags & ENDS_STEP), at))
        at = end + _END.size
    return journal


def _decode_v1(data: bytes) -> Journal:
    """A journal from before checksums: whole groups up to the first one that is not."""
    journal, buf, at = Journal(version=1), pa.py_buffer(data), 0
    while at < len(data):
        start = at
        try:
            magic, number, count = _HEAD_V1.unpack_from(data, at)
            if magic != MAGIC_V1:
                raise ValueError("no group header")
            at += _HEAD_V1.size
            tables = {}
            for _ in range(count):
                index, length = _PART.unpack_from(data, at)
                at += _PART.size
                if index >= len(ROW_TABLES) or at + length > len(data):
                    raise ValueError("cut short")
                name = ROW_TABLES[index].name
                tables[name] = pa.ipc.open_stream(buf.slice(at, length)).read_all()
                _check_schema(name, tables[name])
                at += length
            end, end_number = _END_V1.unpack_from(data, at)
            if end != END_MAGIC or end_number != number or number in {g.number for g in journal.groups}:
                raise ValueError("no end mark")
        except Exception:  # noqa: BLE001 - without checksums, anything: pyarrow raises OSError, SystemError...
            journal.bad.append(Bad(start, len(data) - start, "cannot be decoded (a journal from before checksums: "
                                   "a group cut short or damaged)"))
            break
        at += _END_V1.size
        first, last = _steps(tables)
        journal.groups.append(Group(number, tables, None if first < 0 else first, None if last < 0 else last,
                                    False, start))
    return journal


def decode(data: bytes) -> Journal:
    """The groups of a journal's bytes and what in them is not a whole group."""
    if not data:
        return Journal()
    if data[:4] == MAGIC_V1:
        return _decode_v1(data)
    return _decode_v2(data)
