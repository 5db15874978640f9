// The explorer's shell: routes between the home view (#/) and a comparison (#/c/<id>), polls a
// comparison until it is ready, and announces it to the views. Each view is its own module and
// listens for the events in dom.js; none of them calls another directly.

import { api, comparisonPath } from "./api.js";
import { $, EV, SEL, el, emit, on, show, fill } from "./dom.js";
import { count, useVocabulary } from "./format.js";
import * as alerts from "./alerts.js";
import * as detail from "./detail.js";
import * as divergences from "./divergences.js";
import * as download from "./download.js";
import * as drill from "./drill.js";
import * as keys from "./keys.js";
import * as loss from "./loss.js";
import * as pivot from "./pivot.js";
import { inconclusiveReasons, reasonList } from "./pivot.js";
import * as propagation from "./propagation.js";
import * as rules from "./rules.js";
import * as search from "./search.js";
import * as timeline from "./timeline.js";
import * as upload from "./upload.js";
import * as violations from "./violations.js";
import * as viewstate from "./viewstate.js";

const st = { id: null, loaded: null, poll: null, firstDraw: false, vocabulary: null };

function route() {
  clearTimeout(st.poll);
  show(SEL.viewAlerts, false);
  show(SEL.viewViolations, false);
  const r = location.hash.match(/^#\/r\/([\w-]+)\/alerts/);
  if (r) return openAlerts(r[1]);
  const v = location.hash.match(/^#\/r\/([\w-]+)\/violations/);
  if (v) return openRunView(SEL.viewViolations, () => violations.open(v[1]));
  const m = location.hash.match(/^#\/c\/([\w-]+)/);
  if (m) openComparison(m[1]);
  else openHome();
}

// a run's own view (violations.js): the home and comparison views hidden
function openRunView(view, open) {
  show(SEL.viewHome, false);
  show(SEL.viewComparison, false);
  show(SEL.perfetto, false);
  show(view, true);
  open();
}

// an online-mode run's alerts (alerts.js)
function openAlerts(runId) {
  show(SEL.viewHome, false);
  show(SEL.viewComparison, false);
  show(SEL.perfetto, false);
  show(SEL.viewAlerts, true);
  alerts.open(runId);
}

function openHome() {
  st.id = null;
  st.loaded = null;
  show(SEL.viewComparison, false);
  show(SEL.viewHome, true);
  show(SEL.perfetto, false);
  upload.open();
}

function openComparison(id) {
  show(SEL.viewHome, false);
  show(SEL.viewComparison, true);
  if (st.id !== id) {
    st.id = id;
    st.loaded = null;
    st.firstDraw = false;
    performance.mark("bitguard:open");
    clearComparison(); // nothing of the comparison shown before stays on screen under this one's title
  }
  poll(id);
}

function clearComparison() {
  document.title = "bitguard explorer";
  fill($(SEL.title));
  fill($(SEL.summary));
  show(SEL.perfetto, false);
  show(SEL.cmpGrid, false); // shown again when this comparison is ready
  show(SEL.pivotMoved, false);
}

// after a re-run, where the pivot went: "Pivot moved: model.probe (step 0 · forward) → model.layers.2
// (step 1 · forward), 15 events later", or that it stayed
function pivotMoved(before, after) {
  const fa = before.summary && before.summary.first_divergence;
  const fb = after.summary && after.summary.first_divergence;
  const name = (fd) => (fd ? `${fd.boundary} (step ${fd.step} · ${fd.phase}${fd.rank ? ` · rank ${fd.rank}` : ""})` : "no divergence");
  const pa = before.pivot_position;
  const pb = after.pivot_position;
  const same = name(fa) === name(fb) && (pa && pa.pos) === (pb && pb.pos);
  let shift = "";
  if (pa && pb && pa.rank === pb.rank && pa.pos !== pb.pos) {
    const n = pb.pos - pa.pos;
    shift = `, ${count(Math.abs(n))} event${Math.abs(n) === 1 ? "" : "s"} ${n > 0 ? "later" : "earlier"}`;
  }
  const b = $(SEL.pivotMoved);
  b.dataset.moved = String(!same);
  fill(b, same ? `The pivot stayed at ${name(fb)} (revision ${after.revision}).`
    : el("span", {}, el("b", {}, "Pivot moved: "), `${name(fa)} → ${name(fb)}${shift} (revision ${before.revision} → ${after.revision}).`));
  show(b, true);
}

// a comparison the server cannot give: said for the person who followed the link, with a way back
function unavailable(id, e) {
  clearComparison();
  const what = e.type === "NotFound"
    ? [`There is no comparison “${id}” in this workspace. The link may be mistyped or cut short, or the comparison was deleted.`]
    : ["This comparison cannot be opened: ", e.message];
  banner("error", el("div", { id: "cmp-unavailable" }, ...what), el("div", {}, el("a", { href: "#/", class: "btn small" }, "Back to the comparisons")));
}

function banner(kind, ...content) {
  const b = $(SEL.banner);
  b.className = `banner ${kind}`;
  fill(b, ...content);
  show(b, kind !== "none");
}

async function poll(id) {
  let c;
  try {
    // the statuses' vocabulary (once, beside the first poll): the views draw with it
    st.vocabulary = st.vocabulary || api.get("/api/schema").then(useVocabulary);
    [c] = await Promise.all([api.get(comparisonPath(id)), st.vocabulary]);
  } catch (e) {
    if (!st.loaded) st.vocabulary = null; // asked again with the next poll
    if (st.id !== id) return;
    if (e.type === "NotFound" || !st.loaded) unavailable(id, e);
    else banner("error", e.message); // the comparison on show stays: the server did not answer this once
    return;
  }
  if (st.id !== id) return;
  header(c);
  if (c.status === "ready") {
    verdictBanner(c);
    if (!st.loaded || st.loaded.revision !== c.revision) {
      if (!st.loaded) performance.mark("bitguard:ready");
      else pivotMoved(st.loaded, c);
      st.loaded = c;
      summary(c);
      show(SEL.cmpGrid, true);
      emit(EV.comparisonLoaded, c);
    }
    return;
  }
  if (c.status === "failed") {
    banner("error", el("b", {}, `${c.error.type}: `), c.error.message);
    return;
  }
  const why = st.loaded ? `Re-running with ${c.rule_set ? `rule set ${c.rule_set.name} v${c.rule_set.version}` : "no rules"}…` : `Comparing ${c.run_a.name} with ${c.run_b.name}…`;
  banner("busy", el("span", { class: "spinner" }), why);
  st.poll = setTimeout(() => poll(id), 150);
}

// an inconclusive verdict is never shown as "identical": its own banner, with the engine's reasons
function verdictBanner(c) {
  if (c.verdict !== "inconclusive") {
    banner("none");
    return;
  }
  const reasons = inconclusiveReasons(c.summary);
  banner("inconclusive",
    el("div", {}, el("b", {}, "Inconclusive: "), c.summary && c.summary.first_divergence
      ? "the runs part at the pivot below, and part of them could not be compared:"
      : "no divergence was found in what could be compared, but these runs cannot be certified identical:"),
    reasons.length ? reasonList(reasons) : el("div", {}, "(the engine gave no reason)"));
}

function header(c) {
  document.title = `${c.run_a.name} vs ${c.run_b.name} · bitguard`;
  fill($(SEL.title), el("span", { class: "title" },
    el("span", { class: "side-tag a" }, "A"), el("span", { class: "run", title: c.run_a.id }, c.run_a.name),
    el("span", { class: "vs" }, "vs"),
    el("span", { class: "side-tag b" }, "B"), el("span", { class: "run", title: c.run_b.id }, c.run_b.name),
    c.resumed_at ? el("span", { class: "note", id: "resumed-at", title: `B's step s is compared with A's step ${c.resumed_at} + s` }, `resumed at step ${c.resumed_at}`) : null,
    c.verdict ? el("span", { class: `badge ${c.verdict}`, id: "verdict" }, c.verdict) : null,
  ));
  const link = $(SEL.perfetto);
  link.href = comparisonPath(c.id, "/perfetto");
  show(link, c.status === "ready");
}

function stat(k, v, cls = "", attrs = {}) {
  return el("div", { class: `stat ${cls}`, ...attrs }, el("div", { class: "k" }, k), el("div", { class: "v" }, v));
}

// "1 rank", "4 ranks: 0, 1, 2, 3" (eight named at most)
export function ranksText(ranks) {
  const r = ranks || [];
  if (r.length === 1) return "1 rank";
  const named = r.length > 8 ? `${r.slice(0, 8).join(", ")}…` : r.join(", ");
  return r.length ? `${count(r.length)} ranks: ${named}` : "none";
}

// the pivot named by its module, then when: "model.layers.2 · step 1 · forward"
function pivotStat(fd) {
  if (!fd) return stat("pivot", "—");
  const where = `step ${fd.step} · ${fd.phase}${fd.rank != null && fd.rank !== 0 ? ` · rank ${fd.rank}` : ""}`;
  const type = fd.module_type && fd.module_type !== fd.boundary ? ` (${fd.module_type})` : "";
  return stat("pivot", el("span", {}, el("span", { class: "mono" }, fd.boundary), el("span", { class: "sub" }, `${type} · ${where}`)), "pivot", { id: "summary-pivot" });
}

function summary(c) {
  const s = c.summary || {};
  const al = s.alignment || {};
  const fd = s.first_divergence;
  const fired = (s.rules_fired || []).reduce((acc, r) => acc + r.count, 0);
  fill($(SEL.summary), 
    stat("verdict", c.verdict, `verdict ${c.verdict}`),
    pivotStat(fd),
    stat("events A / B", `${count(al.events_a)} / ${count(al.events_b)}`),
    stat("matched", count(al.matched)),
    stat("identical prefix", count(al.identical_prefix)),
    stat("gaps A / B", `${count(al.gaps_a)} / ${count(al.gaps_b)}`),
    stat("ranks", ranksText(c.ranks), "", { id: "summary-ranks" }),
    stat("rules fired", count(fired)),
    s.manifest_diffs && s.manifest_diffs.length ? stat("setup differs", s.manifest_diffs.map((d) => d.field).slice(0, 3).join(", "), "") : null,
  );
}

function init() {
  timeline.init();
  pivot.init();
  drill.init();
  detail.init();
  download.init();
  propagation.init();
  rules.init();
  loss.init();
  divergences.init();
  upload.init();
  search.init();
  keys.init();
  viewstate.init(); // after the views: the URL's selection reaches a panel that has reset for its comparison
  on(EV.rulesSaved, () => st.id && poll(st.id));
  on(EV.timelineDrawn, (d) => {
    // the benchmark and the browser tests wait for this: the comparison is drawn
    if (!st.firstDraw) {
      st.firstDraw = true;
      performance.mark("bitguard:first-draw"); // after bitguard:ready, the poll that saw it ready
    }
    document.body.dataset.drawnRevision = String(d.revision);
  });
  window.addEventListener("hashchange", route);
  if (!location.hash) location.hash = "#/";
  else route();
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
else init();
