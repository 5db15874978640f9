// Two more ways to draw a window of events (timeline.js draws squares by default):
// - slices, Perfetto style: each event a bar, nested by module depth inside its lane (a parent
//   under its children: by sequence it spans from its first child to itself, since events are
//   recorded as calls complete; by time, from its start to its end), named where the name fits;
// - merged: one lane per phase for both runs, where a matched pair that agrees draws once, small,
//   and only divergent pairs and gaps (an event on one side only) stand out.
// Both return plotly traces whose points carry customdata [side, seq, pos], as the squares do,
// so a click selects the event the same way. Knows nothing of requests or of the page.

import { plotText as esc, rowStatus, STATUS, STATUS_OF_ROW, UNKNOWN_STATUS } from "./format.js";

const MAX_DEPTHS = 5; // rows of nesting drawn in a lane; deeper calls share the last row
const look = (e) => STATUS[STATUS_OF_ROW[e.status] || "identical"] || UNKNOWN_STATUS;

// "blocks.5.mlp" of "model.transformer.blocks.5.mlp": the last parts that fit 16 characters
export function shortName(boundary, room = 16) {
  const parts = String(boundary ?? "").split(".");
  let out = parts.pop() || "";
  while (parts.length && out.length + parts[parts.length - 1].length + 1 <= room) out = `${parts.pop()}.${out}`;
  return out.length > room ? `${out.slice(0, room - 1)}…` : out;
}

function hoverOf(e, side, seq) {
  const who = side ? `<b>${side.toUpperCase()}</b> seq ${esc(seq)}` : `A seq ${esc(e.a_seq ?? "—")} · B seq ${esc(e.b_seq ?? "—")}`;
  return `${who} · step ${esc(e.step)}<br>${esc(e.phase)} <b>${esc(e.boundary)}</b> (${esc(e.module_type)})<br>${esc(rowStatus(e))}${e.is_pivot ? " · <b>pivot</b>" : ""}`;
}

// [x0, x1) of each event of one lane (events in position order), nested by depth
function spans(events, side, axis) {
  const out = new Map();
  if (axis === "time") {
    for (const e of events) {
      const x0 = e[`${side}_x`];
      const dur = e[`${side}_dur`];
      out.set(e, [x0, x0 + (dur != null && dur > 0 ? dur : 1e-9)]);
    }
    return out;
  }
  const open = []; // calls completed and not yet claimed by a parent: {depth, start}
  for (const e of events) {
    const depth = e.depth ?? 0;
    let start = e.pos;
    while (open.length && open[open.length - 1].depth > depth) start = Math.min(start, open.pop().start);
    open.push({ depth, start });
    out.set(e, [start, e.pos + 1]);
  }
  return out;
}

const CHAR_PX = 5.8; // a character of the 10 px names, about

// pxPerX: screen pixels per unit of x, to name only the slices a name fits in
export function sliceTraces(d, geo, axis, pxPerX) {
  const deepest = Math.min(MAX_DEPTHS - 1, Math.max(0, ...d.events.map((e) => e.depth ?? 0)));
  const rowH = 0.84 / (deepest + 1);
  const t = { y: [], base: [], x: [], color: [], hover: [], custom: [], line: [] };
  const names = { x: [], y: [], text: [] };
  for (const side of ["a", "b"]) {
    for (const phase of geo.phases) {
      const lane = d.events.filter((e) => e.phase === phase && e[`${side}_seq`] != null && (axis === "seq" || e[`${side}_x`] != null));
      const span = spans(lane, side, axis);
      for (const e of lane) {
        const [x0, x1] = span.get(e);
        const depth = Math.min(e.depth ?? 0, deepest);
        t.y.push(geo.y[side][phase] - 0.42 + rowH * (depth + 0.5));
        t.base.push(x0);
        t.x.push(x1 - x0);
        t.color.push(look(e).color);
        t.line.push(e.is_pivot ? 2 : 0.5);
        const left = Math.max(x0, d.start);
        const room = (Math.min(x1, d.end) - left) * pxPerX - 8;
        const name = shortName(e.boundary, Math.min(24, Math.floor(room / CHAR_PX)));
        if (room >= 3 * CHAR_PX && name.length * CHAR_PX <= room) {
          names.x.push(left + 4 / pxPerX);
          names.y.push(t.y[t.y.length - 1]);
          names.text.push(esc(name));
        }
        t.hover.push(hoverOf(e, side, e[`${side}_seq`]));
        t.custom.push([side, e[`${side}_seq`], e.pos]);
      }
    }
  }
  return [{
    type: "bar", orientation: "h", name: "slices", y: t.y, base: t.base, x: t.x, width: rowH * 0.9,
    marker: { color: t.color, line: { width: t.line, color: "rgba(31,41,51,0.45)" } },
    hovertext: t.hover, hoverinfo: "text", customdata: t.custom,
  }, {
    type: "scatter", mode: "text", name: "slice names", x: names.x, y: names.y, text: names.text,
    textposition: "middle right", textfont: { size: 10, color: "#1f2933" }, hoverinfo: "skip", cliponaxis: true,
  }];
}

export function mergedTraces(d, geo, axis, named) {
  const kinds = {
    same: { x: [], y: [], custom: [], hover: [], color: [], text: [] },
    differs: { x: [], y: [], custom: [], hover: [], color: [], text: [] },
    a_only: { x: [], y: [], custom: [], hover: [], color: [], text: [] },
    b_only: { x: [], y: [], custom: [], hover: [], color: [], text: [] },
  };
  for (const e of d.events) {
    const x = axis === "seq" ? e.pos + 0.5 : e.a_x ?? e.b_x;
    if (x == null) continue;
    const kind = e.a_seq == null ? "b_only" : e.b_seq == null ? "a_only" : e.status === "diverged" ? "differs" : "same";
    const k = kinds[kind];
    k.place = k.place || [];
    k.place.push(e.pos % 2 ? "bottom center" : "top center"); // neighbours' names alternate: twice the room
    const side = e.a_seq != null ? "a" : "b";
    k.x.push(x);
    k.y.push(geo.y.a[e.phase]);
    k.custom.push([side, e[`${side}_seq`], e.pos]);
    k.hover.push(hoverOf(e, null) + (kind.endsWith("only") ? `<br>only in run ${kind[0].toUpperCase()} (gap)` : ""));
    k.color.push(look(e).color);
    k.text.push(esc(shortName(e.boundary)));
  }
  const trace = (k, name, marker, stand) => ({
    type: "scatter", mode: named && stand ? "markers+text" : "markers", name, x: k.x, y: k.y, customdata: k.custom,
    hovertext: k.hover, hoverinfo: "text", text: named && stand ? k.text : undefined, textposition: k.place || "top center",
    textfont: { size: 9, color: "#3e4c59" }, cliponaxis: false, marker: { color: k.color, ...marker },
  });
  return [
    trace(kinds.same, "A = B", { symbol: "square", size: 8, line: { width: 0.5, color: "rgba(31,41,51,0.3)" } }, false),
    trace(kinds.differs, "A ≠ B", { symbol: "square", size: 14, line: { width: 1.5, color: "#7a1f1a" } }, true),
    trace(kinds.a_only, "A only", { symbol: "triangle-up", size: 14, line: { width: 1, color: "#8a4a0c" } }, true),
    trace(kinds.b_only, "B only", { symbol: "triangle-down", size: 14, line: { width: 1, color: "#8a4a0c" } }, true),
  ];
}
