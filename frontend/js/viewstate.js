// The view in the URL, so that a reload or a shared link opens the same view:
//   #/c/<id>?rank=1&axis=time&w=0.0125,0.0803&draw=slices&sel=1.a.123.456&rules=<rule set id>@3&trail=<node>
// rank, axis and w (the timeline window, in what the axis shows: positions or seconds; "all" for
// the whole rank), draw (squares, slices or merged), sel (rank.side.seq.pos of the selected
// event), rules (the rule set and version the view was made under, "none" without one) and
// trail (the propagation view's clicked nodes from the pivot). Moving the window or selecting an
// event replaces the current history entry; a step in the propagation view pushes a new one, so
// Back and Forward walk the trail.
//
// The timeline asks `pending(c)` when it first draws a comparison; the selected event and the
// trail are handed to the other views by events (dom.js EV). This module draws nothing but the
// note that a link was made under another rule-set version (the view shows the current result),
// with a button that reopens the result under the link's version.

import { api, comparisonPath } from "./api.js";
import { $, EV, SEL, el, emit, fill, on, show, toast } from "./dom.js";

const st = {
  cid: null, // the comparison the URL describes
  link: null, // what the URL held when that comparison was opened
  taken: false, // the timeline has had the link's window
  handed: false, // the panels have had the link's selected event
  trail: null, // the link's trail, until the propagation view is ready for it
  view: {}, // {rank, axis, w, sel, rules, trail}: what the next URL says
};

const finite = (x) => x != null && x !== "" && Number.isFinite(Number(x)); // Number(null) is 0

// the view a hash describes, or null for no comparison
export function parse(hash = location.hash) {
  const m = hash.match(/^#\/c\/([\w-]+)(?:\?(.*))?$/);
  if (!m) return null;
  const p = new URLSearchParams(m[2] || "");
  const v = { cid: m[1] };
  if (finite(p.get("rank"))) v.rank = Number(p.get("rank"));
  if (["seq", "time"].includes(p.get("axis"))) v.axis = p.get("axis");
  if (["squares", "slices", "merged"].includes(p.get("draw"))) v.draw = p.get("draw");
  const w = p.get("w");
  if (w === "all") v.w = "all";
  else if (w) {
    const [a, b] = w.split(",");
    if (finite(a) && finite(b) && Number(a) < Number(b)) v.w = [Number(a), Number(b)];
  }
  const sel = (p.get("sel") || "").split(".");
  if (sel.length === 4 && finite(sel[0]) && ["a", "b"].includes(sel[1]) && finite(sel[2]) && finite(sel[3])) {
    v.sel = { rank: Number(sel[0]), side: sel[1], seq: Number(sel[2]), pos: Number(sel[3]) };
  }
  if (p.get("rules")) v.rules = p.get("rules");
  const trail = p.getAll("trail").filter(Boolean);
  if (trail.length) v.trail = trail;
  return v;
}

// the hash for a view; what it does not know is left out
export function format(cid, v) {
  const p = new URLSearchParams();
  if (v.rank != null) p.set("rank", String(v.rank));
  if (v.axis) p.set("axis", v.axis);
  if (v.w === "all") p.set("w", "all");
  else if (Array.isArray(v.w)) p.set("w", v.w.map((x) => String(Number(x.toPrecision(9)))).join(","));
  if (v.draw && v.draw !== "squares") p.set("draw", v.draw);
  if (v.sel) p.set("sel", [v.sel.rank, v.sel.side, v.sel.seq, v.sel.pos].join("."));
  if (v.rules) p.set("rules", v.rules);
  for (const id of v.trail || []) p.append("trail", id);
  const q = p.toString();
  return `#/c/${cid}${q ? `?${q}` : ""}`;
}

const rulesOf = (c) => (c.rule_set ? `${c.rule_set.id}@${c.rule_set.version}` : "none");

// a comparison opened (or its new revision): the link it was opened with, read once
function enter(c) {
  if (c.id === st.cid) return;
  const link = parse();
  st.cid = c.id;
  st.link = link && link.cid === c.id ? link : null;
  st.taken = false;
  st.handed = false;
  st.trail = st.link && st.link.trail ? st.link.trail : null;
  const { cid, ...view } = st.link || {};
  st.view = view;
  linkNote(c);
}

// what the timeline should show first for comparison c, once: the link's view, or null
export function pending(c) {
  enter(c);
  if (st.taken || !st.link) return null;
  st.taken = true;
  const v = st.link;
  if (v.rank == null && !v.axis && !v.w && !v.sel && !v.draw) return null;
  const selected = v.sel && c.ranks.includes(v.sel.rank) ? { ...v.sel, source: "restore" } : null;
  return { rank: v.rank, axis: v.axis, window: v.w, draw: v.draw, selected };
}

// a replaced entry is written once the events of the moment are handled (history.replaceState costs
// a few ms, and a zoom or a selection would wait for it before its frame); a pushed one at once,
// after the replaced one still waiting (Back returns to the entry as it was before the step)
const later = { timer: null, url: null, cid: null };
function write(push = false) {
  const url = st.cid ? format(st.cid, st.view) : null;
  if (!push) {
    Object.assign(later, { url, cid: st.cid });
    if (later.timer === null) later.timer = setTimeout(flush, 0);
    return;
  }
  flush();
  put(st.cid, url, true);
}

function flush() {
  clearTimeout(later.timer);
  const { cid, url } = later;
  Object.assign(later, { timer: null, url: null, cid: null });
  if (url) put(cid, url, false);
}

function put(cid, url, push) {
  const here = parse();
  if (!cid || !here || here.cid !== cid || cid !== st.cid) return; // the page is elsewhere now
  if (url === location.hash) return;
  history[push ? "pushState" : "replaceState"]({ bitguard: 1 }, "", url);
}

// a link made under another rule-set version: said, since the result shown is the current one's
function linkNote(c) {
  const node = $(SEL.linkNote);
  const want = st.link && st.link.rules;
  if (!want || want === rulesOf(c)) {
    show(node, false);
    return;
  }
  const [id, version] = want.split("@");
  const then = want === "none" ? "without rules" : c.rule_set && c.rule_set.id === id
    ? `with version ${version} of rule set ${c.rule_set.name}` : "with another rule set";
  const now = c.rule_set ? `version ${c.rule_set.version} of rule set ${c.rule_set.name}` : "no rules";
  const known = want === "none" || (c.rule_set && c.rule_set.id === id && Number(version) >= 1);
  fill(node, el("span", {}, `This link was made ${then}; the comparison now uses ${now}, and that is what is shown.`),
    known ? el("button", { id: "link-reopen", class: "btn small", onclick: () => reopen(c, want) }, want === "none" ? "Reopen it without rules" : `Reopen it under version ${version}`) : null);
  show(node, true);
}

// rerun the comparison under the link's rule-set version (the server keeps every saved version)
async function reopen(c, want) {
  const [id, version] = want.split("@");
  const body = want === "none" ? { rule_set_id: null, keep_rule_set: false } : { rule_set_id: id, keep_rule_set: false, rule_set_version: Number(version) };
  try {
    const again = await api.post(comparisonPath(c.id, "/rerun"), body);
    emit(EV.rulesSaved, { comparison: again }); // app.js polls until the new revision is ready
  } catch (e) {
    toast(e.message, "error");
  }
}

// Back or Forward (or an edited hash) within the same comparison: show that entry's view
function onPop() {
  clearTimeout(later.timer); // a replace still waiting was for the entry left: it must not overwrite this one
  Object.assign(later, { timer: null, url: null, cid: null });
  const v = parse();
  if (!v || v.cid !== st.cid) {
    st.cid = null; // another comparison or the home view: app.js opens it, and enter() reads its link
    return;
  }
  const { cid, ...view } = v;
  const was = st.view;
  st.view = view;
  const moved = view.rank !== was.rank || view.axis !== was.axis || view.draw !== was.draw || JSON.stringify(view.w) !== JSON.stringify(was.w);
  if (moved && (view.w || view.sel)) emit(EV.restoreView, { rank: view.rank, axis: view.axis, window: view.w, draw: view.draw || "squares", selected: view.sel ? { ...view.sel, source: "restore" } : null });
  if (view.sel && JSON.stringify(view.sel) !== JSON.stringify(was.sel)) emit(EV.selectEvent, { ...view.sel, source: moved ? "restore" : "link" });
  if (JSON.stringify(view.trail || []) !== JSON.stringify(was.trail || [])) emit(EV.showTrail, view.trail || []);
}

export function init() {
  on(EV.comparisonLoaded, (c) => {
    enter(c); // the timeline may have done it already (pending), before this listener
    if (!st.handed && st.link && st.link.sel && c.ranks.includes(st.link.sel.rank)) {
      emit(EV.selectEvent, { ...st.link.sel, source: "restore" }); // the panel; the timeline has it from pending()
    }
    st.handed = true;
    linkNote(c); // a re-run may have brought the link's version back, or left it
    st.view.rules = rulesOf(c);
    write();
  });
  on(EV.timelineDrawn, (d) => {
    if (d.comparison !== st.cid) return;
    Object.assign(st.view, { rank: d.rank, axis: d.axis, w: d.window, draw: d.draw });
    write();
  });
  on(EV.selectEvent, (s) => {
    if (s.pos == null || s.seq == null) return;
    st.view.sel = { rank: s.rank, side: s.side, seq: s.seq, pos: s.pos };
    write();
  });
  on(EV.trailChanged, ({ trail, push }) => {
    st.view.trail = trail.length > 1 ? trail.slice(1) : undefined; // the pivot starts every trail
    write(push);
  });
  on(EV.propagationReady, (c) => {
    if (c.id !== st.cid || !st.trail) return;
    const trail = st.trail;
    st.trail = null;
    emit(EV.showTrail, trail);
  });
  window.addEventListener("popstate", onPop);
  window.addEventListener("hashchange", onPop);
}
