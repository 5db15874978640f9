// Keyboard shortcuts of the comparison view, and the "?" overlay that lists them. The table
// below is the one list: the overlay is drawn from it and README.md's "Keyboard" section repeats
// it (tests/browser/test_search_nav.py holds the two to each other). Keys typed into a field
// (the search box, a rule form) are the field's, except Escape.

import { $, SEL, el, fill, show } from "./dom.js";
import * as search from "./search.js";
import * as timeline from "./timeline.js";

// [keys shown, what it does, test of a KeyboardEvent, action]
const plain = (key) => (e) => e.key === key && !e.ctrlKey && !e.metaKey && !e.altKey;
export const SHORTCUTS = [
  [["→", "j"], "next event (aligned order)", (e) => plain("ArrowRight")(e) || plain("j")(e), () => timeline.stepEvent("next")],
  [["←", "k"], "previous event", (e) => plain("ArrowLeft")(e) || plain("k")(e), () => timeline.stepEvent("prev")],
  [["n"], "next divergent pair", plain("n"), () => timeline.nextDifference("diverged", "next")],
  [["Shift+N"], "previous divergent pair", plain("N"), () => timeline.nextDifference("diverged", "prev")],
  [["g"], "next gap (an event on one side only)", plain("g"), () => timeline.nextDifference("gap", "next")],
  [["Shift+G"], "previous gap", plain("G"), () => timeline.nextDifference("gap", "prev")],
  [["p"], "go to the pivot", plain("p"), () => timeline.gotoPivot()],
  [["+", "="], "zoom in", (e) => plain("+")(e) || plain("=")(e), () => timeline.zoom(0.5)],
  [["-"], "zoom out", plain("-"), () => timeline.zoom(2)],
  [["0"], "the whole rank", plain("0"), () => timeline.wholeRank()],
  [["t"], "by sequence / by time", plain("t"), () => timeline.toggleAxis()],
  [["d"], "draw events as squares / slices / merged A·B", plain("d"), () => timeline.cycleDraw()],
  [["/"], "search (Enter: next match, Shift+Enter: previous)", plain("/"), () => search.focus()],
  [["?"], "this list", plain("?"), () => help(true)],
  [["Esc"], "close this list, leave the search box", plain("Escape"), () => help(false)],
];

function typing(target) {
  return target && (target.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(target.tagName));
}

function help(open) {
  const overlay = $(SEL.keysOverlay);
  if (open && !overlay.firstChild) {
    const rows = SHORTCUTS.map(([keys, what]) => el("tr", {}, el("td", {}, ...keys.flatMap((k, i) => [i ? " or " : null, el("kbd", {}, k)])), el("td", {}, what)));
    fill(overlay, el("div", { class: "card", tabindex: -1 },
      el("h2", { id: "keys-title" }, "Keyboard shortcuts"),
      el("table", { class: "keys" }, el("tbody", {}, ...rows)),
      el("p", { class: "note" }, "Tab reaches the timeline (then ← → step through events) and each propagation node (Enter opens it)."),
      el("button", { class: "btn small", onclick: () => help(false) }, "Close")));
    overlay.addEventListener("click", (e) => e.target === overlay && help(false));
  }
  show(overlay, open);
  if (open) overlay.querySelector(".card").focus();
}

function onKey(e) {
  const comparison = !$(SEL.viewComparison).classList.contains("hidden");
  if (!comparison) return;
  if (typing(e.target) && e.key !== "Escape") return;
  const open = !$(SEL.keysOverlay).classList.contains("hidden");
  const hit = SHORTCUTS.find(([, , test]) => test(e));
  if (!hit || (open && e.key !== "Escape" && e.key !== "?")) return;
  if (e.key === "Escape" && typing(e.target)) {
    e.target.blur();
    return;
  }
  if (e.target.closest && e.target.closest("button, a") && (e.key === "Enter" || e.key === " ")) return;
  e.preventDefault();
  hit[3]();
}

export function init() {
  $(SEL.keysHelp).addEventListener("click", () => help(true));
  document.addEventListener("keydown", onKey);
}
