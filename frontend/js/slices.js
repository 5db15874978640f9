// Two more ways to draw a window of events (lanes.js draws squares by default):
// - slices, Perfetto style: each event a bar, nested by module depth inside its lane (a parent
//   under its children: by sequence it spans from its first child to itself, since events are
//   recorded as calls complete; by time, from its start to its end), named where the name fits;
// - merged: one lane per phase for both runs, where a matched pair that agrees draws once, small,
//   and only divergent pairs and gaps (an event on one side only) stand out.
// Both return chart.js layers whose marks carry custom [side, seq, pos], as the squares do, so a
// click selects the event the same way; hover texts are lines of text. Knows nothing of requests
// or of the page.

import { rowStatus, STATUS, STATUS_OF_ROW, UNKNOWN_STATUS } from "./format.js";

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
  const who = side ? `${side.toUpperCase()} seq ${seq}` : `A seq ${e.a_seq ?? "—"} · B seq ${e.b_seq ?? "—"}`;
  return [`${who} · step ${e.step}`, `${e.phase} ${e.boundary} (${e.module_type})`, `${rowStatus(e)}${e.is_pivot ? " · pivot" : ""}`];
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
export function sliceLayers(d, geo, axis, pxPerX) {
  const deepest = Math.min(MAX_DEPTHS - 1, Math.max(0, ...d.events.map((e) => e.depth ?? 0)));
  const rowH = 0.84 / (deepest + 1);
  const half = (rowH * 0.9) / 2;
  const t = { kind: "rects", name: "slices", y: [], x0: [], x1: [], y0: [], y1: [], fill: [], hover: [], custom: [], lineWidth: [],
    stroke: "rgba(31,41,51,0.45)", least: 1 };
  const names = { kind: "texts", name: "slice names", x: [], y: [], text: [], size: 10, color: "#1f2933" };
  for (const side of ["a", "b"]) {
    for (const phase of geo.phases) {
      const lane = d.events.filter((e) => e.phase === phase && e[`${side}_seq`] != null && (axis === "seq" || e[`${side}_x`] != null));
      const span = spans(lane, side, axis);
      for (const e of lane) {
        const [x0, x1] = span.get(e);
        const depth = Math.min(e.depth ?? 0, deepest);
        const y = geo.y[side][phase] - 0.42 + rowH * (depth + 0.5);
        t.y.push(y);
        t.y0.push(y - half);
        t.y1.push(y + half);
        t.x0.push(x0);
        t.x1.push(x1);
        t.fill.push(look(e).color);
        t.lineWidth.push(e.is_pivot ? 2 : 0.5);
        const left = Math.max(x0, d.start);
        const room = (Math.min(x1, d.end) - left) * pxPerX - 8;
        const name = shortName(e.boundary, Math.min(24, Math.floor(room / CHAR_PX)));
        if (room >= 3 * CHAR_PX && name.length * CHAR_PX <= room) {
          names.x.push(left + 4 / pxPerX);
          names.y.push(y);
          names.text.push(name);
        }
        t.hover.push(hoverOf(e, side, e[`${side}_seq`]));
        t.custom.push([side, e[`${side}_seq`], e.pos]);
      }
    }
  }
  return [t, names];
}

export function mergedLayers(d, geo, axis, named) {
  const kind = (name, symbol, size, line, stand) => ({ kind: "points", name, symbol, size, line, x: [], y: [], custom: [], hover: [], color: [],
    text: named && stand ? [] : undefined, textAt: [] });
  const kinds = {
    same: kind("A = B", "square", 8, { width: 0.5, color: "rgba(31,41,51,0.3)" }, false),
    differs: kind("A ≠ B", "square", 14, { width: 1.5, color: "#7a1f1a" }, true),
    a_only: kind("A only", "triangle-up", 14, { width: 1, color: "#8a4a0c" }, true),
    b_only: kind("B only", "triangle-down", 14, { width: 1, color: "#8a4a0c" }, true),
  };
  for (const e of d.events) {
    const x = axis === "seq" ? e.pos + 0.5 : e.a_x ?? e.b_x;
    if (x == null) continue;
    const which = e.a_seq == null ? "b_only" : e.b_seq == null ? "a_only" : e.status === "diverged" ? "differs" : "same";
    const k = kinds[which];
    const side = e.a_seq != null ? "a" : "b";
    k.x.push(x);
    k.y.push(geo.y.a[e.phase]);
    k.custom.push([side, e[`${side}_seq`], e.pos]);
    k.hover.push([...hoverOf(e, null), ...(which.endsWith("only") ? [`only in run ${which[0].toUpperCase()} (gap)`] : [])]);
    k.color.push(look(e).color);
    if (k.text) k.text.push(shortName(e.boundary));
    k.textAt.push(e.pos % 2 ? "below" : "above"); // neighbours' names alternate: twice the room
  }
  return [kinds.same, kinds.differs, kinds.a_only, kinds.b_only];
}
