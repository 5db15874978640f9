"""Perfetto export: a comparison as a trace file that ui.perfetto.dev opens.

Layout of the trace:
- one process per run × rank ("Run A (reference: <dir>) · rank 0"), A and B of a rank together;
- in it one track per phase (data, forward, backward, optimizer), named "A rank 0 forward";
- one slice per event, named after its boundary, with its status, step, pair and tensor
  digests (hex) as args; its status is also the slice's category;
- a flow between the two events of each matched pair (drawn from the earlier of the two);
- the pivot (per rank) as a slice named "[PIVOT] <boundary>" with pivot=true, on both runs,
  plus an instant event "PIVOT: <boundary>" on the same track.

A track holds properly nested slices only. Events are recorded in completion order, so each
track's events are sorted by start time and stacked; an event that would partially overlap an
open slice (backward hooks of sibling modules can) goes to a child track "... (overlap N)".

Reads `Comparison.events()` and each rank's event and tensor frames; knows nothing of how the
runs were aligned or blamed, and writes the protos directly (no trace processor involved).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import (
    DebugAnnotation,
    Trace,
    TracePacket,
    TrackDescriptor,
    TrackEvent,
)

from bitguard.errors import BadInput

SEQUENCE_ID = 1  # every packet is written on one trusted sequence (interning is per sequence)
PHASE_ORDER = ("data", "forward", "backward", "optimizer")  # top to bottom within a process
SIDES = {"a": "reference", "b": "suspect"}
# Event fields (bitguard.schema.EVENTS columns, a test checks) that every slice carries as args,
# beside the comparison's own: status, row, the partner's seq, digests, differing, pivot...
EVENT_ARGS = ("step", "phase", "kind", "module_type", "call", "depth", "seq", "thread")
PIVOT_SLICE_PREFIX = "[PIVOT] "
PIVOT_INSTANT_PREFIX = "PIVOT: "

_BEGIN, _END, _INSTANT = TrackEvent.TYPE_SLICE_BEGIN, TrackEvent.TYPE_SLICE_END, TrackEvent.TYPE_INSTANT


@dataclass
class Slice:
    """One event of one run, as it will appear on a track."""

    side: str  # "a" or "b"
    rank: int
    seq: int  # the event's seq in its own run
    start: int  # ns on the run's time base (see _origins)
    end: int
    phase: str
    name: str
    args: dict  # debug annotations: name -> str | int | bool | dict
    category: str  # the pair's status
    flow: int | None = None  # flow id shared with the partner slice
    flow_ends: bool = False  # True on the later slice of the pair: it terminates the flow
    pivot_label: str | None = None  # "PIVOT: <boundary>" on a pivot slice: an instant is added
    lane: int = 0  # 0: the phase track; N: its Nth overlap child track


def export(comparison, path, max_events: int | None = None) -> Path:
    """Write `comparison` as a Perfetto trace to `path` and return the path written.

    `max_events` caps the aligned rows exported (both runs' slices of a row count as one row),
    split evenly across ranks. Each rank keeps a contiguous window of rows centred on its
    pivot (its first rows when it has none); the rows outside the window are dropped with
    their slices and flows, and the process track says how many were left out.
    """
    if max_events is not None and max_events < 1:
        raise BadInput(f"max_events={max_events} keeps nothing; give a positive number or None for every event")
    path = Path(path)
    if path.is_dir():
        raise BadInput(f"{path} is a directory; give the trace file to write, e.g. {path / 'compare.pftrace'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    origins = _origins(comparison)
    ranks = sorted(comparison.ranks)
    budget = None if max_events is None else max(1, max_events // max(1, len(ranks)))
    writer = _Writer()
    first = comparison.first_divergence
    for rank in ranks:
        rows, dropped = _window(comparison.events(rank), budget)
        slices = _slices(comparison, rank, rows, origins, first)
        for side in SIDES:
            writer.process(comparison, side, rank, [s for s in slices if s.side == side], dropped, max_events)
    with open(path, "wb") as f:
        writer.write(f)
    return path


# -- what goes in ---------------------------------------------------------------------------------

def _origins(comparison) -> dict[str, int]:
    """Each run's time origin: its earliest event start over all ranks.

    Both runs start at 0 on the same axis (rather than B after A): a matched pair then sits
    at about the same x in both processes, so timing drift, extra events and the pivot are
    seen side by side at one zoom level. Ranks of one run share their run's origin, so their
    relative timing is kept. Perfetto draws a flow from the earlier of its two slices, so the
    A → B arrow of a pair points backwards where run B got there first.
    """
    out = {}
    for side in SIDES:
        starts = [rc.events_a if side == "a" else rc.events_b for rc in comparison.ranks.values()]
        starts = [int(ev["t_start_ns"].min()) for ev in starts if ev.height]
        out[side] = min(starts) if starts else 0
    return out


def _window(rows: pl.DataFrame, budget: int | None) -> tuple[pl.DataFrame, int]:
    if budget is None or rows.height <= budget:
        return rows, 0
    pivot_rows = rows.filter(pl.col("is_pivot"))["row"]
    centre = int(pivot_rows[0]) if pivot_rows.len() else 0
    lo = max(0, min(centre - budget // 2, rows.height - budget))
    return rows.slice(lo, budget), rows.height - budget


def _digests(tensors: pl.DataFrame, seqs: list[int]) -> dict[int, dict]:
    """seq -> {"output_0": {"xor": hex, "pos": hex}, ...} (no brackets: Perfetto reads them as arrays)."""
    out: dict[int, dict] = {}
    rows = tensors.filter(pl.col("seq").is_in(seqs)).sort("seq", "role", "idx")
    for seq, role, idx, xor, pos in rows.select("seq", "role", "idx", "xor", "pos").iter_rows():
        out.setdefault(seq, {})[f"{role}_{idx}"] = {"xor": f"{int(xor):016x}", "pos": f"{int(pos):016x}"}
    return out


def _differing(diffs: pl.DataFrame, a_seqs: list[int]) -> dict[int, str]:
    rows = diffs.filter(pl.col("a_seq").is_in(a_seqs) & pl.col("differs")).sort("a_seq", "role", "idx")
    out: dict[int, list[str]] = {}
    for a_seq, role, idx in rows.select("a_seq", "role", "idx").iter_rows():
        out.setdefault(a_seq, []).append(f"{role}_{idx}")
    return {k: ", ".join(v) for k, v in out.items()}


def _slices(comparison, rank: int, rows: pl.DataFrame, origins: dict, first: dict | None) -> list[Slice]:
    rc = comparison.ranks[rank]
    a_seqs = rows["a_seq"].drop_nulls().to_list()
    b_seqs = rows["b_seq"].drop_nulls().to_list()
    digests = {"a": _digests(rc.tensors_a, a_seqs), "b": _digests(rc.tensors_b, b_seqs)}
    threads = {side: dict(zip(ev["seq"].to_list(), ev["thread"].to_list()))
               for side, ev in (("a", rc.events_a), ("b", rc.events_b))}
    differing = _differing(rc.diffs, a_seqs)
    out = []
    for r in rows.iter_rows(named=True):
        pair = []
        for side, other in (("a", "b"), ("b", "a")):
            seq = r[f"{side}_seq"]
            if seq is None:
                continue
            start = r[f"{side}_t_start_ns"] - origins[side]
            end = max(start, r[f"{side}_t_end_ns"] - origins[side])
            fields = {**r, "seq": seq, "thread": threads[side].get(seq)}
            args = {"status": r["status"], "row": r["row"], **{k: fields[k] for k in EVENT_ARGS}}
            if r[f"{other}_seq"] is not None:
                args[f"{other}_seq"] = r[f"{other}_seq"]
            if r["reordered"]:
                args["reordered"] = True
            if r["rule_id"]:
                args["rule_id"] = r["rule_id"]
            if r["a_seq"] in differing:
                args["differing"] = differing[r["a_seq"]]
            if digests[side].get(seq):
                args["digests"] = digests[side][seq]
            s = Slice(side, rank, seq, start, end, r["phase"], r["boundary"], args, r["status"])
            if r["is_pivot"]:
                s.name = PIVOT_SLICE_PREFIX + r["boundary"]
                s.pivot_label = PIVOT_INSTANT_PREFIX + r["boundary"]
                s.args.update(pivot=True, blame=rc.blame["blame"], fault_class=rc.blame["fault_class"],
                              first_divergence=first is not None and first["rank"] == rank)
                window = (rc.blame.get("blame_window") or {}).get("module")
                if window:
                    s.args["blame_window"] = window
            pair.append(s)
        if len(pair) == 2:
            a, b = pair
            a.flow = b.flow = ((rank + 1) << 40) + r["a_seq"]
            later = b if (b.start, 1) > (a.start, 0) else a
            later.flow_ends = True
        out += pair
    return out


# -- nesting ------------------------------------------------------------------------------------

def assign_lanes(slices: list[Slice]) -> list[list[Slice]]:
    """Split one track's slices into lanes in which every pair of slices nests or is disjoint.

    Slices go in start order (longest first at equal starts, so a parent precedes its child);
    each takes the first lane whose open slices it fits inside, else a new lane. Returns the
    lanes, each sorted in that order.
    """
    lanes: list[list[Slice]] = []
    open_ends: list[list[int]] = []  # per lane: ends of the slices still open, innermost last
    for s in sorted(slices, key=lambda s: (s.start, -s.end, s.seq)):
        for k, stack in enumerate(open_ends):
            while stack and stack[-1] <= s.start:
                stack.pop()
            if not stack or s.end <= stack[-1]:
                break
        else:
            k = len(lanes)
            lanes.append([])
            open_ends.append([])
        s.lane = k
        lanes[k].append(s)
        open_ends[k].append(s.end)
    return lanes


def _track_events(lane: list[Slice]) -> list[tuple[int, int, Slice]]:
    """(ts, type, slice) in an order that nests: a slice ends before a later sibling begins."""
    out: list[tuple[int, int, Slice]] = []
    stack: list[Slice] = []
    for s in lane:
        while stack and stack[-1].end <= s.start:
            out.append((stack[-1].end, _END, stack.pop()))
        out.append((s.start, _BEGIN, s))
        if s.pivot_label:
            out.append((s.start, _INSTANT, s))
        stack.append(s)
    while stack:
        out.append((stack[-1].end, _END, stack.pop()))
    return out


# -- what goes out ------------------------------------------------------------------------------

class _Writer:
    """Collects tracks and their events, then writes packets in timestamp order with interning."""

    def __init__(self):
        self._next_uuid = 1
        self.descriptors: list[TrackDescriptor] = []
        self.events: list[tuple[int, int, int, int, Slice | str]] = []  # ts, order, type, track uuid, slice/name
        self._interned: dict[str, dict[str, int]] = {}  # interned table -> name -> iid

    def _uuid(self) -> int:
        self._next_uuid += 1
        return self._next_uuid

    def process(self, comparison, side: str, rank: int, slices: list[Slice], dropped: int,
                max_events: int | None) -> None:
        run = comparison.run_a if side == "a" else comparison.run_b
        label = side.upper()
        proc = TrackDescriptor(uuid=self._uuid(), child_ordering=TrackDescriptor.EXPLICIT)
        proc.process.pid = 2 * rank + (1 if side == "a" else 2)  # A then B of each rank, ranks in order
        proc.process.process_name = f"Run {label} ({SIDES[side]}: {run.name}) · rank {rank}"
        proc.description = f"run {label}: {run.name}" + (  # the folder's name: no server path in a download
            f"; {dropped} aligned rows of this rank not exported (max_events={max_events})" if dropped else "")
        self.descriptors.append(proc)
        if dropped:
            self._add(0, _INSTANT, proc.uuid, f"bitguard: {dropped} events not exported (max_events={max_events})")
        phases = sorted({s.phase for s in slices},
                        key=lambda p: (PHASE_ORDER.index(p) if p in PHASE_ORDER else len(PHASE_ORDER), p))
        for order, phase in enumerate(phases):
            name = f"{label} rank {rank} {phase}"
            lanes = assign_lanes([s for s in slices if s.phase == phase])
            parent = TrackDescriptor(uuid=self._uuid(), parent_uuid=proc.uuid, name=name, sibling_order_rank=order,
                                     child_ordering=TrackDescriptor.EXPLICIT)
            parent.description = f"{phase} events of run {label} ({run.name}), rank {rank}"
            self.descriptors.append(parent)
            for k, lane in enumerate(lanes):
                uuid = parent.uuid
                if k:
                    child = TrackDescriptor(uuid=self._uuid(), parent_uuid=parent.uuid,
                                            name=f"{name} (overlap {k})", sibling_order_rank=k)
                    child.description = ("events that partially overlap an event on the track above "
                                         "(they cannot nest there)")
                    self.descriptors.append(child)
                    uuid = child.uuid
                for ts, kind, s in _track_events(lane):
                    self._add(ts, kind, uuid, s)

    def _add(self, ts: int, kind: int, uuid: int, what) -> None:
        self.events.append((ts, len(self.events), kind, uuid, what))

    def write(self, f) -> None:
        first = TracePacket(trusted_packet_sequence_id=SEQUENCE_ID, first_packet_on_sequence=True,
                            sequence_flags=TracePacket.SEQ_INCREMENTAL_STATE_CLEARED)
        first.track_descriptor.CopyFrom(self.descriptors[0])
        _emit(f, first)
        for d in self.descriptors[1:]:
            _emit(f, TracePacket(trusted_packet_sequence_id=SEQUENCE_ID, track_descriptor=d))
        # The trace processor sorts by timestamp; ties keep file order, which is each track's
        # nesting order (a stable sort of per-track sequences that are already in ts order).
        for ts, _, kind, uuid, what in sorted(self.events, key=lambda e: (e[0], e[1])):
            _emit(f, self._packet(ts, kind, uuid, what))

    def _packet(self, ts: int, kind: int, uuid: int, what) -> TracePacket:
        p = TracePacket(timestamp=ts, trusted_packet_sequence_id=SEQUENCE_ID,
                        sequence_flags=TracePacket.SEQ_NEEDS_INCREMENTAL_STATE)
        ev = p.track_event
        ev.type = kind
        ev.track_uuid = uuid
        if kind == _END:
            return p
        if isinstance(what, str):
            ev.name_iid = self._intern(p, "event_names", what)
            return p
        s: Slice = what
        ev.categories.append(s.category)
        if kind == _INSTANT:
            ev.name_iid = self._intern(p, "event_names", s.pivot_label)
            self._annotate(p, ev.debug_annotations, {k: s.args[k] for k in
                                                     ("step", "phase", "blame", "fault_class", "first_divergence")})
            return p
        ev.name_iid = self._intern(p, "event_names", s.name)
        if s.flow is not None:
            (ev.terminating_flow_ids if s.flow_ends else ev.flow_ids).append(s.flow)
        self._annotate(p, ev.debug_annotations, s.args)
        return p

    def _intern(self, p: TracePacket, table: str, name: str) -> int:
        """The iid of `name` in the interned `table` (event_names, debug_annotation_names); a
        name is interned on the first packet that uses it, which is also the first in the file."""
        ids = self._interned.setdefault(table, {})
        iid = ids.get(name)
        if iid is None:
            iid = ids[name] = len(ids) + 1
            getattr(p.interned_data, table).add(iid=iid, name=name)
        return iid

    def _annotate(self, p: TracePacket, target, args: dict) -> None:
        for name, value in args.items():
            if value is None:
                continue
            a: DebugAnnotation = target.add()
            a.name_iid = self._intern(p, "debug_annotation_names", name)
            if isinstance(value, dict):
                self._annotate(p, a.dict_entries, value)
            elif isinstance(value, bool):
                a.bool_value = value
            elif isinstance(value, int):
                a.int_value = value
            else:
                a.string_value = str(value)


def _emit(f, packet: TracePacket) -> None:
    """Append one packet as a `Trace.packet` field: the file is a concatenation of them."""
    f.write(Trace(packet=[packet]).SerializeToString())
