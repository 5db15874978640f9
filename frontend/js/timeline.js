// The comparison view's two matched timelines: run A's lanes above run B's, one lane per
// phase, for one rank, by aligned position or by time. The server sends a window at a time,
// binned when it holds many events and event by event when few; zooming asks for the next
// window. An overview strip shows the whole rank and where the window is. Above them, steps to
// the next or previous divergent pair or gap (asked of the server's search, which knows them all
// in aligned order) and zoom in and out around the selected event or the window's middle.

import { api, comparisonPath } from "./api.js";
import { $, $$, EV, SEL, el, emit, fill, on, plotly, toast } from "./dom.js";
import { pending } from "./viewstate.js";
import { mergedTraces, shortName, sliceTraces } from "./slices.js";
import { count, duration, PIVOT_COLOR, plotText as esc, PREFIX_FILL, rowStatus, SELECT_COLOR, STATUS, STATUS_OF_ROW, UNKNOWN_STATUS } from "./format.js";

let CODES = Object.keys(STATUS); // replaced by the server's status_codes with every window
const look = (code) => STATUS[code] || UNKNOWN_STATUS;
const SPAN = 240; // events in a window opened around one event
const BINS = 900;
const LANE_GAP = 0.9; // blank space between A's and B's lanes, in lane heights
// a click on a bin zooms in, but only once it is known not to be the first click of a double-click
const DOUBLE_CLICK_MS = 300;
// Plotly's own double-click and "reset axes" go back to the first range it drew, which may be in
// the other axis's units (positions read as seconds) or the pivot window: both are ours instead
const PLOT_CONFIG = {
  displaylogo: false, responsive: true, doubleClick: false, doubleClickDelay: DOUBLE_CLICK_MS, showTips: false,
  modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d", "resetScale2d", "toImage"],
};

const st = {
  c: null, // the comparison
  rank: 0,
  axis: "seq",
  draw: "squares", // how a window of events is drawn: squares | slices | merged (slices.js)
  data: null, // the last detail window from the server
  overview: null,
  selected: null, // {rank, pos, side, seq}
  token: 0, // the latest detail request; older answers are dropped
  drawnFor: null,
};

function colorscale() {
  const stops = [];
  CODES.forEach((code, i) => {
    const lo = i === 0 ? 0 : (i - 0.5) / (CODES.length - 1);
    const hi = i === CODES.length - 1 ? 1 : (i + 0.5) / (CODES.length - 1);
    stops.push([lo, look(code).color], [hi, look(code).color]);
  });
  return stops;
}

function drawLegend() {
  fill($(SEL.legend),
    ...CODES.slice(1).map((code) => el("span", {}, el("i", { style: `background:${look(code).color}` }), look(code).label)),
    el("span", {}, el("i", { style: `background:${PREFIX_FILL};border:1px solid #9fd0b1` }), "identical prefix"),
    el("span", {}, el("i", { style: `background:${PIVOT_COLOR}` }), "pivot"));
}

function useCodes(codes) {
  if (!Array.isArray(codes) || codes.join() === CODES.join()) return;
  CODES = codes.map(String);
  drawLegend();
}

export function init() {
  drawLegend();
  $(SEL.rankSelect).addEventListener("change", (e) => setRank(Number(e.target.value)));
  for (const b of $$("button", $(SEL.axisToggle))) b.addEventListener("click", () => setAxis(b.dataset.axis));
  for (const b of $$("button", $(SEL.drawToggle))) b.addEventListener("click", () => setDraw(b.dataset.draw));
  $(SEL.gotoPivot).addEventListener("click", () => gotoPivot());
  $(SEL.wholeRank).addEventListener("click", () => wholeRank());
  $(SEL.prevDivergence).addEventListener("click", () => nextDifference("diverged", "prev"));
  $(SEL.nextDivergence).addEventListener("click", () => nextDifference("diverged", "next"));
  $(SEL.prevGap).addEventListener("click", () => nextDifference("gap", "prev"));
  $(SEL.nextGap).addEventListener("click", () => nextDifference("gap", "next"));
  $(SEL.zoomIn).addEventListener("click", () => zoom(0.5));
  $(SEL.zoomOut).addEventListener("click", () => zoom(2));
  const plot = $(SEL.timeline);
  plot.tabIndex = 0; // focusable: the arrow keys step from event to event (keys.js)
  plot.setAttribute("aria-label", "timelines of run A and run B; arrow keys step from event to event");
  on(EV.comparisonLoaded, (c) => load(c));
  on(EV.restoreView, (v) => show(v));
  on(EV.selectEvent, (sel) => {
    st.selected = sel;
    if (sel.source === "restore") drawDetail(); // a link's selection: its window comes with it
    else if (sel.source !== "timeline") reveal(sel);
    else drawDetail();
  });
}

function pivotPos(rank = st.rank) {
  const p = st.c && st.c.pivot_position;
  return p && p.rank === rank ? p.pos : null;
}

async function load(c) {
  const same = st.c && st.c.id === c.id;
  st.c = c;
  if (!same) {
    st.axis = "seq";
    st.selected = null;
  }
  st.rank = c.pivot_position ? c.pivot_position.rank : (same && c.ranks.includes(st.rank) ? st.rank : c.ranks[0]);
  const select = $(SEL.rankSelect);
  fill(select, ...c.ranks.map((r) => el("option", { value: r, selected: r === st.rank }, `${r}`)));
  select.disabled = c.ranks.length < 2;
  $(SEL.gotoPivot).disabled = !c.pivot_position;
  fill($(SEL.navInfo));
  const v = pending(c);
  if (v) {
    await show(v);
    return;
  }
  syncAxisButtons();
  await refresh({ around: pivotPos() });
}

// a view read from a link: {rank, axis, window: [start, end] in what the axis shows | "all", selected}
async function show(v) {
  if (v.rank != null && st.c.ranks.includes(v.rank)) {
    st.rank = v.rank;
    $(SEL.rankSelect).value = String(v.rank);
  }
  if (v.axis === "seq" || v.axis === "time") st.axis = v.axis;
  if (DRAWS.includes(v.draw)) st.draw = v.draw;
  if (v.selected) st.selected = v.selected;
  syncAxisButtons();
  cancelPending();
  if (v.window === "all") await refresh({});
  else if (Array.isArray(v.window)) await refresh({ start: v.window[0], end: v.window[1] });
  else if (v.selected && v.selected.rank === st.rank) await refresh({ around: v.selected.pos });
  else await refresh({ around: pivotPos() });
}

function syncAxisButtons() {
  for (const b of $$("button", $(SEL.axisToggle))) b.classList.toggle("on", b.dataset.axis === st.axis);
  for (const b of $$("button", $(SEL.drawToggle))) b.classList.toggle("on", b.dataset.draw === st.draw);
}

const DRAWS = ["squares", "slices", "merged"];
export const cycleDraw = () => setDraw(DRAWS[(DRAWS.indexOf(st.draw) + 1) % DRAWS.length]);
export function setDraw(draw) {
  if (!DRAWS.includes(draw) || draw === st.draw) return;
  st.draw = draw;
  syncAxisButtons();
  drawDetail();
  if (st.data) announce();
}

async function setRank(rank) {
  st.rank = rank;
  await refresh({ around: pivotPos() });
}

async function setAxis(axis) {
  if (axis === st.axis) return;
  const d = st.data;
  const whole = d && d.start <= d.extent[0] && d.end >= d.extent[1]; // the whole rank stays the whole rank
  const centre = st.selected && st.selected.rank === st.rank ? st.selected.pos : middlePos();
  st.axis = axis;
  syncAxisButtons();
  cancelPending();
  await refresh(whole ? {} : { around: centre });
}

function middlePos() {
  const d = st.data;
  if (d && d.mode === "events" && d.events.length) return d.events[Math.floor(d.events.length / 3)].pos;
  return pivotPos();
}

// the whole rank in the current axis: a window without bounds
export function wholeRank() {
  cancelPending();
  return refresh({ overviewToo: false });
}

// -- stepping through the rank ---------------------------------------------------------------
// where "next" starts from: the selected event, else just before the window (after it for "prev")
function cursor(direction) {
  const s = st.selected;
  if (s && s.rank === st.rank && s.pos != null) return s.pos;
  const d = st.data;
  if (!d) return null;
  if (st.axis === "seq") return direction === "next" ? Math.floor(d.start) - 1 : Math.ceil(d.end);
  if (d.mode === "events" && d.events.length) return direction === "next" ? d.events[0].pos - 1 : d.events[d.events.length - 1].pos + 1;
  return pivotPos();
}

const WHAT = { diverged: "divergent pair", gap: "gap" };

// the next (or previous) event the query matches on this rank, selected and brought into view;
// the server's answer, or null when the request failed
export async function jump(query, direction = "next") {
  const c = st.c;
  if (!c) return null;
  const at = cursor(direction);
  let out;
  try {
    out = await api.get(comparisonPath(c.id, "/search"), { ...query, rank: st.rank, from: at, direction, limit: 0 });
  } catch (e) {
    if (e.type !== "ComparisonNotReady") toast(e.message, "error");
    return null;
  }
  if (c !== st.c) return null;
  if (out.hit) {
    const e = out.hit.event;
    const side = e.a_seq != null ? "a" : "b";
    emit(EV.selectEvent, { rank: st.rank, pos: e.pos, side, seq: side === "a" ? e.a_seq : e.b_seq, source: "nav" });
  }
  return out;
}

function say(node, text, none = false) {
  node.textContent = text;
  node.classList.toggle("none", none);
}

export async function nextDifference(status, direction = "next") {
  const out = await jump({ status }, direction);
  if (!out) return;
  const what = WHAT[status] || status;
  const node = $(SEL.navInfo);
  if (!out.total) say(node, `no ${what} on rank ${st.rank}`, true);
  else if (!out.hit) say(node, `no ${what} ${direction === "next" ? "after" : "before"} this one (${count(out.total)} in all)`, true);
  else {
    const e = out.hit.event;
    say(node, `${what} ${count(out.hit.index + 1)} of ${count(out.total)} · step ${count(e.step)} · ${e.phase} ${e.boundary}`);
  }
}

// the event next to the selected one in aligned order (any status)
export async function stepEvent(direction) {
  const out = await jump({}, direction);
  if (out && !out.hit) say($(SEL.navInfo), direction === "next" ? "the last event of this rank" : "the first event of this rank", true);
}

// zoom the window by `factor` (0.5: in, 2: out) around the selected event when it is in view,
// else around the window's middle; the server clamps a window past the rank's ends
export function zoom(factor) {
  const d = st.data;
  if (!d) return null;
  let mid = (d.start + d.end) / 2;
  const s = st.selected;
  if (s && s.rank === st.rank && d.mode === "events") {
    const e = d.events.find((ev) => ev.pos === s.pos);
    const x = e && (st.axis === "seq" ? e.pos + 0.5 : e[`${s.side}_x`]);
    if (x != null) mid = x;
  }
  const least = st.axis === "seq" ? 4 : 1e-6; // four positions, or a microsecond
  const half = Math.max(((d.end - d.start) * factor) / 2, least / 2);
  if (factor > 1 && d.start <= d.extent[0] && d.end >= d.extent[1]) return null; // the whole rank already
  const [lo, hi] = d.extent;
  // a window past one end of the rank slides back in, keeping its width where the rank allows
  let a = mid - half;
  let b = mid + half;
  if (a < lo) [a, b] = [lo, Math.min(hi, b + (lo - a))];
  if (b > hi) [a, b] = [Math.max(lo, a - (b - hi)), hi];
  cancelPending();
  return refresh({ start: a, end: b, overviewToo: false });
}

export function toggleAxis() {
  return setAxis(st.axis === "seq" ? "time" : "seq");
}

export async function gotoPivot() {
  const p = st.c && st.c.pivot_position;
  if (!p) return;
  if (p.rank !== st.rank) {
    st.rank = p.rank;
    $(SEL.rankSelect).value = String(p.rank);
  }
  await refresh({ around: p.pos });
  const m = st.data && st.data.pivot; // and selected, so that "next" goes on from it
  if (m && st.c && st.c.pivot_position === p && (m.a_seq != null || m.b_seq != null)) {
    const side = m.a_seq != null ? "a" : "b";
    emit(EV.selectEvent, { rank: p.rank, pos: p.pos, side, seq: m[`${side}_seq`], source: "timeline" });
  }
}

async function reveal(sel) {
  if (sel.pos == null) return;
  if (sel.rank !== st.rank) {
    st.rank = sel.rank;
    $(SEL.rankSelect).value = String(sel.rank);
    await refresh({ around: sel.pos });
    return;
  }
  const d = st.data;
  const visible = d && d.mode === "events" && d.events.some((e) => e.pos === sel.pos);
  if (visible) drawDetail();
  else await refresh({ around: sel.pos, overviewToo: false });
}

// fetch the overview (whole rank) and a detail window, then draw both
async function refresh({ around = null, start = null, end = null, overviewToo = true } = {}) {
  const c = st.c;
  const base = { rank: st.rank, axis: st.axis };
  const token = ++st.token;
  const detailParams = around != null ? { ...base, around, span: SPAN, bins: BINS }
    : start != null ? { ...base, start, end, bins: BINS } : { ...base, bins: BINS };
  if (start != null && st.axis === "time") {
    detailParams.start = start * NS; // the page shows seconds, the server counts ns
    detailParams.end = end * NS;
  }
  const jobs = [api.get(comparisonPath(c.id, "/timeline"), detailParams)];
  if (overviewToo) jobs.push(api.get(comparisonPath(c.id, "/timeline"), base)); // server's default bins: ready-made
  let detail;
  let overview;
  try {
    [detail, overview] = await Promise.all(jobs);
  } catch (e) {
    if (e.type !== "ComparisonNotReady") toast(e.message, "error"); // a rerun started: it redraws when ready
    return;
  }
  await plotly;
  await released();
  if (token !== st.token || c !== st.c) return; // a newer request won
  useCodes(detail.status_codes);
  st.data = inSeconds(detail);
  if (overview) st.overview = inSeconds(overview);
  drawDetail();
  drawOverview();
  announce();
}

function announce() {
  const d = st.data;
  const whole = d.start <= d.extent[0] && d.end >= d.extent[1];
  const start = st.axis === "time" ? d.start * NS : d.start; // the server's units, as before
  const end = st.axis === "time" ? d.end * NS : d.end;
  emit(EV.timelineDrawn, { rank: st.rank, axis: st.axis, start, end, mode: d.mode, revision: st.c.revision,
    comparison: st.c.id, window: whole ? "all" : [d.start, d.end], draw: st.draw }); // window: in what the axis shows
}

// a time window arrives in ns since each side's first event; it is drawn in seconds
const NS = 1e9;
function inSeconds(d) {
  if (d.axis !== "time") return d;
  const s = (v) => (v == null ? v : v / NS);
  const out = { ...d, start: s(d.start), end: s(d.end), extent: d.extent.map(s) };
  if (d.prefix) out.prefix = { a: d.prefix.a && d.prefix.a.map(s), b: d.prefix.b && d.prefix.b.map(s) };
  if (d.pivot) out.pivot = { ...d.pivot, a_x: s(d.pivot.a_x), b_x: s(d.pivot.b_x) };
  if (d.bins) out.bins = { ...d.bins, start: s(d.bins.start), width: s(d.bins.width) };
  if (d.events) out.events = d.events.map((e) => ({ ...e, a_x: s(e.a_x), b_x: s(e.b_x), a_dur: s(e.a_dur), b_dur: s(e.b_dur) }));
  if (d.steps) out.steps = { ...d.steps, marks: d.steps.marks.map((m) => ({ ...m, x: s(m.x), b_x: s(m.b_x) })) };
  return out;
}

// -- geometry ------------------------------------------------------------------------------
function laneY(d) {
  // A's lanes 0..k-1 on top, a gap, B's lanes below; returns {side: {phase: y}} and each side's
  // top and bottom. Merged (events only): one lane per phase holds both runs.
  const y = { a: {}, b: {} };
  const phases = d.lanes.filter((l) => l.side === "a").map((l) => l.phase);
  const merged = st.draw === "merged" && d.mode === "events";
  const k = phases.length;
  phases.forEach((p, i) => {
    y.a[p] = i;
    y.b[p] = merged ? i : k + LANE_GAP + i;
  });
  const bottom = merged ? k - 1 : 2 * k + LANE_GAP - 1;
  return { y, phases, merged, bottom, aTop: -0.5, aBot: k - 0.5, bTop: merged ? -0.5 : k + LANE_GAP - 0.5, bBot: bottom + 0.5 };
}

function shapesFor(d, geo, { labels = true } = {}) {
  const shapes = [];
  const annotations = [];
  const { aTop, aBot, bTop, bBot } = geo;
  if (d.prefix) {
    for (const [side, y0, y1] of [["a", aTop, aBot], ["b", bTop, bBot]]) {
      const r = d.prefix[side];
      if (!r) continue;
      shapes.push({ type: "rect", xref: "x", yref: "y", x0: r[0], x1: r[1], y0, y1, fillcolor: PREFIX_FILL, line: { width: 0 }, layer: "below" });
    }
    const r = d.prefix.a;
    if (labels && r && r[1] > d.start && r[0] < d.end) {
      annotations.push({ x: Math.max(r[0], d.start), xanchor: "left", y: bBot, yanchor: "bottom", text: "identical prefix", showarrow: false, font: { size: 10, color: "#2e8b57" }, bgcolor: "rgba(255,255,255,0.7)" });
    }
  }
  stepShapes(d, { aTop, aBot, bTop, bBot }, shapes, labels ? annotations : null);
  if (d.pivot) {
    const xa = st.axis === "seq" ? d.pivot.pos + 0.5 : d.pivot.a_x;
    const xb = st.axis === "seq" ? d.pivot.pos + 0.5 : d.pivot.b_x;
    const line = { color: PIVOT_COLOR, width: 2, dash: "dot" };
    if (xa != null) shapes.push({ type: "line", x0: xa, x1: xa, y0: aTop, y1: st.axis === "seq" ? bBot : aBot, line });
    if (xb != null && st.axis === "time") shapes.push({ type: "line", x0: xb, x1: xb, y0: bTop, y1: bBot, line });
    if (labels && xa != null && xa >= d.start && xa <= d.end) {
      annotations.push({ x: xa, y: aTop, yanchor: "bottom", text: "<b>pivot</b>", showarrow: false, font: { size: 11, color: PIVOT_COLOR } });
    }
  }
  return { shapes, annotations };
}

// where each training step begins: a line through the lanes (by time, A's and B's each at their
// own clock), numbered along the top; thinned by the server to every k-th step when many
const STEP_LINE = { color: "rgba(31,41,51,0.32)", width: 1, dash: "dash" };
const LABEL_PX = 58; // the least room between two step numbers
function stepShapes(d, y, shapes, annotations) {
  const marks = (d.steps && d.steps.marks) || [];
  const node = $(SEL.timeline);
  const pxPerX = Math.max(node.clientWidth - 118, 100) / Math.max(d.end - d.start, 1e-12); // less the margins
  let lastLabel = -Infinity;
  const pivotX = d.pivot ? (st.axis === "seq" ? d.pivot.pos + 0.5 : d.pivot.a_x) : null;
  const clear = (x) => pivotX == null || Math.abs(x + 12 / pxPerX - pivotX) * pxPerX >= 30; // the "pivot" label's place
  for (const m of marks) {
    if (st.axis === "seq") {
      shapes.push({ type: "line", x0: m.x, x1: m.x, y0: y.aTop, y1: y.bBot, line: STEP_LINE, layer: "above", name: "step" });
    } else {
      if (m.x != null) shapes.push({ type: "line", x0: m.x, x1: m.x, y0: y.aTop, y1: y.aBot, line: STEP_LINE, layer: "above", name: "step" });
      if (m.b_x != null) shapes.push({ type: "line", x0: m.b_x, x1: m.b_x, y0: y.bTop, y1: y.bBot, line: STEP_LINE, layer: "above", name: "step" });
    }
    const x = m.x ?? m.b_x;
    if (annotations && x != null && (x - lastLabel) * pxPerX >= LABEL_PX && clear(x)) {
      const first = lastLabel === -Infinity;
      lastLabel = x;
      annotations.push({ x, xanchor: "left", yref: "paper", y: 1, yanchor: "bottom", text: first ? `step ${count(m.step)}` : count(m.step), showarrow: false, font: { size: 10, color: "#5f6b7a" }, name: "step" });
    }
  }
}

function stepRange(lo, hi) {
  if (lo == null) return "";
  return lo === hi ? `step ${count(lo)}` : `steps ${count(lo)}–${count(hi)}`;
}

function laneTicks(geo) {
  const vals = [];
  const text = [];
  for (const side of geo.merged ? ["a"] : ["a", "b"]) {
    for (const p of geo.phases) {
      vals.push(geo.y[side][p]);
      text.push(`${geo.merged ? "A·B" : side.toUpperCase()} · ${esc(p)}`);
    }
  }
  return { tickvals: vals, ticktext: text };
}

function xTitle() {
  return st.axis === "seq" ? "aligned position (matched events share a column)" : "time since each run's first event on this rank";
}

function xTicks() {
  return st.axis === "time" ? { ticksuffix: " s" } : { tickformat: ",d" };
}

// -- the detail chart -----------------------------------------------------------------------
function binTraces(d, geo) {
  const b = d.bins;
  const z = [];
  const text = [];
  const ys = [];
  const rowOf = {};
  for (const ln of b.lanes) rowOf[`${ln.side}:${ln.phase}`] = ln;
  const yValues = [];
  for (const side of ["a", "b"]) for (const p of geo.phases) yValues.push([side, p, geo.y[side][p]]);
  for (const [side, p, y] of yValues) {
    const ln = rowOf[`${side}:${p}`];
    ys.push(y);
    z.push(ln.status.map((s, i) => (ln.n[i] ? s : null)));
    const steps = (i) => (b.step_lo ? stepRange(b.step_lo[i], b.step_hi[i]) : "");
    text.push(ln.n.map((n, i) => (n ? `${side.toUpperCase()} · ${esc(p)} · ${steps(i)}<br>${count(n)} events${ln.diverged[i] ? `, <b>${count(ln.diverged[i])} diverged</b>` : ""}<br>${look(CODES[ln.status[i]]).label}` : "")));
  }
  const x = Array.from({ length: b.count }, (_, i) => b.start + (i + 0.5) * b.width);
  return [{
    type: "heatmap", x, y: ys, z, text, hoverinfo: "text", zmin: 0, zmax: CODES.length - 1,
    colorscale: colorscale(), showscale: false, xgap: 0, ygap: 3, hoverongaps: false,
  }];
}

function eventTraces(d, geo) {
  const xs = { a: [], b: [] };
  const ys = { a: [], b: [] };
  const colors = { a: [], b: [] };
  const custom = { a: [], b: [] };
  const hover = { a: [], b: [] };
  const names = { a: [], b: [] };
  const namePlace = { a: [], b: [] };
  const links = { x: [], y: [] };
  const badLinks = { x: [], y: [] };
  const missing = { x: [], y: [], text: [] };
  const n = d.events.length;
  const size = Math.max(5, Math.min(14, Math.round(900 / Math.max(n, 1))));
  for (const e of d.events) {
    const color = look(STATUS_OF_ROW[e.status] || "identical").color;
    const x = { a: st.axis === "seq" ? e.pos + 0.5 : e.a_x, b: st.axis === "seq" ? e.pos + 0.5 : e.b_x };
    for (const side of ["a", "b"]) {
      const seq = side === "a" ? e.a_seq : e.b_seq;
      if (seq == null || x[side] == null) continue;
      xs[side].push(x[side]);
      ys[side].push(geo.y[side][e.phase]);
      colors[side].push(color);
      custom[side].push([side, seq, e.pos]);
      names[side].push(esc(shortName(e.boundary)));
      namePlace[side].push(e.pos % 2 ? "bottom center" : "top center"); // neighbours alternate: twice the room
      const status = rowStatus(e);
      hover[side].push(`<b>${side.toUpperCase()}</b> seq ${esc(seq)} · step ${esc(e.step)}<br>${esc(e.phase)} <b>${esc(e.boundary)}</b> (${esc(e.module_type)})<br>${esc(status)}${e.is_pivot ? " · <b>pivot</b>" : ""}${e.reordered ? " · reordered" : ""}`);
    }
    if (e.a_seq != null && e.b_seq != null && x.a != null && x.b != null) {
      const target = e.status === "diverged" ? badLinks : links;
      target.x.push(x.a, x.b, null);
      target.y.push(geo.y.a[e.phase] + 0.3, geo.y.b[e.phase] - 0.3, null);
    } else if (st.axis === "seq") {
      const side = e.a_seq == null ? "a" : "b";
      missing.x.push(e.pos + 0.5);
      missing.y.push(geo.y[side][e.phase]);
      missing.text.push(`no ${esc(e.phase)} ${esc(e.boundary)} in run ${side.toUpperCase()} here (gap)`);
    }
  }
  const traces = [
    { type: "scatter", mode: "lines", x: links.x, y: links.y, line: { color: "rgba(95,107,122,0.28)", width: 1 }, hoverinfo: "skip", name: "matched" },
    { type: "scatter", mode: "lines", x: badLinks.x, y: badLinks.y, line: { color: "rgba(214,69,61,0.55)", width: 1.2 }, hoverinfo: "skip", name: "matched, differing" },
  ];
  // each event named above its square once there is room for a name
  const named = hasRoom(n);
  for (const side of ["a", "b"]) {
    traces.push({
      type: "scatter", mode: named ? "markers+text" : "markers", x: xs[side], y: ys[side], customdata: custom[side],
      hovertext: hover[side], hoverinfo: "text", text: named ? names[side] : undefined, textposition: namePlace[side],
      textfont: { size: 9, color: "#3e4c59" }, cliponaxis: false,
      marker: { symbol: "square", size, color: colors[side], line: { width: 0.5, color: "rgba(0,0,0,0.25)" } }, name: `run ${side.toUpperCase()}`,
    });
  }
  traces.push({
    type: "scatter", mode: "markers", x: missing.x, y: missing.y, text: missing.text, hoverinfo: "text",
    marker: { symbol: "x-thin-open", size: size + 2, color: "#c46d12", line: { width: 2, color: "#c46d12" } }, name: "gap",
  });
  const sel = selectedPoints(d, geo, size);
  if (sel) traces.push(sel);
  return traces;
}

const NAME_PX = 44; // room an event needs for its name (neighbours' names alternate above and below)
const plotPx = () => Math.max($(SEL.timeline).clientWidth - 118, 100); // less the margins
const hasRoom = (n) => n > 0 && plotPx() / n >= NAME_PX;

function selectedPoints(d, geo, size) {
  const s = st.selected;
  if (!s || s.rank !== st.rank) return null;
  const e = d.events.find((ev) => ev.pos === s.pos);
  if (!e) return null;
  const x = [];
  const y = [];
  for (const side of ["a", "b"]) {
    const xv = st.axis === "seq" ? e.pos + 0.5 : e[`${side}_x`];
    if (xv == null || e[`${side}_seq`] == null) continue;
    x.push(xv);
    y.push(geo.y[side][e.phase]);
  }
  return { type: "scatter", mode: "markers", x, y, hoverinfo: "skip", marker: { symbol: "square-open", size: size + 8, color: SELECT_COLOR, line: { width: 2.5, color: SELECT_COLOR } }, name: "selected" };
}

function drawDetail() {
  const d = st.data;
  if (!d || !window.Plotly) return;
  const geo = laneY(d);
  let traces;
  if (d.mode === "bins") traces = binTraces(d, geo);
  else if (st.draw === "slices") traces = [...sliceTraces(d, geo, st.axis, plotPx() / Math.max(d.end - d.start, 1e-12)), selectedPoints(d, geo, 12)].filter(Boolean);
  else if (st.draw === "merged") traces = [...mergedTraces(d, geo, st.axis, hasRoom(d.events.length)), selectedPoints(d, geo, 14)].filter(Boolean);
  else traces = eventTraces(d, geo);
  const { shapes, annotations } = shapesFor(d, geo);
  const layout = {
    margin: { l: 104, r: 14, t: 22, b: 44 },
    height: 340,
    showlegend: false,
    dragmode: "zoom",
    hovermode: "closest",
    plot_bgcolor: "#fff",
    paper_bgcolor: "#fff",
    font: { family: getComputedStyle(document.body).fontFamily, size: 12, color: "#1f2933" },
    xaxis: { range: [d.start, d.end], title: { text: xTitle(), font: { size: 11, color: "#5f6b7a" } }, showgrid: true, gridcolor: "#eef1f4", zeroline: false, ...xTicks() },
    yaxis: { range: [geo.bottom + 0.6, -0.6], fixedrange: true, showgrid: false, zeroline: false, ...laneTicks(geo) },
    shapes,
    annotations,
    barmode: "overlay",
  };
  const node = $(SEL.timeline);
  window.Plotly.react(node, traces, layout, PLOT_CONFIG);
  if (!node.dataset.wired) {
    node.dataset.wired = "1";
    node.on("plotly_click", onDetailClick);
    node.on("plotly_doubleclick", onDoubleClick);
    // plotly loses a double-click when its first click redraws the plot (selecting an event):
    // two presses close in time and place are one whatever was drawn between them
    node.addEventListener("mousedown", onPress, true);
    node.addEventListener("click", onBlankClick);
    node.on("plotly_relayout", onRelayout);
  }
  node.dataset.mode = d.mode;
  node.dataset.rank = String(st.rank);
  node.dataset.axis = st.axis;
  node.dataset.draw = d.mode === "events" ? st.draw : "bins";
  node.dataset.window = `${d.start} ${d.end}`; // in what the axis shows: positions, or seconds
  node.dataset.whole = String(d.start <= d.extent[0] && d.end >= d.extent[1]);
  node.dataset.countA = String(d.count_a);
  const what = d.mode === "bins" ? `${count(d.bins.count)} bins of ${st.axis === "seq" ? count(Math.round(d.bins.width)) + " positions" : duration(d.bins.width * NS)}` : `${count(d.events.length)} events, each drawn`;
  const span = st.axis === "seq" ? `positions ${count(Math.floor(d.start))}–${count(Math.ceil(d.end))} of ${count(d.extent[1])}` : `${duration(d.start * NS)} – ${duration(d.end * NS)} of ${duration(d.extent[1] * NS)}`;
  fill($(SEL.timelineInfo), 
    el("span", {}, `rank ${st.rank} · ${span}`),
    el("span", {}, `A ${count(d.count_a)} / B ${count(d.count_b)} events in view · ${what}`),
    el("span", {}, d.mode === "bins" ? "drag or click a bin to zoom · double-click for the whole rank" : "drag to zoom · double-click for the whole rank · click an event to inspect it"),
  );
}

let clickTimer = null;
let lastDoubleClick = -Infinity;
function cancelPending() {
  clearTimeout(clickTimer);
  clearTimeout(relayoutTimer);
}

// a window that arrives while the mouse is down on the plot waits for the release: drawn under a
// drag, it would change what the drag covers (a click's zoom landing mid-drag made the drag's
// range one of the zoomed window's, a few events instead of thousands)
let pressed = false;
let waiting = [];
function released() {
  return pressed ? new Promise((resolve) => waiting.push(resolve)) : null;
}
function release() {
  if (!pressed) return;
  pressed = false;
  setTimeout(() => { // after plotly's own mouseup, which ends the drag
    const go = waiting;
    waiting = [];
    for (const resolve of go) resolve();
  }, 0);
}
window.addEventListener("mouseup", release, true);
window.addEventListener("blur", release);

let lastPress = { t: -Infinity, x: 0, y: 0 };
function onPress(e) {
  if (e.button !== 0 || e.target.closest(".modebar")) return;
  pressed = true;
  pointClicked = false;
  clearTimeout(clickTimer); // a press after a bin click: a drag or a double-click, not that zoom
  const t = e.timeStamp; // when the press happened, not when a busy page got to it
  const near = Math.abs(e.clientX - lastPress.x) < 6 && Math.abs(e.clientY - lastPress.y) < 6;
  const double = near && t - lastPress.t < DOUBLE_CLICK_MS;
  lastPress = double ? { t: -Infinity, x: 0, y: 0 } : { t, x: e.clientX, y: e.clientY };
  if (double) onDoubleClick();
}

function onDoubleClick() {
  const t = performance.now();
  if (t - lastDoubleClick < DOUBLE_CLICK_MS) return; // seen already (by the presses, or by plotly)
  lastDoubleClick = t;
  wholeRank();
}

// a bin's zoom: four bins around x, once the click is known not to start a double-click
function zoomAt(x) {
  // plotly reports both clicks of a double-click, the second one after the double-click itself
  if (performance.now() - lastDoubleClick < DOUBLE_CLICK_MS) return;
  const w = st.data.bins.width;
  clearTimeout(clickTimer);
  clickTimer = setTimeout(() => refresh({ start: x - 2 * w, end: x + 2 * w, overviewToo: false }), DOUBLE_CLICK_MS + 20);
}

let pointClicked = false; // plotly found a point under this click
function onDetailClick(ev) {
  const p = ev.points && ev.points[0];
  if (!p) return;
  pointClicked = true;
  if (st.data.mode === "bins") {
    zoomAt(p.x);
    return;
  }
  if (!p.customdata) return;
  const [side, seq, pos] = p.customdata;
  emit(EV.selectEvent, { rank: st.rank, side, seq, pos, source: "timeline" });
}

// a click where plotly found no point (white space between squares, an empty bin): the nearest
// event of that lane within reach is selected, or the bins there are zoomed into
const REACH_PX = 120;
function onBlankClick(e) {
  const gd = $(SEL.timeline);
  const L = gd._fullLayout;
  const d = st.data;
  if (pointClicked || gd._dragged || !L || !d || e.button !== 0 || e.target.closest(".modebar")) return;
  const box = gd.getBoundingClientRect();
  const px = e.clientX - box.left - L._size.l;
  const py = e.clientY - box.top - L._size.t;
  if (px < 0 || px > L._size.w || py < 0 || py > L._size.h) return;
  const x = L.xaxis.p2l(px);
  if (d.mode === "bins") {
    zoomAt(x);
    return;
  }
  const geo = laneY(d);
  const y = L.yaxis.p2l(py);
  let lane = null;
  for (const side of ["a", "b"]) {
    for (const phase of geo.phases) {
      if (Math.abs(geo.y[side][phase] - y) <= 0.5) lane = { side, phase };
    }
  }
  if (!lane) return;
  let best = null;
  for (const ev of d.events) {
    // merged: one lane holds both runs, and an event on one side only is that side's
    const side = geo.merged && ev[`${lane.side}_seq`] == null ? (lane.side === "a" ? "b" : "a") : lane.side;
    const seq = ev[`${side}_seq`];
    const ex = st.axis === "seq" ? ev.pos + 0.5 : ev[`${side}_x`];
    if (ev.phase !== lane.phase || seq == null || ex == null) continue;
    const dist = Math.abs(L.xaxis.l2p(ex) - px);
    if (dist <= REACH_PX && (!best || dist < best.dist)) best = { dist, seq, side, pos: ev.pos };
  }
  if (best) emit(EV.selectEvent, { rank: st.rank, side: best.side, seq: best.seq, pos: best.pos, source: "timeline" });
}

let relayoutTimer = null;
function onRelayout(ev) {
  if (ev["xaxis.autorange"]) {
    cancelPending();
    relayoutTimer = setTimeout(() => refresh({ overviewToo: false }), 60);
    return;
  }
  const a = ev["xaxis.range[0]"] ?? (ev["xaxis.range"] && ev["xaxis.range"][0]);
  const b = ev["xaxis.range[1]"] ?? (ev["xaxis.range"] && ev["xaxis.range"][1]);
  if (a == null || b == null) return;
  cancelPending(); // a drag wins over a bin click still waiting
  st.token += 1; // and over any window still on its way: it was asked for from the view the drag left
  relayoutTimer = setTimeout(() => refresh({ start: a, end: b, overviewToo: false }), 120);
}

// -- the overview strip --------------------------------------------------------------------
function drawOverview() {
  const o = st.overview;
  const d = st.data;
  if (!o || !d || !window.Plotly) return;
  const b = o.bins;
  let x;
  const z = [];
  const text = [];
  if (o.mode === "bins") {
    x = Array.from({ length: b.count }, (_, i) => b.start + (i + 0.5) * b.width);
    for (const side of ["a", "b"]) {
      const lanes = b.lanes.filter((l) => l.side === side);
      const worst = x.map((_, i) => Math.max(...lanes.map((l) => (l.n[i] ? l.status[i] : 0))));
      const n = x.map((_, i) => lanes.reduce((acc, l) => acc + l.n[i], 0));
      const dv = x.map((_, i) => lanes.reduce((acc, l) => acc + l.diverged[i], 0));
      z.push(worst.map((w, i) => (n[i] ? w : null)));
      text.push(n.map((k, i) => `${side.toUpperCase()}: ${count(k)} events${dv[i] ? `, ${count(dv[i])} diverged` : ""}`));
    }
  } else {
    x = o.events.map((e) => (st.axis === "seq" ? e.pos + 0.5 : e.a_x ?? e.b_x));
    for (const side of ["a", "b"]) {
      z.push(o.events.map((e) => (e[`${side}_seq`] == null ? null : CODES.indexOf(STATUS_OF_ROW[e.status]))));
      text.push(o.events.map((e) => `${side.toUpperCase()}: ${esc(e.phase)} ${esc(e.boundary)} (${esc(rowStatus(e))})`));
    }
  }
  const shapes = [{ type: "rect", x0: d.start, x1: d.end, y0: -0.5, y1: 1.5, line: { color: "#2f5fd0", width: 1.5 }, fillcolor: "rgba(47,95,208,0.08)" }];
  if (o.pivot) {
    const xp = st.axis === "seq" ? o.pivot.pos + 0.5 : o.pivot.a_x;
    if (xp != null) shapes.push({ type: "line", x0: xp, x1: xp, y0: -0.5, y1: 1.5, line: { color: PIVOT_COLOR, width: 2 } });
  }
  const layout = {
    margin: { l: 104, r: 14, t: 4, b: 18 },
    height: 78,
    showlegend: false,
    dragmode: false,
    plot_bgcolor: "#fff",
    paper_bgcolor: "#fff",
    font: { family: getComputedStyle(document.body).fontFamily, size: 11, color: "#5f6b7a" },
    xaxis: { range: o.extent, fixedrange: true, showgrid: false, zeroline: false, ...xTicks() },
    yaxis: { range: [1.5, -0.5], fixedrange: true, tickvals: [0, 1], ticktext: ["run A", "run B"], showgrid: false, zeroline: false },
    shapes,
  };
  const node = $(SEL.overview);
  window.Plotly.react(node, [{ type: "heatmap", x, y: [0, 1], z, text, hoverinfo: "text", zmin: 0, zmax: CODES.length - 1, colorscale: colorscale(), showscale: false, ygap: 2, hoverongaps: false }], layout, { displayModeBar: false, responsive: true });
  if (!node.dataset.wired) {
    node.dataset.wired = "1";
    node.on("plotly_click", (ev) => {
      const p = ev.points && ev.points[0];
      if (!p || !st.data) return;
      const half = (st.data.end - st.data.start) / 2;
      refresh({ start: p.x - half, end: p.x + half, overviewToo: false });
    });
  }
}

export const current = () => ({ rank: st.rank, axis: st.axis, data: st.data });
