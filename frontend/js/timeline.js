// The comparison view's two matched timelines: run A's lanes above run B's, one lane per
// phase, for one rank, by aligned position or by time. The server sends a window at a time,
// binned when it holds many events and event by event when few; zooming asks for the next
// window. An overview strip shows the whole rank and where the window is. Above them, steps to
// the next or previous divergent pair or gap (asked of the server's search, which knows them all
// in aligned order) and zoom in and out around the selected event or the window's middle.
// Both are drawn on canvas (chart.js) from lanes.js's layers: one draw per window, no plotly.

import { api, comparisonPath } from "./api.js";
import { $, $$, EV, SEL, el, emit, fill, on, toast } from "./dom.js";
import { pending } from "./viewstate.js";
import { Chart } from "./chart.js";
import { DETAIL, detailSpec, laneY, OVERVIEW, overviewSpec } from "./lanes.js";
import { count, duration, PIVOT_COLOR, PREFIX_FILL, STATUS, UNKNOWN_STATUS } from "./format.js";

let CODES = Object.keys(STATUS); // replaced by the server's status_codes with every window
const look = (code) => STATUS[code] || UNKNOWN_STATUS;
const SPAN = 240; // events in a window opened around one event
const BINS = 900;
// a click on a bin zooms in, but only once it is known not to be the first click of a double-click
const DOUBLE_CLICK_MS = 300;

const st = {
  c: null, // the comparison
  rank: 0,
  axis: "seq",
  draw: "squares", // how a window of events is drawn: squares | slices | merged (slices.js)
  data: null, // the last detail window from the server
  overview: null,
  selected: null, // {rank, pos, side, seq}
  token: 0, // the latest detail request; older answers are dropped
  detail: null, // the charts (chart.js), made by init()
  strip: null,
};

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
  st.detail = new Chart(plot, { ...DETAIL, zoom: true, onZoom, onClick: onDetailClick, onPress: () => clearTimeout(clickTimer), onResize: drawDetail });
  st.strip = new Chart($(SEL.overview), { ...OVERVIEW, zoom: false, onClick: onOverviewClick, onResize: drawOverview });
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
  await st.detail.released();
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

// -- drawing ---------------------------------------------------------------------------------
const view = () => ({ axis: st.axis, draw: st.draw, selected: st.selected, rank: st.rank, codes: CODES, plotW: st.detail.plotWidth() });

function drawDetail() {
  const d = st.data;
  if (!d) return;
  st.detail.draw(detailSpec(d, view()).spec);
  const node = $(SEL.timeline);
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

function drawOverview() {
  const o = st.overview;
  const d = st.data;
  if (!o || !d) return;
  st.strip.draw(overviewSpec(o, d, view()));
}

// -- clicks and drags ----------------------------------------------------------------------------
let clickTimer = null;
function cancelPending() {
  clearTimeout(clickTimer);
}

// a drag over the detail plot: the window it covers, asked for at once (the drag is over)
function onZoom(a, b) {
  cancelPending(); // a drag wins over a bin click still waiting
  st.token += 1; // and over any window still on its way: it was asked for from the view the drag left
  refresh({ start: a, end: b, overviewToo: false });
}

// a bin's zoom: four bins around x, once the click is known not to start a double-click (a press
// before then cancels it: chart.js's onPress)
function zoomAt(x) {
  const w = st.data.bins.width;
  clearTimeout(clickTimer);
  clickTimer = setTimeout(() => refresh({ start: x - 2 * w, end: x + 2 * w, overviewToo: false }), DOUBLE_CLICK_MS + 20);
}

// a click on the detail plot: the second of a double-click shows the whole rank; else a bin zooms,
// an event is selected, and a click beside the events selects the nearest one of that lane
const REACH_PX = 120;
function onDetailClick(c) {
  const d = st.data;
  if (!d) return;
  if (c.clicks >= 2) {
    cancelPending();
    wholeRank();
    return;
  }
  if (d.mode === "bins") {
    zoomAt(c.x);
    return;
  }
  if (c.hit) {
    if (!c.hit.custom) return; // a gap's mark: nothing to select
    const [side, seq, pos] = c.hit.custom;
    emit(EV.selectEvent, { rank: st.rank, side, seq, pos, source: "timeline" });
    return;
  }
  const geo = laneY(d, st.draw);
  let lane = null;
  for (const side of ["a", "b"]) {
    for (const phase of geo.phases) {
      if (Math.abs(geo.y[side][phase] - c.y) <= 0.5) lane = { side, phase };
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
    const dist = Math.abs(st.detail.x2p(ex) - c.px);
    if (dist <= REACH_PX && (!best || dist < best.dist)) best = { dist, seq, side, pos: ev.pos };
  }
  if (best) emit(EV.selectEvent, { rank: st.rank, side: best.side, seq: best.seq, pos: best.pos, source: "timeline" });
}

// a click on the overview strip: the window, its width kept, centred there
function onOverviewClick(c) {
  if (!st.data) return;
  const half = (st.data.end - st.data.start) / 2;
  cancelPending();
  refresh({ start: c.x - half, end: c.x + half, overviewToo: false });
}

export const current = () => ({ rank: st.rank, axis: st.axis, data: st.data });
