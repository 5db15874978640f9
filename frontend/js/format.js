// How values read on screen: statuses and their colours, sizes, durations, digests.

// how each of the server's status_codes looks; their order (worst last) is the server's, sent
// with every timeline window
export const STATUS = {
  empty: { label: "none", color: "#f1f3f5" },
  identical: { label: "identical", color: "#b9dcc3" },
  benign: { label: "benign", color: "#8fb8e8" },
  follows: { label: "follows an accepted difference", color: "#c3d5ea" },
  unobserved: { label: "not observed (cannot certify)", color: "#bdbdbd" },
  gap: { label: "gap (one side only)", color: "#f2a65a" },
  diverged: { label: "diverged", color: "#d6453d" },
};
export const UNKNOWN_STATUS = { label: "other", color: "#9aa5b1" };
// the status code each event status is drawn as (only_a, only_b: gap): the server's, from
// /api/schema's status_of_event, filled by useVocabulary before a comparison is shown
export const STATUS_OF_ROW = {};
export function useVocabulary(schema) {
  Object.assign(STATUS_OF_ROW, schema.status_of_event);
  return schema;
}
export const PREFIX_FILL = "rgba(46, 160, 90, 0.10)";
export const PIVOT_COLOR = "#7a1fa2";
export const SELECT_COLOR = "#111827";

export function bytes(n) {
  if (n == null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

export function duration(ns) {
  if (ns == null || Number.isNaN(ns)) return "";
  const a = Math.abs(ns);
  if (a >= 1e9) return `${(ns / 1e9).toFixed(3)} s`;
  if (a >= 1e6) return `${(ns / 1e6).toFixed(3)} ms`;
  if (a >= 1e3) return `${(ns / 1e3).toFixed(1)} µs`;
  return `${Math.round(ns)} ns`;
}

// Plotly draws a subset of HTML in labels, tick text and hover text (<a>, <b>, <span style>...).
// Every string that comes from a run (boundary, phase, module type, status...) goes through
// this before it reaches plotly, so it shows as the text it is; plotly turns the entities back.
export function plotText(value) {
  return String(value ?? "").replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

// "benign (rule R)" for a difference a rule accepted, "benign" when the rule is not named
export const benignLabel = (ruleId) => (ruleId ? `benign (rule ${ruleId})` : "benign");

// an event row's status as words: rules named where a rule accepted (or explains) the difference
export function rowStatus(e) {
  if (e.status === "benign") return benignLabel(e.rule_id);
  if (e.status === "follows") return e.rule_id ? `follows accepted difference (rule ${e.rule_id})` : "follows an accepted difference";
  return e.status;
}

// one formatter for every count: toLocaleString makes a new one per call, and a timeline's hover
// texts ask for thousands (a zoom spent 120 ms of its 450 there)
const COUNT = new Intl.NumberFormat("en-US");
export const count = (n) => (n == null ? "" : COUNT.format(Number(n)));

export function when(seconds) {
  if (!seconds) return "";
  const d = new Date(seconds * 1000);
  return d.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" });
}

export const shape = (s) => (Array.isArray(s) ? `[${s.join(", ")}]` : s == null ? "" : String(s));

export function sideName(side) {
  return side === "a" ? "A" : "B";
}

export function eventTitle(e) {
  return `${e.phase} ${e.boundary}`;
}

export function slug(text) {
  return String(text || "rule").toLowerCase().replace(/[^a-z0-9_.:-]+/g, "-").replace(/^-+|-+$/g, "").slice(0, 60) || "rule";
}

export const today = () => new Date().toISOString().slice(0, 10);
