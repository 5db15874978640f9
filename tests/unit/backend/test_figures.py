"""The notebook's figures and summary, checked against the comparison tables they draw.

A figure is checked by what a reader would look for: where the markers are and what colour,
where the pivot is and what its label says, which band is shaded, what the hover text holds.
"""

from __future__ import annotations

import re

import polars as pl
import pytest

import fixtures_runs
from bitguard.backend import figures
from bitguard.backend.compare import compare


def traces(fig, name: str):
    return [t for t in fig.data if t.name == name]


def points(fig, name: str) -> list[tuple[float, float]]:
    return [(x, y) for t in traces(fig, name) for x, y in zip(t.x, t.y)]


def lane(fig, label: str) -> float:
    ticks = dict(zip(fig.layout.yaxis.ticktext, fig.layout.yaxis.tickvals))
    return ticks[label]


# ---------------------------------------------------------------------------------------------
# Timeline


@pytest.mark.slow
def test_timeline_draws_both_runs_row_by_row_in_status_colours(forward_bitflip):
    fig = forward_bitflip.timeline()
    ev = forward_bitflip.events()
    y_a, y_b = lane(fig, "rank 0 · A (reference)"), lane(fig, "rank 0 · B (suspect)")
    assert y_a > y_b, "run A is drawn above run B"
    for status in ev["status"].unique().to_list():
        trace, = traces(fig, figures.STATUS_LABELS[status])
        assert trace.marker.color == figures.STATUS_COLOURS[status]
        rows = sorted(ev.filter(pl.col("status") == status)["row"].to_list())
        assert sorted(x for x, y in zip(trace.x, trace.y) if y == y_a) == rows
        assert sorted(x for x, y in zip(trace.x, trace.y) if y == y_b) == rows


@pytest.mark.slow
def test_timeline_marks_the_pivot_and_shades_the_identical_prefix(forward_bitflip):
    fig = forward_bitflip.timeline()
    fd = forward_bitflip.first_divergence
    pivot_row = forward_bitflip.events().filter(pl.col("is_pivot"))["row"][0]
    assert sorted(points(fig, "pivot")) == sorted([(pivot_row, lane(fig, "rank 0 · A (reference)")),
                                                   (pivot_row, lane(fig, "rank 0 · B (suspect)"))])
    labels = [a.text for a in fig.layout.annotations]
    assert any(text.startswith(f"PIVOT: {fd['boundary']}") and fd["blame"] in text for text in labels), labels
    (band,) = fig.layout.shapes
    assert band.x1 == pivot_row - 0.5, "the shaded prefix ends just before the pivot"
    assert any(f"identical prefix: {pivot_row} events" in text for text in labels)
    assert fd["boundary"] in fig.layout.title.text


def test_timeline_marks_gaps_on_the_run_that_lacks_the_event(gap_then_divergence):
    fig = gap_then_divergence.timeline()
    ev = gap_then_divergence.events()
    only_a = ev.filter(pl.col("status") == "only_a")
    gaps = points(fig, "gap (missing on this run)")
    expected = [(r["row"], lane(fig, f"rank {r['rank']} · B (suspect)")) for r in only_a.iter_rows(named=True)]
    assert sorted(gaps) == sorted(expected)
    assert sorted(points(fig, "only in A")) == sorted(
        (r["row"], lane(fig, f"rank {r['rank']} · A (reference)")) for r in only_a.iter_rows(named=True))
    (gap_trace,) = traces(fig, "gap (missing on this run)")
    assert all(text.startswith("missing in B") for text in gap_trace.hovertext)


def test_timeline_of_one_rank(gap_then_divergence):
    fig = gap_then_divergence.timeline(rank=0)
    assert list(fig.layout.yaxis.ticktext) == ["rank 0 · A (reference)", "rank 0 · B (suspect)"]
    assert not points(fig, "pivot"), "rank 0 did not diverge; its timeline has no pivot"
    n = gap_then_divergence.events(0).height
    assert sum(len(t.x) for t in fig.data) == 2 * n


def test_timeline_aggregates_large_runs_into_bins_of_their_worst_status(gap_then_divergence, monkeypatch):
    monkeypatch.setattr(figures, "MAX_POINTS", 40)  # 2 ranks x 2 runs x 33 rows: 10 bins a lane, of 4 rows
    fig = gap_then_divergence.timeline()
    markers = sum(len(t.x) for t in fig.data if t.name != "pivot")
    assert markers <= 40, markers
    assert "bins of 4 rows" in fig.layout.xaxis.title.text
    ev = gap_then_divergence.events(1)
    y_a = lane(fig, "rank 1 · A (reference)")
    diverged_bins = {r // 4 for r in ev.filter(pl.col("status") == "diverged")["row"].to_list()}
    drawn = {int(x) // 4 for x, y in points(fig, "diverged") if y == y_a}
    assert drawn == diverged_bins, "a bin with a divergent row is drawn as diverged"
    (trace,) = traces(fig, "diverged")
    counts = [int(n) for text in trace.hovertext for n in re.findall(r"(\d+) diverged", text)]
    assert sum(counts) == 2 * ev.filter(pl.col("status") == "diverged").height, "hover counts every row"
    assert len(points(fig, "pivot")) == 2, "the pivot is drawn exactly, not binned"


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """39,102 events a run, the size of the issue's big pair (8 blocks x 2,058 steps, synthetic):
    block 3 diverges at step 2,000 and everything after it with it."""
    spec = fixtures_runs.RunSpec(layers=8, steps=2058, taints=(fixtures_runs.Taint(2000, "model.layers.3"),))
    return compare(*fixtures_runs.write_pair(str(tmp_path_factory.mktemp("long")), "long", spec))


def test_the_timeline_of_a_long_pair_is_a_small_figure_of_worst_status_bins(long_pair):
    fig = long_pair.timeline()
    ev = long_pair.events()
    assert ev.height == 39_102
    markers = sum(len(t.x) for t in fig.data if t.name != "pivot")
    assert markers <= figures.MAX_POINTS, markers
    size = len(fig.to_html(include_plotlyjs=False, full_html=False))
    assert size < 500_000, f"{size:,} bytes of figure (plotly.js apart; it was 1.6 MB before binning to this size)"
    width = int(re.search(r"bins of (\d+) rows", fig.layout.xaxis.title.text).group(1))
    y_a = lane(fig, "rank 0 · A (reference)")
    want = {r // width for r in ev.filter(pl.col("status") == "diverged")["row"].to_list()}
    assert {int(x) // width for x, y in points(fig, "diverged") if y == y_a} == want
    texts = [t for tr in fig.data if tr.name != "pivot" for t in tr.hovertext]
    assert sum(int(n) for t in texts for n in re.findall(r"(\d+) identical", t)) == 2 * ev.filter(
        pl.col("status") == "identical").height, "every row counted once on each lane"
    assert any("rows 38000–38019 · steps 2000–2001" in t for t in texts), "a bin says the steps it spans"


def test_timeline_of_identical_runs(identical_runs):
    fig = identical_runs.timeline()
    assert not points(fig, "pivot")
    assert [t.name for t in fig.data] == ["identical"]
    (band,) = fig.layout.shapes
    assert band.x1 == identical_runs.events()["row"].max() + 0.5
    assert fig.layout.title.text.startswith("Run A vs run B: identical")


# ---------------------------------------------------------------------------------------------
# Propagation graph


@pytest.mark.slow
def test_propagation_figure_lays_nodes_out_by_step_and_phase(forward_bitflip):
    fig = forward_bitflip.propagation()
    graph = forward_bitflip.propagation_graph()
    nodes = {n["id"]: n for n in graph["nodes"]}
    drawn = {}
    for phase, colour in figures.PHASE_COLOURS.items():
        for t in traces(fig, phase):
            assert t.marker.color == colour
            for x, y, text in zip(t.x, t.y, t.hovertext):
                drawn[(x, y)] = text
    assert len(drawn) == len(nodes), "one marker per node, none on top of another"
    by_x = {}
    for n in nodes.values():
        (x, y), = [(x, y) for (x, y), text in drawn.items()
                   if f"<b>{n['boundary']}</b>" in text and f"{n['phase']} {n['kind']}" in text]
        by_x.setdefault(x, set()).add(figures._column(n))
    assert all(len(cols) == 1 for cols in by_x.values()), "a column holds one (step, phase)"
    order = [next(iter(by_x[x])) for x in sorted(by_x)]
    assert order == sorted(order), "columns run left to right by first step, then phase"
    (pivot,) = [n for n in nodes.values() if n["is_pivot"]]
    ring = points(fig, "pivot")
    assert len(ring) == 1 and f"<b>{pivot['boundary']}</b>" in drawn[ring[0]]
    assert any(a.text == f"PIVOT: {pivot['boundary']}" for a in fig.layout.annotations)


@pytest.mark.slow
def test_propagation_edges_are_lines_with_hover(forward_bitflip):
    fig = forward_bitflip.propagation()
    edges = forward_bitflip.propagation_graph()["edges"]
    (hover,) = [t for t in fig.data if t.name == "edge (hover)"]
    assert len(hover.x) == sum(e["kind"] != "nesting" for e in edges), "nesting edges start hidden"
    for kind, n in {e["kind"]: sum(1 for f in edges if f["kind"] == e["kind"]) for e in edges}.items():
        (line,) = traces(fig, f"{kind} edge")
        assert line.mode == "lines" and len(line.x) == 3 * n, kind
        assert line.visible == ("legendonly" if kind == "nesting" else True), kind
    first = next(e for e in edges if e["kind"] != "nesting")
    pairs = f"{first['count']} divergent event pair{'s' if first['count'] != 1 else ''}"
    assert any(f"{first['kind']} · {pairs}" in text for text in hover.hovertext)


class _Graph:
    """What propagation_figure reads of a comparison: its graph and first divergence."""

    def __init__(self, nodes, edges, first=None):
        self.graph, self.first_divergence = {"nodes": nodes, "edges": edges}, first

    def propagation_graph(self):
        return self.graph


def _wide_graph() -> _Graph:
    """395 nodes over 3 steps and 4 phases, as a real model's graph: per step 52 forward
    blocks in a dataflow chain nested in the root, every other one's backward, gradient and optimizer step;
    the pivot (an embedding) feeds the first block, a rotary embedding feeds 20 blocks of step 1 (the
    widest fan-out); the blamed module is block 7."""
    nodes, edges, seq = [], [], 0

    def node(step, phase, kind, boundary, pivot=False):
        nonlocal seq
        seq += 1
        nodes.append({"id": f"r0:{phase}:{kind}:{boundary}", "rank": 0, "phase": phase, "kind": kind,
                      "boundary": boundary, "module_type": "Linear", "step": step, "first_step": step,
                      "count": 1 + seq % 5, "a_seq": seq, "is_pivot": pivot})
        return nodes[-1]["id"]

    def edge(a, b, kind):
        edges.append({"source": a, "target": b, "kind": kind, "count": 2, "first_step": 1})

    embed = node(1, "forward", "module", "model.embed", pivot=True)
    rope = node(1, "forward", "module", "s1.model.rope")
    for step in (1, 2, 3):
        root = node(step, "forward", "module", f"s{step}.model")
        blocks = [node(step, "forward", "module", f"s{step}.model.blocks.{i}") for i in range(52)]
        for a, b in zip(blocks, blocks[1:]):
            edge(a, b, "dataflow")
        for b in blocks:
            edge(b, root, "nesting")
        for i, b in enumerate(blocks[::2]):
            back = node(step, "backward", "module", f"s{step}.model.blocks.{2 * i}")
            grad = node(step, "backward", "grad", f"s{step}.model.blocks.{2 * i}.weight")
            opt = node(step, "optimizer", "step", f"s{step}.model.blocks.{2 * i}.weight")
            edge(b, back, "activation")
            edge(back, grad, "weight-grad")
            edge(grad, opt, "update")
        if step == 1:
            edge(embed, blocks[0], "dataflow")
            for b in blocks[20:40]:
                edge(rope, b, "dataflow")
    first = {"rank": 0, "boundary": "model.embed", "blame_window": {"module": "s1.model.blocks.7"}}
    return _Graph(nodes, edges, first)


def test_the_propagation_figure_is_layered_by_step_and_phase_at_hundreds_of_nodes():
    g = _wide_graph()
    fig = figures.propagation_figure(g)
    nodes = {n["id"]: n for n in g.graph["nodes"]}
    assert len(nodes) == 395
    at = {}  # (x, y) -> node, read back from the hover text of the node traces
    for t in fig.data:
        if t.name in figures.PHASE_COLOURS:
            for x, y, text in zip(t.x, t.y, t.hovertext):
                (n,) = [n for n in nodes.values() if text.startswith(f"<b>{n['boundary']}</b>")
                        and f"{n['phase']} {n['kind']}" in text]
                at[(x, y)] = n
    assert len(at) == len(nodes), "one marker per node, none on top of another"
    columns = {}
    for (x, y), n in at.items():
        columns.setdefault(figures._column(n), []).append((x, y))
    spans = sorted((min(x for x, _ in xy), max(x for x, _ in xy), c) for c, xy in columns.items())
    assert [c for *_, c in spans] == sorted(columns), "columns left to right by step, then phase"
    assert all(hi < nxt for (_, hi, _), (nxt, _, _) in zip(spans, spans[1:])), "columns do not overlap"
    for c, xy in columns.items():
        for x in {x for x, _ in xy}:
            assert sum(1 for x2, _ in xy if x2 == x) <= figures.MAX_COLUMN_ROWS, "a long column wraps"
    # labels: the pivot (its own annotation), the blamed module, the widest fan-out; not all 400
    labelled = {t for tr in fig.data if tr.name in figures.PHASE_COLOURS and tr.text for t in tr.text if t}
    assert labelled == {"s1.model.rope", "s1.model.blocks.7"}, "a chain's blocks (2 targets each) are no hubs"
    assert [a.text for a in fig.layout.annotations if a.text.startswith("PIVOT")] == ["PIVOT: model.embed"]
    # nesting starts hidden; the legend is under the plot, the title over it
    (nesting,) = traces(fig, "nesting edge")
    assert nesting.visible == "legendonly"
    assert fig.layout.legend.yanchor == "top" and fig.layout.legend.y <= 0
    assert fig.layout.title.yanchor == "top" and fig.layout.margin.t >= 50
    assert fig.layout.height <= 160 + 24 * (figures.MAX_COLUMN_ROWS + 3), "one band of at most 40 rows"


def test_the_propagation_figure_of_a_398_node_chain_wraps_and_labels_the_pivot(tmp_path):
    spec = fixtures_runs.RunSpec(layers=400, steps=2, taints=(fixtures_runs.Taint(0, "model.layers.3"),))
    c = compare(*fixtures_runs.write_pair(str(tmp_path), "chain", spec))
    fig = c.propagation()
    xs = [x for t in fig.data if t.name == "forward" for x in t.x]
    assert len(xs) == len(c.propagation_graph()["nodes"]) == 398
    assert len(set(xs)) == 10 and max(xs.count(x) for x in set(xs)) == figures.MAX_COLUMN_ROWS
    assert "PIVOT: model.layers.3" in [a.text for a in fig.layout.annotations], "the pivot is labelled"
    assert len(fig.to_html(include_plotlyjs=False, full_html=False)) < 400_000


def test_propagation_of_identical_runs_says_so(identical_runs):
    fig = identical_runs.propagation()
    assert not fig.data
    assert fig.layout.annotations[0].text == "no divergence: nothing propagates"


# ---------------------------------------------------------------------------------------------
# Summary


@pytest.mark.slow
def test_summary_names_the_verdict_pivot_blame_and_alignment(forward_bitflip):
    text = forward_bitflip._repr_html_()
    fd = forward_bitflip.first_divergence
    al = forward_bitflip.alignment_summary()
    assert '<span class="diverged">diverged</span>' in text
    assert f"<code>{fd['boundary']}</code>" in text and f"step {fd['step']}" in text
    assert f"{fd['blame']} ({fd['fault_class']})" in text
    assert f"identical prefix {al['identical_prefix']}" in text and f"{al['matched']} matched" in text
    assert "rules fired</th><td>none" in text


def test_summary_escapes_what_it_shows(tmp_path):
    hostile = "<script>alert(1)</script>"
    a = fixtures_runs.write_run(str(tmp_path / "a"), fixtures_runs.RunSpec(layers=2, steps=2))
    b = fixtures_runs.write_run(str(tmp_path / "b"), fixtures_runs.RunSpec(
        layers=2, steps=2, taints=(fixtures_runs.Taint(1, "model.layers.1"),),
        extra_manifest={"versions": {"torch": hostile}}))
    text = compare(a, b)._repr_html_()
    assert "<script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "versions.torch" in text


def test_summary_of_identical_runs(identical_runs):
    text = identical_runs._repr_html_()
    assert '<span class="identical">identical</span>' in text
    assert "pivot" not in text
