"""Figures for the notebook: the aligned timeline, the propagation graph and the summary table.

Each is a thin drawing over what `Comparison` already computed: `timeline` reads
`Comparison.events()`, `propagation_figure` reads `Comparison.propagation_graph()` and
`summary_html` reads the report fields of `Comparison.to_dict()`. Nothing here aligns, compares
or blames; a figure that needs a number the comparison does not have is a change to compare.py.
"""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go
import polars as pl

import numpy as np

from bitguard.backend.pivot import phase_words
from bitguard.backend.statuses import CODE_OF_EVENT, GAP, STATUS_CODES, bin_counts, worst
from bitguard.backend.timeline_steps import StepIndex

MAX_POINTS = 4_000  # above this many markers the timeline aggregates rows into bins (a 39,100-event pair: ~340 KB)
STATUS_COLOURS = {  # also the legend order
    "identical": "#9ccfa4",
    "benign": "#7fb1e0",
    "follows": "#a9c4de",
    "unobserved": "#bdbdbd",
    "diverged": "#d62728",
    "only_a": "#ff9f1c",
    "only_b": "#9467bd",
}
STATUS_LABELS = {"identical": "identical", "benign": "benign (rule)", "follows": "follows an accepted difference",
                 "unobserved": "not observed (cannot certify)", "diverged": "diverged",
                 "only_a": "only in A", "only_b": "only in B"}
_BIN_LABELS = {**STATUS_LABELS, "gap": "gap (one side only)"}
PHASE_COLOURS = {"data": "#7f7f7f", "forward": "#1f77b4", "backward": "#ff7f0e", "optimizer": "#2ca02c"}
EDGE_COLOURS = {"dataflow": "#555555", "nesting": "#9e9e9e", "activation": "#1f77b4", "weight-grad": "#ff7f0e",
                "update": "#2ca02c", "weights": "#8c564b", "final": "#bcbd22"}
PIVOT_COLOUR = "#d62728"
_SCATTERGL_ABOVE = 5_000  # markers; WebGL keeps big figures responsive


def _scatter(n: int):
    return go.Scattergl if n > _SCATTERGL_ABOVE else go.Scatter


# -- timeline ------------------------------------------------------------------------------------

def timeline(comparison, rank: int | None = None) -> go.Figure:
    """Run A above run B for each rank, one tick per aligned event (x = row), coloured by status.

    The identical prefix is shaded, a gap (an event the other run has) is an open cross on the
    run that lacks it, the pivot is a star with its annotation. Above `MAX_POINTS` markers rows
    are binned and each bin is drawn in its worst status, its hover giving the counts.
    """
    ev = comparison.events(rank)
    fig = go.Figure()
    if ev.is_empty():
        return _empty(fig, "no events recorded" + ("" if rank is None else f" on rank {rank}"))
    ranks = sorted(ev["rank"].unique().to_list())
    lane_y = {(r, side): -(3 * i + (0 if side == "a" else 1)) for i, r in enumerate(ranks) for side in "ab"}
    width = _bin_width(ev, len(ranks))
    points = _binned(ev, lane_y, width) if width > 1 else _lane_points(ev, lane_y)
    n = points.height
    for status, colour in STATUS_COLOURS.items():
        sub = points.filter(pl.col("status") == status)
        if sub.height:
            fig.add_trace(_scatter(n)(
                x=sub["x"].to_list(), y=sub["y"].to_list(), mode="markers", name=STATUS_LABELS[status],
                marker={"symbol": "line-ns-open", "size": 16, "color": colour, "line": {"width": 2}},
                hovertext=sub["hover"].to_list(), hoverinfo="text"))
    gaps = points.filter(pl.col("status") == "gap")
    if gaps.height:
        fig.add_trace(_scatter(n)(
            x=gaps["x"].to_list(), y=gaps["y"].to_list(), mode="markers", name="gap (missing on this run)",
            marker={"symbol": "x-thin-open", "size": 9, "color": "#444444", "line": {"width": 1.5}},
            hovertext=gaps["hover"].to_list(), hoverinfo="text"))
    for r in ranks:
        _prefix_band(fig, ev.filter(pl.col("rank") == r), lane_y[(r, "a")], lane_y[(r, "b")])
    _pivots(fig, ev, lane_y, comparison.first_divergence, _scatter(n))
    tickvals = [lane_y[(r, s)] for r in ranks for s in "ab"]
    ticktext = [f"rank {r} · {'A (reference)' if s == 'a' else 'B (suspect)'}" for r in ranks for s in "ab"]
    fd = comparison.first_divergence
    if fd is not None:
        title = f"diverged at {fd['phase']} {fd['boundary']}, step {fd['step']}, rank {fd['rank']} ({fd['blame']})"
    elif comparison.verdict == "inconclusive":
        title = "inconclusive: what was compared matched, the rest cannot be certified"
    else:
        title = "identical: every aligned event matched"
    binned = f" (bins of {width} rows)" if width > 1 else ""
    fig.update_layout(
        title={"text": f"Run A vs run B: {html.escape(title)}"}, template="plotly_white",
        height=150 + 100 * len(ranks), margin={"l": 150, "r": 30, "t": 90, "b": 50},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
        xaxis={"title": {"text": f"aligned event (row){binned}"}, "zeroline": False},
        yaxis={"tickvals": tickvals, "ticktext": ticktext, "zeroline": False, "showgrid": False,
               "range": [min(tickvals) - 0.8, max(tickvals) + 0.8]},
        hovermode="closest")
    return fig


def _lane_points(ev: pl.DataFrame, lane_y: dict) -> pl.DataFrame:
    """One marker per (row, run): the event's status where the run has it, 'gap' where it does not."""
    frames = []
    for side in "ab":
        seq = f"{side}_seq"
        y = pl.col("rank").replace_strict({r: y for (r, s), y in lane_y.items() if s == side}, return_dtype=pl.Int64)
        frames.append(ev.select(
            "rank", pl.col("row").cast(pl.Int64).alias("x"), y.alias("y"),
            pl.when(pl.col(seq).is_null()).then(pl.lit("gap")).otherwise(pl.col("status")).alias("status"),
            pl.format("{} · {} {} ({})<br>step {} · {} · seq {}{}",
                      pl.when(pl.col(seq).is_null()).then(pl.lit(f"missing in {side.upper()}"))
                      .otherwise(pl.col("status")),
                      _escaped("phase"), _escaped("boundary"), _escaped("kind"), pl.col("step"),
                      _escaped("module_type").fill_null(""), pl.col(seq).cast(pl.String).fill_null("–"),
                      pl.when(pl.col("rule_id").is_not_null()).then(pl.format("<br>rule {}", _escaped("rule_id")))
                      .otherwise(pl.lit(""))).alias("hover"),
            pl.col("step")))
    return pl.concat(frames)


def _escaped(column: str) -> pl.Expr:
    """The column with &, < and > escaped: plotly reads hover text as HTML."""
    return pl.col(column).cast(pl.String).str.replace_all("&", "&amp;", literal=True).str.replace_all(
        "<", "&lt;", literal=True).str.replace_all(">", "&gt;", literal=True)


def _bin_width(ev: pl.DataFrame, n_ranks: int) -> int:
    if 2 * ev.height <= MAX_POINTS:
        return 1
    per_lane = MAX_POINTS // (2 * n_ranks)
    longest = ev.group_by("rank").len()["len"].max()
    return max(1, math.ceil(longest / per_lane))


def _binned(ev: pl.DataFrame, lane_y: dict, width: int) -> pl.DataFrame:
    """Each lane's rows in bins of `width`, a bin drawn in the worst status it holds as the server's
    timeline windows do (statuses.py); a row a run lacks counts as a gap on that run's lane. A gap
    bin is 'only in A/B' where the lane holds a one-sided event, else a gap (missing on this run)."""
    frames = []
    for (rank, side), y in lane_y.items():
        sub = ev.filter(pl.col("rank") == rank).sort("row")
        rows = sub["row"].cast(pl.Int64).to_numpy()
        event_code = sub["status"].replace_strict(CODE_OF_EVENT, return_dtype=pl.Int8).to_numpy()
        has = sub[f"{side}_seq"].is_not_null().to_numpy()
        code = np.where(has, event_code, GAP)
        b = rows // width
        n_bins = int(b.max()) + 1
        counts = bin_counts(b, code, n_bins)
        one_sided = np.bincount(b[has & (event_code == GAP)], minlength=n_bins)
        lo, hi = StepIndex.from_steps(sub["step"].cast(pl.Float64).to_numpy()).bin_ranges(
            n_bins, [(np.arange(rows.size), b)])
        first, last = np.full(n_bins, rows.max(), np.int64), np.zeros(n_bins, np.int64)
        np.minimum.at(first, b, rows)
        np.maximum.at(last, b, rows)
        shown = worst(counts)
        keep = np.flatnonzero(counts.sum(axis=1))
        status = [f"only_{side}" if c == GAP and one_sided[k] else ("gap" if c == GAP else STATUS_CODES[c])
                  for k, c in zip(keep.tolist(), shown[keep].tolist())]
        hover = [f"rows {first[k]}–{last[k]} · steps {lo[k]}–{hi[k]}<br>" + ", ".join(
            f"{counts[k, c]} {_BIN_LABELS[STATUS_CODES[c]]}" for c in range(1, len(STATUS_CODES)) if counts[k, c])
            for k in keep.tolist()]
        frames.append(pl.DataFrame({"rank": [rank] * keep.size, "x": ((first[keep] + last[keep]) / 2).tolist(),
                                    "y": [y] * keep.size, "status": status, "hover": hover},
                                   schema={"rank": pl.Int64, "x": pl.Float64, "y": pl.Int64, "status": pl.String,
                                           "hover": pl.String}))
    return pl.concat(frames)


def _prefix_band(fig: go.Figure, ev: pl.DataFrame, y_a: int, y_b: int) -> None:
    prefix = ev.filter(pl.col("in_prefix"))
    if prefix.is_empty():
        return
    end = int(prefix["row"].max()) + 0.5
    fig.add_shape(type="rect", x0=-0.5, x1=end, y0=y_b - 0.45, y1=y_a + 0.45, fillcolor="#2ca02c",
                  opacity=0.08, line={"width": 0}, layer="below")
    fig.add_annotation(x=-0.5, y=y_a + 0.45, xanchor="left", yanchor="bottom", showarrow=False,
                       text=f"identical prefix: {prefix.height} events", font={"size": 10, "color": "#2c7a3a"})


def _pivots(fig: go.Figure, ev: pl.DataFrame, lane_y: dict, first: dict | None, trace) -> None:
    """Stars on the pivot rows (`trace`: the markers' own type, or WebGL would draw over them)."""
    pivots = ev.filter(pl.col("is_pivot"))
    if pivots.is_empty():
        return
    xs, ys, text = [], [], []
    for p in pivots.iter_rows(named=True):
        for side in "ab":
            xs.append(p["row"])
            ys.append(lane_y[(p["rank"], side)])
            text.append(f"PIVOT {html.escape(p['boundary'])}<br>{html.escape(str(p['phase']))} step {p['step']} · rank {p['rank']}")
        is_first = first is not None and first["rank"] == p["rank"]
        if is_first or pivots.height <= 8:
            label = f"PIVOT: {html.escape(p['boundary'])}<br>{html.escape(str(p['phase']))} · step {p['step']}"
            if is_first:
                label += f" · {first['blame']}"
            fig.add_annotation(x=p["row"], y=lane_y[(p["rank"], "a")], ax=40, ay=-45, text=label,
                               showarrow=True, arrowhead=2, arrowcolor=PIVOT_COLOUR, font={"color": PIVOT_COLOUR},
                               bgcolor="rgba(255,255,255,0.85)", bordercolor=PIVOT_COLOUR, align="left")
    fig.add_trace(trace(x=xs, y=ys, mode="markers", name="pivot", hovertext=text, hoverinfo="text",
                        marker={"symbol": "star", "size": 16, "color": PIVOT_COLOUR,
                                "line": {"width": 1, "color": "white"}}))


def _empty(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(text=html.escape(text), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 14})
    fig.update_layout(template="plotly_white", height=220, xaxis={"visible": False}, yaxis={"visible": False})
    return fig


# -- propagation graph ---------------------------------------------------------------------------

def _column(node: dict) -> tuple:
    """Where a node stands left to right: its first step, then the phase's place in a step."""
    place = {"data": 0, "forward": 1, "backward": 2, "optimizer": 4}.get(node["phase"], 5)
    if node["phase"] == "backward" and node["kind"] == "grad":
        place = 3
    return node["first_step"], place


MAX_COLUMN_ROWS = 40  # nodes stacked in one column; more wrap into further sub-columns beside it
TOP_FAN_OUT = 6  # besides the pivot and the blamed module, this many nodes of highest fan-out are labelled
LABEL_ALL_UP_TO = 40  # graphs of at most this many nodes have every node labelled
_PLACES = {0: "data", 1: "forward", 2: "backward", 3: "gradients", 4: "optimizer"}


def _layout(nodes: list[dict]) -> tuple[dict, dict, float, float]:
    """Layered positions: a column per (first step, phase) left to right, wrapped into sub-columns
    of MAX_COLUMN_ROWS nodes; within a column nodes top to bottom in the order they were first
    reached; each rank in its own band. Returns positions by node id, the header (x, y) of each
    column, the bottom of the last band and the x of the last sub-column."""
    columns = sorted({_column(n) for n in nodes})
    ranks = sorted({n["rank"] for n in nodes})
    members = {(r, c): [] for r in ranks for c in columns}
    for n in sorted(nodes, key=lambda n: n["a_seq"]):
        members[(n["rank"], _column(n))].append(n)
    widths = {c: max(1, *(math.ceil(len(members[(r, c)]) / MAX_COLUMN_ROWS) for r in ranks)) for c in columns}
    x0, left = {}, 0.0
    for c in columns:
        x0[c] = left
        left += widths[c] + 0.3  # a little air between columns, none between a column's sub-columns
    pos: dict[str, tuple[float, float]] = {}
    headers: dict[tuple, tuple[float, float]] = {}
    band_top = 0.0
    for r in ranks:
        tallest = max(min(len(members[(r, c)]), MAX_COLUMN_ROWS) for c in columns)
        for c in columns:
            group = members[(r, c)]
            for i, n in enumerate(group):
                sub, row = divmod(i, MAX_COLUMN_ROWS)
                rows_here = min(len(group) - sub * MAX_COLUMN_ROWS, MAX_COLUMN_ROWS)
                pos[n["id"]] = (x0[c] + sub, band_top - row - (tallest - rows_here) / 2)
            if group and c not in headers:
                headers[c] = (x0[c] + (widths[c] - 1) / 2, band_top)
        band_top -= tallest + 1.5
    return pos, headers, band_top, left - 1.3


def _important(nodes: list[dict], edges: list[dict], first: dict | None) -> set[str]:
    """The nodes worth a label: the pivot, the blamed module's, and the highest fan-outs (3 or more
    distinct targets over edges other than nesting)."""
    keep = {n["id"] for n in nodes if n["is_pivot"]}
    window = (first or {}).get("blame_window") or {}
    keep |= {n["id"] for n in nodes if window.get("module") and n["boundary"] == window["module"]
             and n["rank"] == first.get("rank")}
    fan: dict[str, set] = {}
    for e in edges:
        if e["kind"] != "nesting":
            fan.setdefault(e["source"], set()).add(e["target"])
    ranked = sorted(fan, key=lambda nid: (-len(fan[nid]), nid))
    keep |= {nid for nid in ranked[:TOP_FAN_OUT] if len(fan[nid]) >= 3}  # a chain's 2 (next, own backward) is no hub
    return keep


def propagation_figure(comparison) -> go.Figure:
    """The propagation graph left to right, layered: a column per (first step, phase), nodes by
    phase colour, readable at hundreds of nodes.

    Columns of more than MAX_COLUMN_ROWS nodes wrap into sub-columns; each rank has its own band.
    The pivot, the blamed module and the nodes of highest fan-out are labelled (every node when
    there are few); every node's full name is on hover. Edges are lines (with arrows up to 300
    edges), hover on an edge's midpoint; nesting edges (a call inside the call it belongs to, not
    data) start hidden, a click on the legend shows them. The legend sits under the plot, clear of
    the title.
    """
    graph = comparison.propagation_graph()
    fig = go.Figure()
    nodes, edges = graph["nodes"], graph["edges"]
    if not nodes:
        return _empty(fig, "no divergence: nothing propagates")
    pos, headers, bottom, right = _layout(nodes)
    labelled = {n["id"] for n in nodes} if len(nodes) <= LABEL_ALL_UP_TO else _important(
        nodes, edges, comparison.first_divergence)
    arrows = _edges(fig, edges, pos, {n["id"]: n for n in nodes})
    for phase, colour in PHASE_COLOURS.items():
        members = [n for n in nodes if n["phase"] == phase]
        if members:
            fig.add_trace(_node_trace(members, pos, phase, colour, labelled))
    other = [n for n in nodes if n["phase"] not in PHASE_COLOURS]
    if other:
        fig.add_trace(_node_trace(other, pos, "other", "#bcbd22", labelled))
    pivot = [n for n in nodes if n["is_pivot"]]
    for n in pivot:
        x, y = pos[n["id"]]
        arrows.append({"x": x, "y": y, "ax": 50, "ay": -12, "xanchor": "left",
                       "text": f"PIVOT: {html.escape(n['boundary'])}",
                       "showarrow": True, "arrowhead": 2, "arrowcolor": PIVOT_COLOUR, "font": {"color": PIVOT_COLOUR},
                       "bgcolor": "rgba(255,255,255,0.85)"})
    if pivot:
        fig.add_trace(go.Scatter(
            x=[pos[n["id"]][0] for n in pivot], y=[pos[n["id"]][1] for n in pivot], mode="markers", name="pivot",
            hoverinfo="skip", marker={"symbol": "circle-open", "size": 26, "color": PIVOT_COLOUR, "line": {"width": 3}}))
    for (step, place), (x, top) in headers.items():
        arrows.append({"x": x, "y": top + 1.5, "text": f"step {step}<br>{_PLACES.get(place, 'other')}",
                       "showarrow": False, "font": {"size": 10, "color": "#555555"}})
    rows = int(1.5 - bottom)
    fig.update_layout(
        annotations=arrows,
        title={"text": f"Propagation from the pivot: {len(nodes)} module/phase nodes, {len(edges)} edges",
               "y": 0.99, "yanchor": "top"},
        template="plotly_white", height=max(360, 160 + 24 * rows), width=max(900, 150 * right) if right > 6 else None,
        margin={"l": 30, "r": 200, "t": 60, "b": 60}, hovermode="closest",
        legend={"orientation": "h", "y": -0.01, "yanchor": "top", "x": 0},
        xaxis={"visible": False, "range": [-0.6, right + 0.6]},
        yaxis={"visible": False, "range": [bottom + 0.5, 2.3]})
    return fig


def _node_trace(members: list[dict], pos: dict, name: str, colour: str, labelled: set[str]) -> go.Scatter:
    hover = [f"<b>{html.escape(n['boundary'])}</b> ({html.escape(n['module_type'] or '')})<br>"
             f"{html.escape(str(n['phase']))} {html.escape(str(n['kind']))} · rank {n['rank']}<br>first reached at step {n['first_step']}"
             f" · {n['count']} divergent event{'s' if n['count'] != 1 else ''}" for n in members]
    text = [html.escape(n["boundary"]) if n["id"] in labelled and not n["is_pivot"] else "" for n in members]
    return go.Scatter(
        x=[pos[n["id"]][0] for n in members], y=[pos[n["id"]][1] for n in members],
        mode="markers+text" if any(text) else "markers", name=name, hovertext=hover, hoverinfo="text",
        text=text if any(text) else None, textposition="middle right", textfont={"size": 9},
        marker={"size": [9 + 3 * math.log2(1 + n["count"]) for n in members], "color": colour,
                "line": {"width": 1, "color": "white"}})


def _edges(fig: go.Figure, edges: list[dict], pos: dict, nodes: dict) -> list[dict]:
    """Add the edge traces; return the arrows as annotation dicts (added in one go: plotly
    validates each `add_annotation` against all the others, quadratic in their number)."""
    mids_x, mids_y, mids_text = [], [], []
    arrows: list[dict] = []
    for kind, colour in {**EDGE_COLOURS, **{e["kind"]: "#777777" for e in edges if e["kind"] not in EDGE_COLOURS}}.items():
        xs, ys = [], []
        for e in edges:
            if e["kind"] != kind or e["source"] not in pos or e["target"] not in pos:
                continue
            (x0, y0), (x1, y1) = pos[e["source"]], pos[e["target"]]
            xs += [x0, x1, None]
            ys += [y0, y1, None]
            if kind == "nesting":
                continue  # hidden at first: neither a hover point nor an arrow
            mids_x.append((x0 + x1) / 2)
            mids_y.append((y0 + y1) / 2)
            src, dst = nodes[e["source"]], nodes[e["target"]]
            times = f"{e['count']} divergent event pair{'s' if e['count'] != 1 else ''}"
            mids_text.append(f"{html.escape(src['boundary'])} ({html.escape(str(src['phase']))}) → "
                             f"{html.escape(dst['boundary'])} ({html.escape(str(dst['phase']))})<br>{kind} · {times}"
                             f" · first at step {e['first_step']}")
            if len(edges) <= 300:
                arrows.append({"x": x1, "y": y1, "ax": x0, "ay": y0, "xref": "x", "yref": "y", "axref": "x",
                               "ayref": "y", "text": "", "showarrow": True, "arrowhead": 2, "arrowsize": 1,
                               "arrowwidth": 1, "arrowcolor": colour, "standoff": 6, "opacity": 0.6})
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"{kind} edge", hoverinfo="skip",
                                     line={"width": 1, "color": colour}, opacity=0.6,
                                     visible="legendonly" if kind == "nesting" else True))
    if mids_x:
        fig.add_trace(go.Scatter(x=mids_x, y=mids_y, mode="markers", name="edge (hover)", showlegend=False,
                                 hovertext=mids_text, hoverinfo="text",
                                 marker={"size": 6, "color": "rgba(0,0,0,0.15)"}))
    return arrows


# -- summary -------------------------------------------------------------------------------------

_CSS = ("<style>.bitguard-summary table{border-collapse:collapse;font-size:13px}"
        ".bitguard-summary th{text-align:left;vertical-align:top;padding:3px 12px 3px 0;white-space:nowrap}"
        ".bitguard-summary td{padding:3px 0;vertical-align:top}"
        ".bitguard-summary .diverged{color:#d62728;font-weight:bold}"
        ".bitguard-summary .identical{color:#2c7a3a;font-weight:bold}"
        ".bitguard-summary table table td,.bitguard-summary table table th{padding:1px 10px 1px 0}</style>")


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def summary_html(comparison) -> str:
    """A compact table of the report: verdict, pivot and blame, alignment, rules, manifests."""
    d = comparison.to_dict()
    rows: list[tuple[str, str]] = []
    verdict = d["verdict"]
    rows.append(("verdict", f'<span class="{_e(verdict)}">{_e(verdict)}</span>'))
    rows.append(("runs", f"A {_e(d['run_a'])}<br>B {_e(d['run_b'])}"))
    if d["inconclusive"]:
        rows.append(("why inconclusive", "<br>".join(_e(r["message"]) for r in d["inconclusive"]["reasons"])))
    fd = d["first_divergence"]
    if fd is not None:
        rows.append(("pivot", f"<code>{_e(fd['boundary'])}</code> ({_e(fd['module_type'])}, call {_e(fd['call'])})"
                              f" · {_e(fd['phase'])} {_e(fd['kind'])} · step {_e(fd['step'])} · rank {_e(fd['rank'])}"))
        rows.append(("blame", f"{_e(fd['blame'])} ({_e(fd['fault_class'])})"))
        w = fd.get("blame_window")
        if w:
            text = f"<code>{_e(w.get('module'))}</code>" if w.get("module") else ""
            if w.get("excluding_children"):
                text += " minus children " + ", ".join(f"<code>{_e(c)}</code>" for c in w["excluding_children"])
            rows.append(("blame window", text + (f"<br>{_e(w.get('detail'))}" if w.get("detail") else "")))
        tensors = [t for t in fd["tensors"] if t["differs"]]
        if tensors:
            rows.append(("differing tensors", "<br>".join(
                f"{_e(t['role'])}[{_e(t['index'])}] {_e(t['dtype'])}{_e(list(t['shape'] or []))} "
                f"A <code>{_e(t['a']['xor'])}:{_e(t['a']['pos'])}</code> "
                f"B <code>{_e(t['b']['xor'])}:{_e(t['b']['pos'])}</code>" for t in tensors)))
        others = {r: p for r, p in d["pivots_per_rank"].items() if p and int(r) != fd["rank"]}
        if others:
            rows.append(("pivots on other ranks", "<br>".join(
                f"rank {_e(r)}: {_e(p['phase'])} <code>{_e(p['boundary'])}</code> step {_e(p['step'])} ({_e(p['blame'])})"
                for r, p in sorted(others.items(), key=lambda kv: int(kv[0])))))
    al = d["alignment"]
    rows.append(("alignment", f"A {al['events_a']} events, B {al['events_b']} events · {al['matched']} matched "
                              f"({al['reordered']} reordered) · gaps A {al['gaps_a']} / B {al['gaps_b']} "
                              f"({al['allowed_gaps']} allowed by rules) · identical prefix {al['identical_prefix']}"))
    if al["gaps_before_pivot"]:
        rows.append(("gaps before the pivot", "<br>".join(
            f"only in {_e(g['side'].upper())}: {_e(phase_words(g['phase'], g.get('kind') or ''))} "
            f"<code>{_e(g['boundary'])}</code> step {_e(g['step'])}"
            f" rank {_e(g['rank'])}" for g in al["gaps_before_pivot"][:10])
            + (f"<br>… {len(al['gaps_before_pivot']) - 10} more" if len(al["gaps_before_pivot"]) > 10 else "")))
    rows.append(("rules fired", ", ".join(f"<code>{_e(r['id'])}</code> ×{_e(r['count'])}" for r in d["rules_fired"])
                 or "none"))
    if d["manifest_diffs"]:
        inner = "".join(f"<tr><td><code>{_e(m['field'])}</code></td><td>A {_e(m['a'])}</td><td>B {_e(m['b'])}</td>"
                        f"<td>{_e(m['why'])}</td></tr>" for m in d["manifest_diffs"])
        rows.append(("manifest differences", f"<table>{inner}</table>"))
    else:
        rows.append(("manifest differences", "none"))
    if d["incomplete"]:
        rows.append(("incomplete", "<br>".join(f"run {_e(side.upper())}: {_e(why)}"
                                               for side, why in d["incomplete"].items())))
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<div class="bitguard-summary">{_CSS}<table>{body}</table></div>'
