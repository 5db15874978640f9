// What the two timelines draw for one window from the server, as chart.js layers: the lanes'
// geometry (run A's lanes above run B's, one per phase, or one lane per phase for both runs when
// merged), bins coloured by their worst status, events as squares (slices and the merged view
// are slices.js's), the identical prefix, step boundaries numbered along the top, the pivot and
// the selected event; and the overview strip of the whole rank. Each event mark carries
// custom = [side, seq, pos], so that a click selects that event; hover texts are lines of text.
// Knows nothing of requests, clicks or the page: timeline.js hands it a window and the view
// (ctx: {axis, draw, selected, rank, codes, plotW}).

import { mergedLayers, shortName, sliceLayers } from "./slices.js";
import { count, PIVOT_COLOR, PREFIX_FILL, rowStatus, SELECT_COLOR, STATUS, STATUS_OF_ROW, UNKNOWN_STATUS } from "./format.js";

const LANE_GAP = 0.9; // blank space between A's and B's lanes, in lane heights
const look = (code) => STATUS[code] || UNKNOWN_STATUS;

export const DETAIL = { height: 340, margin: { l: 104, r: 14, t: 22, b: 44 } };
export const OVERVIEW = { height: 78, margin: { l: 104, r: 14, t: 4, b: 18 } };

// x ticks: positions as integers, time in seconds with the decimals the tick step needs
export function xTicks(axis) {
  if (axis === "seq") return { least: 1, format: (v) => count(Math.round(v)) };
  return { format: (v, step) => `${v.toFixed(Math.max(0, Math.min(9, -Math.floor(Math.log10(step)))))} s` };
}

const xTitle = (axis) => (axis === "seq" ? "aligned position (matched events share a column)" : "time since each run's first event on this rank");

// A's lanes 0..k-1 on top, a gap, B's lanes below: {y: {side: {phase: y}}, phases, merged, bottom,
// aTop, aBot, bTop, bBot}. Merged (events only): one lane per phase holds both runs.
export function laneY(d, draw) {
  const y = { a: {}, b: {} };
  const phases = d.lanes.filter((l) => l.side === "a").map((l) => l.phase);
  const merged = draw === "merged" && d.mode === "events";
  const k = phases.length;
  phases.forEach((p, i) => {
    y.a[p] = i;
    y.b[p] = merged ? i : k + LANE_GAP + i;
  });
  const bottom = merged ? k - 1 : 2 * k + LANE_GAP - 1;
  return { y, phases, merged, bottom, aTop: -0.5, aBot: k - 0.5, bTop: merged ? -0.5 : k + LANE_GAP - 0.5, bBot: bottom + 0.5 };
}

const eventX = (e, side, axis) => (axis === "seq" ? e.pos + 0.5 : e[`${side}_x`]);

function stepRange(lo, hi) {
  if (lo == null) return "";
  return lo === hi ? `step ${count(lo)}` : `steps ${count(lo)}–${count(hi)}`;
}

// -- the detail chart -------------------------------------------------------------------------
function binLayer(d, geo, codes) {
  const b = d.bins;
  // a bin's hover text is made when it is hovered: thousands of bins, each drawn far more often
  const at = []; // [lane, bin] of each cell
  const L = { kind: "rects", name: "bins", x0: [], x1: [], y0: [], y1: [], fill: [], ypad: 1.5, least: 1 };
  const rowOf = {};
  for (const ln of b.lanes) rowOf[`${ln.side}:${ln.phase}`] = ln;
  const steps = (i) => (b.step_lo ? stepRange(b.step_lo[i], b.step_hi[i]) : "");
  for (const side of ["a", "b"]) {
    for (const p of geo.phases) {
      const ln = rowOf[`${side}:${p}`];
      const y = geo.y[side][p];
      for (let i = 0; i < b.count; i += 1) {
        const n = ln.n[i];
        if (!n) continue;
        const x0 = b.start + i * b.width;
        L.x0.push(x0);
        L.x1.push(x0 + b.width);
        L.y0.push(y - 0.5);
        L.y1.push(y + 0.5);
        L.fill.push(look(codes[ln.status[i]]).color);
        at.push([ln, i]);
      }
    }
  }
  L.hover = (k) => {
    const [ln, i] = at[k];
    const dv = ln.diverged[i];
    return [`${ln.side.toUpperCase()} · ${ln.phase} · ${steps(i)}`, `${count(ln.n[i])} events${dv ? `, ${count(dv)} diverged` : ""}`, look(codes[ln.status[i]]).label];
  };
  return [L];
}

const NAME_PX = 44; // room an event needs for its name (neighbours' names alternate above and below)
export const hasRoom = (n, plotW) => n > 0 && plotW / n >= NAME_PX;

function hoverOf(e, side, seq) {
  return [`${side.toUpperCase()} seq ${seq} · step ${e.step}`, `${e.phase} ${e.boundary} (${e.module_type})`,
    `${rowStatus(e)}${e.is_pivot ? " · pivot" : ""}${e.reordered ? " · reordered" : ""}`];
}

function squareLayers(d, geo, ctx) {
  const { axis } = ctx;
  const n = d.events.length;
  const size = Math.max(5, Math.min(14, Math.round(900 / Math.max(n, 1))));
  const named = hasRoom(n, ctx.plotW);
  const runs = {};
  for (const side of ["a", "b"]) {
    runs[side] = { kind: "points", name: `run ${side.toUpperCase()}`, symbol: "square", size, x: [], y: [], color: [], custom: [], hover: [],
      text: named ? [] : undefined, textAt: [], line: { width: 0.5, color: "rgba(0,0,0,0.25)" } };
  }
  const links = [];
  const badLinks = [];
  const missing = { kind: "points", name: "gap", symbol: "x", size: size + 2, color: "#c46d12", line: { width: 2, color: "#c46d12" }, x: [], y: [], hover: [] };
  for (const e of d.events) {
    const color = look(STATUS_OF_ROW[e.status] || "identical").color;
    const x = { a: eventX(e, "a", axis), b: eventX(e, "b", axis) };
    for (const side of ["a", "b"]) {
      const seq = e[`${side}_seq`];
      if (seq == null || x[side] == null) continue;
      const r = runs[side];
      r.x.push(x[side]);
      r.y.push(geo.y[side][e.phase]);
      r.color.push(color);
      r.custom.push([side, seq, e.pos]);
      if (named) r.text.push(shortName(e.boundary));
      r.textAt.push(e.pos % 2 ? "below" : "above"); // neighbours alternate: twice the room
      r.hover.push(hoverOf(e, side, seq));
    }
    if (e.a_seq != null && e.b_seq != null && x.a != null && x.b != null) {
      (e.status === "diverged" ? badLinks : links).push([x.a, geo.y.a[e.phase] + 0.3, x.b, geo.y.b[e.phase] - 0.3]);
    } else if (axis === "seq") {
      const side = e.a_seq == null ? "a" : "b";
      missing.x.push(e.pos + 0.5);
      missing.y.push(geo.y[side][e.phase]);
      missing.hover.push([`no ${e.phase} ${e.boundary} in run ${side.toUpperCase()} here (gap)`]);
    }
  }
  return [
    { kind: "segments", name: "matched", segments: links, color: "rgba(95,107,122,0.28)", width: 1 },
    { kind: "segments", name: "matched, differing", segments: badLinks, color: "rgba(214,69,61,0.55)", width: 1.2 },
    runs.a, runs.b, missing,
  ];
}

function selectedLayer(d, geo, ctx, size) {
  const s = ctx.selected;
  if (!s || s.rank !== ctx.rank) return null;
  const e = d.events.find((ev) => ev.pos === s.pos);
  if (!e) return null;
  const L = { kind: "points", name: "selected", symbol: "square-open", size: size + 8, color: SELECT_COLOR, line: { width: 2.5, color: SELECT_COLOR }, x: [], y: [] };
  for (const side of ["a", "b"]) {
    const xv = eventX(e, side, ctx.axis);
    if (xv == null || e[`${side}_seq`] == null) continue;
    L.x.push(xv);
    L.y.push(geo.y[side][e.phase]);
  }
  return L;
}

// the identical prefix (below the marks), step boundaries and the pivot (above them), and labels
function around(d, geo, ctx) {
  const { axis } = ctx;
  const below = [];
  const above = [];
  const labels = [];
  const { aTop, aBot, bTop, bBot } = geo;
  if (d.prefix) {
    const R = { kind: "rects", name: "prefix", x0: [], x1: [], y0: [], y1: [], fill: PREFIX_FILL, least: 0 };
    for (const [side, y0, y1] of [["a", aTop, aBot], ["b", bTop, bBot]]) {
      const r = d.prefix[side];
      if (!r) continue;
      R.x0.push(r[0]);
      R.x1.push(r[1]);
      R.y0.push(y0);
      R.y1.push(y1);
    }
    below.push(R);
    const r = d.prefix.a;
    if (r && r[1] > d.start && r[0] < d.end) {
      labels.push({ text: "identical prefix", x: Math.max(r[0], d.start), y: bBot, above: true, color: "#2e8b57", size: 10, name: "prefix" });
    }
  }
  const pxPerX = ctx.plotW / Math.max(d.end - d.start, 1e-12);
  const pivotX = d.pivot ? (axis === "seq" ? d.pivot.pos + 0.5 : d.pivot.a_x) : null;
  above.push(stepLayer(d, geo, axis, pxPerX, pivotX, labels));
  if (d.pivot) {
    const xa = pivotX;
    const xb = axis === "seq" ? d.pivot.pos + 0.5 : d.pivot.b_x;
    const segs = [];
    if (xa != null) segs.push([xa, aTop, xa, axis === "seq" ? bBot : aBot]);
    if (xb != null && axis === "time") segs.push([xb, bTop, xb, bBot]);
    above.push({ kind: "segments", name: "pivot", segments: segs, color: PIVOT_COLOR, width: 2, dash: [2, 3] });
    if (xa != null && xa >= d.start && xa <= d.end) labels.push({ text: "pivot", x: xa, y: aTop, anchor: "center", above: true, bold: true, color: PIVOT_COLOR, size: 11, name: "pivot" });
  }
  return { below, above, labels };
}

// where each training step begins: a line through the lanes (by time, A's and B's each at their
// own clock), numbered along the top; thinned by the server to every k-th step when many
const LABEL_PX = 58; // the least room between two step numbers
function stepLayer(d, geo, axis, pxPerX, pivotX, labels) {
  const marks = (d.steps && d.steps.marks) || [];
  const segs = [];
  let lastLabel = -Infinity;
  const clear = (x) => pivotX == null || Math.abs(x + 12 / pxPerX - pivotX) * pxPerX >= 30; // the "pivot" label's place
  for (const m of marks) {
    if (axis === "seq") segs.push([m.x, geo.aTop, m.x, geo.bBot]);
    else {
      if (m.x != null) segs.push([m.x, geo.aTop, m.x, geo.aBot]);
      if (m.b_x != null) segs.push([m.b_x, geo.bTop, m.b_x, geo.bBot]);
    }
    const x = m.x ?? m.b_x;
    if (x != null && x >= d.start && x <= d.end && (x - lastLabel) * pxPerX >= LABEL_PX && clear(x)) {
      const first = lastLabel === -Infinity;
      lastLabel = x;
      labels.push({ text: first ? `step ${count(m.step)}` : count(m.step), x, y: "top", size: 10, color: "#5f6b7a", name: "step" });
    }
  }
  return { kind: "segments", name: "steps", segments: segs, color: "rgba(31,41,51,0.32)", width: 1, dash: [5, 4] };
}

function laneTicks(geo) {
  const out = [];
  for (const side of geo.merged ? ["a"] : ["a", "b"]) {
    for (const p of geo.phases) out.push({ v: geo.y[side][p], text: `${geo.merged ? "A·B" : side.toUpperCase()} · ${p}` });
  }
  return out;
}

// the chart spec of a detail window d (times already in seconds)
export function detailSpec(d, ctx) {
  const geo = laneY(d, ctx.draw);
  const pxPerX = ctx.plotW / Math.max(d.end - d.start, 1e-12);
  let marks;
  if (d.mode === "bins") marks = binLayer(d, geo, ctx.codes);
  else if (ctx.draw === "slices") marks = [...sliceLayers(d, geo, ctx.axis, pxPerX), selectedLayer(d, geo, ctx, 12)];
  else if (ctx.draw === "merged") marks = [...mergedLayers(d, geo, ctx.axis, hasRoom(d.events.length, ctx.plotW)), selectedLayer(d, geo, ctx, 14)];
  else {
    marks = squareLayers(d, geo, ctx);
    marks.push(selectedLayer(d, geo, ctx, marks[2].size));
  }
  const { below, above, labels } = around(d, geo, ctx);
  return {
    geo,
    spec: {
      x: [d.start, d.end], y: [-0.6, geo.bottom + 0.6], xTicks: xTicks(ctx.axis), yTicks: laneTicks(geo), xTitle: xTitle(ctx.axis),
      layers: [...below, ...marks, ...above], labels,
    },
  };
}

// -- the overview strip ---------------------------------------------------------------------------
// cell edges around sorted centres, as a heatmap draws them
function edges(xs) {
  const out = [];
  for (let i = 0; i < xs.length; i += 1) {
    const left = i ? (xs[i - 1] + xs[i]) / 2 : xs[i] - (xs.length > 1 ? (xs[1] - xs[0]) / 2 : 0.5);
    const right = i < xs.length - 1 ? (xs[i] + xs[i + 1]) / 2 : xs[i] + (xs.length > 1 ? (xs[i] - xs[i - 1]) / 2 : 0.5);
    out.push([left, right]);
  }
  return out;
}

export function overviewSpec(o, d, ctx) {
  const { axis, codes } = ctx;
  const tips = []; // a function of nothing per cell: its hover text, made when hovered
  const L = { kind: "rects", name: "overview", x0: [], x1: [], y0: [], y1: [], fill: [], hover: (k) => tips[k](), ypad: 1, least: 1 };
  const cell = (x0, x1, row, code, hover) => {
    L.x0.push(x0);
    L.x1.push(x1);
    L.y0.push(row - 0.5);
    L.y1.push(row + 0.5);
    L.fill.push(look(code).color);
    tips.push(hover);
  };
  if (o.mode === "bins") {
    const b = o.bins;
    ["a", "b"].forEach((side, row) => {
      const lanes = b.lanes.filter((l) => l.side === side);
      for (let i = 0; i < b.count; i += 1) {
        let n = 0;
        let dv = 0;
        let worst = 0;
        for (const l of lanes) {
          n += l.n[i];
          dv += l.diverged[i];
          if (l.n[i] && l.status[i] > worst) worst = l.status[i];
        }
        if (!n) continue;
        const x0 = b.start + i * b.width;
        cell(x0, x0 + b.width, row, codes[worst], () => [`${side.toUpperCase()}: ${count(n)} events${dv ? `, ${count(dv)} diverged` : ""}`]);
      }
    });
  } else {
    const xs = o.events.map((e) => ({ e, x: axis === "seq" ? e.pos + 0.5 : e.a_x ?? e.b_x })).filter((p) => p.x != null).sort((p, q) => p.x - q.x);
    const span = edges(xs.map((p) => p.x));
    ["a", "b"].forEach((side, row) => {
      xs.forEach(({ e }, i) => {
        if (e[`${side}_seq`] == null) return;
        cell(span[i][0], span[i][1], row, STATUS_OF_ROW[e.status], () => [`${side.toUpperCase()}: ${e.phase} ${e.boundary} (${rowStatus(e)})`]);
      });
    });
  }
  const layers = [L, { kind: "rects", name: "window", x0: [d.start], x1: [d.end], y0: [-0.5], y1: [1.5], fill: "rgba(47,95,208,0.08)", stroke: "#2f5fd0", lineWidth: 1.5, least: 2 }];
  if (o.pivot) {
    const xp = axis === "seq" ? o.pivot.pos + 0.5 : o.pivot.a_x;
    if (xp != null) layers.push({ kind: "segments", name: "pivot", segments: [[xp, -0.5, xp, 1.5]], color: PIVOT_COLOR, width: 2 });
  }
  return { x: o.extent, y: [-0.5, 1.5], grid: false, xTicks: xTicks(axis), yTicks: [{ v: 0, text: "run A" }, { v: 1, text: "run B" }], layers };
}
