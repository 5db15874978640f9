// Every element id and event name the front end uses, in one place. The browser tests read
// the same ids (tests/browser/pages.py mirrors SEL), so a renamed element fails loudly.

export const SEL = {
  // shell
  title: "#title",
  perfetto: "#perfetto",
  toast: "#toast",
  viewHome: "#view-home",
  viewComparison: "#view-comparison",
  viewAlerts: "#view-alerts",
  alertsBody: "#alerts-body",
  viewViolations: "#view-violations",
  violationsBody: "#violations-body",
  // upload (home)
  pickA: "#pick-a",
  pickB: "#pick-b",
  statusA: "#status-a",
  statusB: "#status-b",
  progressA: "#progress-a",
  progressB: "#progress-b",
  homeRuleSet: "#home-ruleset",
  homeResumedAt: "#home-resumed-at",
  compare: "#compare",
  comparisonsTable: "#comparisons-table",
  runsTable: "#runs-table",
  // comparison view
  banner: "#cmp-status",
  cmpGrid: "#cmp-grid",
  pivotMoved: "#pivot-moved",
  summary: "#summary",
  rankSelect: "#rank-select",
  axisToggle: "#axis-toggle",
  gotoPivot: "#goto-pivot",
  wholeRank: "#whole-rank",
  prevDivergence: "#prev-divergence",
  nextDivergence: "#next-divergence",
  prevGap: "#prev-gap",
  nextGap: "#next-gap",
  drawToggle: "#draw-toggle",
  zoomIn: "#zoom-in",
  zoomOut: "#zoom-out",
  navInfo: "#nav-info",
  searchForm: "#search-form",
  search: "#search",
  searchPrev: "#search-prev",
  searchNext: "#search-next",
  searchInfo: "#search-info",
  keysHelp: "#keys-help",
  keysOverlay: "#keys-overlay",
  linkNote: "#link-note",
  legend: "#legend",
  overview: "#overview",
  timeline: "#timeline",
  timelineInfo: "#timeline-info",
  propagation: "#propagation",
  propBack: "#prop-back",
  propForward: "#prop-forward",
  propCrumbs: "#prop-crumbs",
  propTotal: "#prop-total",
  pivotPanel: "#pivot-panel",
  drillButton: "#drill-down",
  drillPanel: "#drill-panel",
  detailPanel: "#detail-panel",
  rulesPanel: "#rules-panel",
  lossPanel: "#loss-panel",
  divergencesPanel: "#divergences-panel",
};

export const EV = {
  comparisonLoaded: "bitguard:comparison-loaded", // detail: comparison (status ready)
  selectEvent: "bitguard:select-event", // detail: {rank, pos, side, seq, source}
  markBenign: "bitguard:mark-benign", // detail: event detail from the API
  rulesSaved: "bitguard:rules-saved", // detail: {ruleSet, comparison}
  timelineDrawn: "bitguard:timeline-drawn", // detail: {rank, axis, start, end, mode}
  drillRequested: "bitguard:drill-requested", // detail: none (drill the loaded comparison's pivot)
  trailChanged: "bitguard:trail-changed", // detail: {trail: [node ids], push} (a propagation step when push)
  showTrail: "bitguard:show-trail", // detail: [node ids] (a trail to show again: a link, the back button)
  propagationReady: "bitguard:propagation-ready", // detail: comparison (its pivot column is drawn)
  restoreView: "bitguard:restore-view", // detail: {rank, axis, window} (a link's timeline window)
};

// plotly.js (the installed plotly package's bundle, 4.8 MB) draws the loss curve and the drill's
// figures, never the timelines. Compiling it takes the main thread for a second or more, so it is
// loaded only when one of those figures asks, and not before the comparison's timelines are drawn
// (or 3 s have passed): a first view never waits for it. Resolves with window.Plotly.
let plotlyLoad = null;
let drawnOnce = false;
document.addEventListener(EV.timelineDrawn, () => (drawnOnce = true), { once: true });
export function plotly() {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!plotlyLoad) {
    plotlyLoad = new Promise((resolve) => {
      let started = false;
      const go = () => {
        if (started) return;
        started = true;
        const s = document.createElement("script");
        s.src = "/static/vendor/plotly.min.js";
        s.async = true;
        s.onload = () => {
          window.dispatchEvent(new Event("plotly-ready"));
          resolve(window.Plotly);
        };
        document.head.append(s);
      };
      if (drawnOnce) go();
      else {
        const timer = setTimeout(go, 3000);
        document.addEventListener(EV.timelineDrawn, () => {
          clearTimeout(timer);
          requestAnimationFrame(() => setTimeout(go, 0)); // after the drawn frame is painted
        }, { once: true });
      }
    });
  }
  return plotlyLoad;
}

export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

export function emit(name, detail) {
  document.dispatchEvent(new CustomEvent(name, { detail }));
}

export function on(name, fn) {
  document.addEventListener(name, (e) => fn(e.detail));
}

// el("div", {class: "x", onclick: f}, "text", child...) -> a new element
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") node.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// replace a node's children, skipping null/false (what el() skips too)
export function fill(node, ...children) {
  const target = typeof node === "string" ? $(node) : node;
  target.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  return target;
}

export function show(sel, visible = true) {
  const node = typeof sel === "string" ? $(sel) : sel;
  node.classList.toggle("hidden", !visible);
}

let toastTimer = null;
export function toast(message, kind = "info") {
  const t = $(SEL.toast);
  t.textContent = message;
  t.className = `toast ${kind}`;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => (t.className = "toast hidden"), kind === "error" ? 8000 : 3500);
}
