"""The Perfetto export, read back with Perfetto's own protos.

Every check reads the written file, resolves interned names the way the trace processor does,
and compares with the comparison's own tables: tracks per run × rank × phase, one slice per
event, proper nesting on every track, flows between matched pairs, the pivot marked.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import polars as pl
import pytest
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TracePacket, TrackEvent

from bitguard.backend.perfetto_export import EVENT_ARGS, Slice, assign_lanes, export
from bitguard.errors import BadInput
from bitguard.schema import EVENTS

BEGIN, END, INSTANT = TrackEvent.TYPE_SLICE_BEGIN, TrackEvent.TYPE_SLICE_END, TrackEvent.TYPE_INSTANT


# ---------------------------------------------------------------------------------------------
# Reading a trace back


@dataclass
class Event:
    ts: int
    type: int
    track: int
    name: str | None
    args: dict
    flow_ids: list[int]
    terminating_flow_ids: list[int]
    categories: list[str]


@dataclass
class ReadTrace:
    tracks: dict[int, object] = field(default_factory=dict)  # uuid -> TrackDescriptor
    events: list[Event] = field(default_factory=list)  # in file order

    def name(self, uuid: int) -> str:
        d = self.tracks[uuid]
        return d.name or d.process.process_name

    def tracks_named(self, name: str) -> list[int]:
        return [u for u in self.tracks if self.name(u) == name]

    def family(self, uuid: int) -> set[int]:
        """A phase track and its overlap child tracks."""
        return {uuid} | {u for u, d in self.tracks.items() if d.parent_uuid == uuid}

    def slices(self, tracks: set[int] | None = None) -> list[Event]:
        return [e for e in self.events if e.type == BEGIN and (tracks is None or e.track in tracks)]

    def side_of(self, track: int) -> str:
        while self.tracks[track].HasField("parent_uuid"):
            track = self.tracks[track].parent_uuid
        return self.tracks[track].process.process_name.split()[1]  # "Run A (...) · rank 0" -> "A"


def _args(annotations, names: dict[int, str]) -> dict:
    out = {}
    for a in annotations:
        key = names[a.name_iid] if a.HasField("name_iid") else a.name
        kind = a.WhichOneof("value")
        out[key] = _args(a.dict_entries, names) if a.dict_entries else getattr(a, kind) if kind else None
    return out


def read(path) -> ReadTrace:
    trace = Trace.FromString(path.read_bytes())
    out = ReadTrace()
    event_names: dict[int, str] = {}
    arg_names: dict[int, str] = {}
    for i, p in enumerate(trace.packet):
        assert p.trusted_packet_sequence_id == 1, f"packet {i} is not on the one sequence"
        if i == 0:
            assert p.sequence_flags & TracePacket.SEQ_INCREMENTAL_STATE_CLEARED, "first packet must clear state"
        for n in p.interned_data.event_names:
            assert n.iid not in event_names, f"event name iid {n.iid} interned twice"
            event_names[n.iid] = n.name
        for n in p.interned_data.debug_annotation_names:
            assert n.iid not in arg_names, f"annotation name iid {n.iid} interned twice"
            arg_names[n.iid] = n.name
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            assert d.uuid not in out.tracks, f"track {d.uuid} described twice"
            out.tracks[d.uuid] = d
        if p.HasField("track_event"):
            ev = p.track_event
            assert ev.track_uuid in out.tracks, f"packet {i} uses track {ev.track_uuid} before describing it"
            name = None
            if ev.HasField("name_iid"):
                assert ev.name_iid in event_names, f"packet {i}: name iid {ev.name_iid} used before it is interned"
                name = event_names[ev.name_iid]
            out.events.append(Event(p.timestamp, ev.type, ev.track_uuid, name, _args(ev.debug_annotations, arg_names),
                                    list(ev.flow_ids), list(ev.terminating_flow_ids), list(ev.categories)))
    return out


def assert_nests(trace: ReadTrace) -> None:
    """Per track, in the trace processor's order (by ts, ties in file order), slices nest."""
    per_track = defaultdict(list)
    for e in sorted(trace.events, key=lambda e: e.ts):  # sorted() is stable: ties keep file order
        per_track[e.track].append(e)
    for track, events in per_track.items():
        stack: list[Event] = []
        for e in events:
            if e.type == BEGIN:
                stack.append(e)
            elif e.type == END:
                assert stack, f"track {trace.name(track)!r}: an end at {e.ts} with no open slice"
                begun = stack.pop()
                assert e.ts >= begun.ts, f"track {trace.name(track)!r}: {begun.name} ends before it begins"
        assert not stack, f"track {trace.name(track)!r}: {[s.name for s in stack]} never end"
    files_order = [e.ts for e in trace.events]
    assert files_order == sorted(files_order), "packets are not written in timestamp order"


def depths(trace: ReadTrace, track: int) -> list[tuple[str, int, dict]]:
    """(name, nesting depth, args) of each slice of one track, in begin order."""
    out, stack = [], 0
    for e in sorted((e for e in trace.events if e.track == track), key=lambda e: e.ts):
        if e.type == BEGIN:
            out.append((e.name, stack, e.args))
            stack += 1
        elif e.type == END:
            stack -= 1
    return out


@pytest.fixture(scope="module")
def bitflip_trace(forward_bitflip, tmp_path_factory):
    path = export(forward_bitflip, tmp_path_factory.mktemp("perfetto") / "bitflip.pftrace")
    return read(path)


@pytest.fixture(scope="module")
def gap_trace(gap_then_divergence, tmp_path_factory):
    return read(gap_then_divergence.export_perfetto(tmp_path_factory.mktemp("perfetto") / "gap.pftrace"))


# ---------------------------------------------------------------------------------------------
# A real recorded pair


@pytest.mark.slow
def test_a_track_per_run_rank_and_phase(forward_bitflip, bitflip_trace):
    t = bitflip_trace
    processes = sorted(d.process.process_name for d in t.tracks.values() if d.HasField("process"))
    assert [p.split(" · ")[0].split(" (")[0] + " · " + p.split(" · ")[-1] for p in processes] == \
        ["Run A · rank 0", "Run B · rank 0"], processes
    for side, events in (("A", forward_bitflip.ranks[0].events_a), ("B", forward_bitflip.ranks[0].events_b)):
        for phase in events["phase"].unique().to_list():
            (uuid,) = t.tracks_named(f"{side} rank 0 {phase}")
            parent = t.tracks[t.tracks[uuid].parent_uuid]
            assert parent.process.process_name.startswith(f"Run {side} "), (phase, parent)


@pytest.mark.slow
def test_one_slice_per_event_on_each_phase_track(forward_bitflip, bitflip_trace):
    t = bitflip_trace
    rc = forward_bitflip.ranks[0]
    for side, events in (("A", rc.events_a), ("B", rc.events_b)):
        for phase, n in Counter(events["phase"].to_list()).items():
            (uuid,) = t.tracks_named(f"{side} rank 0 {phase}")
            slices = t.slices(t.family(uuid))
            assert len(slices) == n, f"{side} {phase}: {len(slices)} slices for {n} events"
            assert sorted(s.args["seq"] for s in slices) == sorted(events.filter(pl.col("phase") == phase)["seq"])


@pytest.mark.slow
def test_every_track_nests_and_forward_calls_nest_inside_their_callers(bitflip_trace):
    t = bitflip_trace
    assert_nests(t)
    (fwd,) = t.tracks_named("A rank 0 forward")
    step0 = {name: depth for name, depth, args in depths(t, fwd) if args["step"] == 0}
    assert step0["GPT"] == 0 and step0["blocks.0"] == 1, step0
    assert step0["blocks.0.mlp"] == 2 and step0["blocks.0.mlp.fc"] == 3, step0
    assert all(args["depth"] == depth for name, depth, args in depths(t, fwd)), \
        "on the forward track, slice nesting should equal the recorded module depth"


@pytest.mark.slow
def test_partial_overlaps_go_to_child_tracks(forward_bitflip, bitflip_trace):
    t = bitflip_trace
    (bwd,) = t.tracks_named("A rank 0 backward")
    children = sorted(t.name(u) for u, d in t.tracks.items() if d.parent_uuid == bwd)
    # backward hooks of sibling modules overlap in this model (e.g. mlp.proj and mlp.act)
    assert children and all(c.startswith("A rank 0 backward (overlap ") for c in children), children


@pytest.mark.slow
def test_time_starts_at_zero_for_each_run(bitflip_trace):
    t = bitflip_trace
    for side in "AB":
        starts = [e.ts for e in t.slices() if t.side_of(e.track) == side]
        assert min(starts) == 0, f"run {side} starts at {min(starts)}"


@pytest.mark.slow
def test_flows_link_each_matched_pair(forward_bitflip, bitflip_trace):
    t = bitflip_trace
    pairs = forward_bitflip.ranks[0].pairs
    by_flow = defaultdict(list)
    for s in t.slices():
        for f in s.flow_ids + s.terminating_flow_ids:
            by_flow[f].append(s)
    assert len(by_flow) == pairs.height
    linked = set()
    for flow, ends in by_flow.items():
        assert len(ends) == 2, f"flow {flow} has {len(ends)} ends"
        ends.sort(key=lambda s: t.side_of(s.track))
        a, b = ends
        assert (t.side_of(a.track), t.side_of(b.track)) == ("A", "B")
        starts, finishes = (a, b) if a.flow_ids else (b, a)
        assert starts.flow_ids == [flow] and finishes.terminating_flow_ids == [flow] and starts.ts <= finishes.ts
        assert a.args["b_seq"] == b.args["seq"] and b.args["a_seq"] == a.args["seq"]
        linked.add((a.args["seq"], b.args["seq"]))
    assert linked == set(zip(pairs["a_seq"].to_list(), pairs["b_seq"].to_list()))


@pytest.mark.slow
def test_pivot_is_marked_on_its_slices(forward_bitflip, bitflip_trace):
    t = bitflip_trace
    fd = forward_bitflip.first_divergence
    marked = [s for s in t.slices() if s.args.get("pivot")]
    assert sorted((t.side_of(s.track), s.args["seq"]) for s in marked) == [("A", fd["a_seq"]), ("B", fd["b_seq"])]
    for s in marked:
        assert s.name == f"[PIVOT] {fd['boundary']}" and s.args["status"] == "diverged"
        assert s.args["blame"] == fd["blame"] and s.args["first_divergence"] is True
        assert t.name(s.track).endswith(f"rank 0 {fd['phase']}")
    instants = [e for e in t.events if e.type == INSTANT]
    assert sorted((e.track, e.ts) for e in instants) == sorted((s.track, s.ts) for s in marked)
    assert {e.name for e in instants} == {f"PIVOT: {fd['boundary']}"}
    assert not [s for s in t.slices() if s.name.startswith("[PIVOT]") and not s.args.get("pivot")]


@pytest.mark.slow
def test_digests_status_and_differing_tensors_are_args(forward_bitflip, bitflip_trace):
    t = bitflip_trace
    fd = forward_bitflip.first_divergence
    (a,) = [s for s in t.slices() if s.args.get("pivot") and t.side_of(s.track) == "A"]
    (b,) = [s for s in t.slices() if s.args.get("pivot") and t.side_of(s.track) == "B"]
    for tensor in fd["tensors"]:
        key = f"{tensor['role']}_{tensor['index']}"
        assert a.args["digests"][key] == tensor["a"], key
        assert b.args["digests"][key] == tensor["b"], key
    assert a.args["differing"] == ", ".join(f"{x['role']}_{x['index']}" for x in fd["tensors"] if x["differs"])
    assert a.categories == ["diverged"] and a.args["step"] == fd["step"] and a.args["phase"] == fd["phase"]
    statuses = Counter(s.args["status"] for s in t.slices() if t.side_of(s.track) == "A")
    events = forward_bitflip.events(0)
    assert statuses == Counter(events.filter(pl.col("a_seq").is_not_null())["status"].to_list())


# ---------------------------------------------------------------------------------------------
# Synthetic pairs: gaps, two ranks, identical runs, the event cap


def test_two_ranks_each_with_both_runs_and_gaps_without_flows(gap_then_divergence, gap_trace):
    t = gap_trace
    assert_nests(t)
    processes = sorted(d.process.process_name.split(" (")[0] + d.process.process_name.split(")")[-1]
                       for d in t.tracks.values() if d.HasField("process"))
    assert processes == ["Run A · rank 0", "Run A · rank 1", "Run B · rank 0", "Run B · rank 1"]
    for rank, rc in gap_then_divergence.ranks.items():
        for side, events in (("A", rc.events_a), ("B", rc.events_b)):
            tracks = set().union(*(t.family(u) for u in t.tracks
                                   if t.name(u).startswith(f"{side} rank {rank} ")))
            assert len(t.slices(tracks)) == events.height, (side, rank)
    gaps = [s for s in t.slices() if s.args["status"] == "only_a"]
    assert len(gaps) == 2 and all(s.name == "model.probe" and not (s.flow_ids or s.terminating_flow_ids)
                                  and "b_seq" not in s.args for s in gaps)
    marked = [s for s in t.slices() if s.args.get("pivot")]
    assert {t.name(s.track) for s in marked} == {"A rank 1 forward", "B rank 1 forward"}


def test_identical_runs_have_no_pivot(identical_runs, tmp_path):
    t = read(export(identical_runs, tmp_path / "same.pftrace"))
    assert_nests(t)
    assert not [e for e in t.events if e.type == INSTANT]
    assert {s.args["status"] for s in t.slices()} == {"identical"}
    assert not [s for s in t.slices() if s.args.get("pivot")]


def test_max_events_keeps_a_window_around_each_pivot(gap_then_divergence, tmp_path):
    t = read(export(gap_then_divergence, tmp_path / "capped.pftrace", max_events=20))
    assert_nests(t)
    per_rank = Counter((t.side_of(s.track), t.name(s.track).split()[2]) for s in t.slices())
    assert max(per_rank.values()) <= 10, per_rank  # 20 rows over two ranks, one slice per run and row
    assert sum(1 for s in t.slices() if s.args.get("pivot")) == 2, "the pivot row must survive the cap"
    notes = [e.name for e in t.events if e.type == INSTANT and not e.name.startswith("PIVOT")]
    total = gap_then_divergence.events(0).height
    assert f"bitguard: {total - 10} events not exported (max_events=20)" in notes, notes
    assert any("not exported" in d.description for d in t.tracks.values() if d.HasField("process"))


def test_bad_arguments_say_what_to_do(gap_then_divergence, tmp_path):
    with pytest.raises(BadInput, match="positive number"):
        export(gap_then_divergence, tmp_path / "x.pftrace", max_events=0)
    with pytest.raises(BadInput, match="is a directory"):
        export(gap_then_divergence, tmp_path)


def test_cli_writes_a_trace_perfetto_can_read(gap_then_divergence, tmp_path):
    out = tmp_path / "out" / "cli.pftrace"
    proc = subprocess.run([sys.executable, "-m", "bitguard", "export-perfetto", str(gap_then_divergence.run_a.path),
                           str(gap_then_divergence.run_b.path), "-o", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout
    t = read(out)
    assert_nests(t)
    assert len(t.slices()) == sum(rc.events_a.height + rc.events_b.height
                                  for rc in gap_then_divergence.ranks.values())


# ---------------------------------------------------------------------------------------------
# Lanes


def _slice(seq: int, start: int, end: int) -> Slice:
    return Slice("a", 0, seq, start, end, "backward", f"s{seq}", {}, "identical")


def test_lanes_nest_and_split_partial_overlaps():
    parent, child, straddler, later = _slice(0, 0, 10), _slice(1, 2, 5), _slice(2, 4, 8), _slice(3, 10, 12)
    lanes = assign_lanes([later, straddler, child, parent])
    assert [[s.seq for s in lane] for lane in lanes] == [[0, 1, 3], [2]]
    for lane in lanes:
        for i, x in enumerate(lane):
            for y in lane[i + 1:]:
                disjoint = x.end <= y.start or y.end <= x.start
                nested = x.start <= y.start and y.end <= x.end
                assert disjoint or nested, f"{x.name} and {y.name} partially overlap on one lane"


def test_equal_intervals_nest_in_seq_order():
    lanes = assign_lanes([_slice(1, 0, 5), _slice(0, 0, 5), _slice(2, 5, 5)])
    assert [[s.seq for s in lane] for lane in lanes] == [[0, 1, 2]]


def test_event_args_are_schema_fields():
    assert set(EVENT_ARGS) <= set(EVENTS.names), set(EVENT_ARGS) - set(EVENTS.names)
