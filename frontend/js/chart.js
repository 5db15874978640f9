// A small canvas chart, for the timelines and their overview strip: one linear x axis (positions
// or seconds), rows on y drawn top down, layers of marks drawn in order (rects, points, segments,
// texts), tick and annotation labels as DOM text, a tooltip, picking, and a drag box that zooms
// along x. Every string reaches the page as textContent or canvas text, so a run's strings
// never become markup. draw() is synchronous: when it returns, the chart is drawn.
//
// Knows nothing of comparisons, events or requests: timeline.js says what to draw, and what a
// click, a double-click or a drag means. Each chart is reachable as `element.chart` (its layers,
// size and coordinate maps), which is what the browser tests read (tests/browser/pages.py).

const DRAG_PX = 4; // a press that moves farther than this is a drag, else a click
const DPR = () => window.devicePixelRatio || 1;

let fontFamily = null;
const family = () => (fontFamily = fontFamily || getComputedStyle(document.body).fontFamily || "sans-serif");

// about `want` round values (1, 2 or 5 times a power of ten) between lo and hi
export function niceTicks(lo, hi, want, least = 0) {
  const span = hi - lo;
  if (!(span > 0) || !Number.isFinite(span)) return { step: 1, values: [] };
  const raw = span / Math.max(want, 1);
  const p = 10 ** Math.floor(Math.log10(raw));
  let step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw) || 10 * p;
  if (step < least) step = least;
  const values = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) values.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return { step, values };
}

const at = (v, i) => (Array.isArray(v) ? v[i] : v);
// a layer's hover text: an array (one entry of lines per mark) or a function of the mark's index
export const hoverOf = (L, i) => (typeof L.hover === "function" ? L.hover(i) : L.hover ? L.hover[i] : null);

export class Chart {
  // opts: {height, margin: {l, r, t, b}, zoom: bool, onZoom(x0, x1), onClick(click), onPress(), onResize()}
  constructor(node, opts) {
    this.node = node;
    this.opts = opts;
    this.height = opts.height;
    this.margin = opts.margin;
    this.layers = [];
    this.labels = [];
    this.ticks = { x: [], y: [] };
    this.spec = null;
    this.width = 0;
    node.classList.add("chart");
    node.replaceChildren();
    this.canvas = document.createElement("canvas");
    this.text = document.createElement("div");
    this.text.className = "chart-text";
    this.box = document.createElement("div");
    this.box.className = "chart-box hidden";
    this.tip = document.createElement("div");
    this.tip.className = "chart-tip hidden";
    this.tip.setAttribute("role", "tooltip");
    node.append(this.canvas, this.text, this.box, this.tip);
    node.chart = this;
    this.press = null; // {px, py, x, moved}: the mouse is down on the plot
    this.waiting = [];
    this.hoverAt = null;
    this.canvas.addEventListener("mousedown", (e) => this.onDown(e));
    this.canvas.addEventListener("mousemove", (e) => this.onHover(e));
    this.canvas.addEventListener("mouseleave", () => this.hideTip());
    window.addEventListener("mousemove", (e) => this.onMove(e), true);
    window.addEventListener("mouseup", (e) => this.onUp(e), true);
    window.addEventListener("blur", () => this.cancelPress());
    new ResizeObserver(() => {
      const w = node.clientWidth;
      if (w && w !== this.width && this.spec) {
        this.width = w;
        if (opts.onResize) opts.onResize();
        else this.draw(this.spec);
      }
    }).observe(node);
  }

  // the plot area inside the element, in CSS pixels (kept from the last draw, or for this width)
  get size() {
    if (this.area && this.area.width === this.width) return this.area;
    const { l, r, t, b } = this.margin;
    return { l, t, w: Math.max(this.width - l - r, 10), h: Math.max(this.height - t - b, 10), width: this.width };
  }

  plotWidth() {
    if (!this.width) this.width = this.node.clientWidth; // once; a ResizeObserver keeps it after
    return this.size.w;
  }

  // data to plot-area pixels and back (as plotly's l2p / p2l: relative to the plot area)
  // (the scales are set by draw: x2p and y2p run for every mark)
  x2p(x) {
    return (x - this.kx[0]) * this.kx[1];
  }

  p2x(px) {
    return this.kx[0] + px / this.kx[1];
  }

  y2p(y) {
    return (y - this.ky[0]) * this.ky[1];
  }

  p2y(py) {
    return this.ky[0] + py / this.ky[1];
  }

  // spec: {x: [lo, hi], y: [top, bottom], xTicks: {format(v, step), least}, yTicks: [{v, text}],
  //        xTitle, layers: [...], labels: [{text, x, y: data y | "top" | "bottom", anchor, color, size, bold, name}]}
  // a layer: {kind: "rects" | "points" | "segments" | "texts", name, and its marks' arrays (see draw_*)};
  // one that can be picked has custom (one per mark) and/or hover (lines per mark, or a function of
  // the mark's index that makes them when the mark is hovered)
  draw(spec) {
    this.spec = spec;
    if (!this.width) this.width = this.node.clientWidth;
    const dpr = DPR();
    const W = this.width;
    const H = this.height;
    if (this.canvas.width !== Math.round(W * dpr) || this.canvas.height !== Math.round(H * dpr)) {
      this.canvas.width = Math.round(W * dpr);
      this.canvas.height = Math.round(H * dpr);
      this.canvas.style.width = `${W}px`;
      this.canvas.style.height = `${H}px`;
    }
    const g = this.canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.fillStyle = "#fff";
    g.fillRect(0, 0, W, H);
    this.area = null;
    const s = (this.area = this.size);
    this.kx = [spec.x[0], s.w / (spec.x[1] - spec.x[0])];
    this.ky = [spec.y[0], s.h / (spec.y[1] - spec.y[0])];
    const xt = spec.xTicks || {};
    const { step, values } = niceTicks(spec.x[0], spec.x[1], Math.max(2, Math.floor(s.w / 90)), xt.least || 0);
    this.ticks = {
      x: values.map((v) => ({ v, text: xt.format ? xt.format(v, step) : String(v) })),
      y: spec.yTicks || [],
    };
    g.save();
    g.translate(s.l, s.t);
    g.beginPath();
    g.rect(0, 0, s.w, s.h);
    g.clip();
    if (spec.grid !== false) {
      g.strokeStyle = "#eef1f4";
      g.lineWidth = 1;
      g.beginPath();
      for (const t of this.ticks.x) {
        const px = Math.round(this.x2p(t.v)) + 0.5;
        g.moveTo(px, 0);
        g.lineTo(px, s.h);
      }
      g.stroke();
    }
    this.layers = spec.layers.filter(Boolean);
    for (const layer of this.layers) this[`draw_${layer.kind}`](g, layer); // clipped to the plot area
    g.restore();
    g.save();
    g.translate(s.l, s.t);
    for (const layer of this.layers) if (layer.kind === "points" && layer.text) this.draw_point_text(g, layer);
    g.restore();
    this.drawText(spec);
    this.hideTip();
  }

  draw_rects(g, L) {
    const pad = L.ypad || 0;
    const n = L.x0.length;
    let fill = null;
    for (let i = 0; i < n; i += 1) {
      const f = at(L.fill, i);
      if (f == null) continue;
      const x0 = this.x2p(L.x0[i]);
      const x1 = this.x2p(L.x1[i]);
      const y0 = this.y2p(L.y0[i]) + pad;
      const y1 = this.y2p(L.y1[i]) - pad;
      if (f !== fill) g.fillStyle = fill = f;
      // at least a pixel wide: a bin or an event narrower than a pixel still shows
      g.fillRect(x0, y0, Math.max(x1 - x0, L.least ?? 1), y1 - y0);
      const lw = at(L.lineWidth, i);
      if (lw) {
        g.strokeStyle = at(L.stroke, i) || "rgba(0,0,0,0.3)";
        g.lineWidth = lw;
        g.strokeRect(x0, y0, Math.max(x1 - x0, 1), y1 - y0);
      }
    }
  }

  draw_segments(g, L) {
    g.strokeStyle = L.color;
    g.lineWidth = L.width || 1;
    g.setLineDash(L.dash || []);
    g.beginPath();
    for (const [x0, y0, x1, y1] of L.segments) {
      const a = Math.round(this.x2p(x0)) + (L.width % 2 ? 0.5 : 0);
      const b = Math.round(this.x2p(x1)) + (L.width % 2 ? 0.5 : 0);
      g.moveTo(x0 === x1 ? a : this.x2p(x0), this.y2p(y0));
      g.lineTo(x0 === x1 ? b : this.x2p(x1), this.y2p(y1));
    }
    g.stroke();
    g.setLineDash([]);
  }

  draw_points(g, L) {
    const n = L.x.length;
    const line = L.line || {};
    for (let i = 0; i < n; i += 1) {
      const px = this.x2p(L.x[i]);
      const py = this.y2p(L.y[i]);
      const r = at(L.size, i) / 2;
      const color = at(L.color, i);
      g.fillStyle = color;
      g.strokeStyle = line.color || color;
      g.lineWidth = line.width || 0;
      g.beginPath();
      if (L.symbol === "triangle-up" || L.symbol === "triangle-down") {
        const d = L.symbol === "triangle-up" ? -1 : 1;
        g.moveTo(px, py + d * r);
        g.lineTo(px - r, py - d * r);
        g.lineTo(px + r, py - d * r);
        g.closePath();
        g.fill();
        if (line.width) g.stroke();
      } else if (L.symbol === "x") {
        g.moveTo(px - r, py - r);
        g.lineTo(px + r, py + r);
        g.moveTo(px + r, py - r);
        g.lineTo(px - r, py + r);
        g.stroke();
      } else if (L.symbol === "square-open") {
        g.strokeRect(px - r, py - r, 2 * r, 2 * r);
      } else {
        g.rect(px - r, py - r, 2 * r, 2 * r);
        g.fill();
        if (line.width) g.stroke();
      }
    }
  }

  // the names of a points layer, drawn after every layer and unclipped: a name near an end of the
  // window may reach into the margin rather than be cut
  draw_point_text(g, L) {
    const n = L.x.length;
    g.font = `${L.textSize || 9}px ${family()}`;
    g.fillStyle = L.textColor || "#3e4c59";
    g.textAlign = "center";
    for (let i = 0; i < n; i += 1) {
      if (!L.text[i]) continue;
      const below = at(L.textAt, i) === "below";
      const r = at(L.size, i) / 2;
      g.textBaseline = below ? "top" : "bottom";
      g.fillText(L.text[i], this.x2p(L.x[i]), this.y2p(L.y[i]) + (below ? r + 2 : -r - 2));
    }
  }

  draw_texts(g, L) {
    g.font = `${L.size || 10}px ${family()}`;
    g.fillStyle = L.color || "#1f2933";
    g.textAlign = "left";
    g.textBaseline = "middle";
    for (let i = 0; i < L.x.length; i += 1) g.fillText(L.text[i], this.x2p(L.x[i]) + (L.dx || 0), this.y2p(L.y[i]));
  }

  // ticks, lane names, the axis title and annotations: DOM text over the canvas
  drawText(spec) {
    const s = this.size;
    const out = [];
    const label = (text, cls, style) => {
      const n = document.createElement("span");
      n.className = cls;
      n.textContent = text;
      Object.assign(n.style, style);
      out.push(n);
      return n;
    };
    for (const t of this.ticks.x) {
      const px = this.x2p(t.v);
      if (px < -1 || px > s.w + 1) continue;
      label(t.text, "tick x", { left: `${s.l + px}px`, top: `${s.t + s.h + 3}px` });
    }
    for (const t of this.ticks.y) label(t.text, "tick y", { right: `${this.width - s.l + 6}px`, top: `${s.t + this.y2p(t.v)}px` });
    if (spec.xTitle) label(spec.xTitle, "axis-title", { left: `${s.l + s.w / 2}px`, top: `${s.t + s.h + 20}px` });
    this.labels = spec.labels || [];
    for (const a of this.labels) {
      const px = a.x == null ? null : this.x2p(a.x);
      if (px != null && (px < -1 || px > s.w + 1)) continue;
      const style = { left: `${s.l + (px ?? 0)}px`, color: a.color || "" };
      if (a.y === "top") style.bottom = `${this.height - s.t + 2}px`;
      else if (a.y === "bottom") style.top = `${s.t + s.h - 16}px`;
      else style.top = `${s.t + this.y2p(a.y)}px`;
      if (a.size) style.fontSize = `${a.size}px`;
      const n = label(a.text, `note ${a.anchor || "left"}${a.bold ? " bold" : ""}${a.above ? " above" : ""}`, style);
      if (a.name) n.dataset.name = a.name;
    }
    this.text.replaceChildren(...out);
  }

  // -- picking and the tooltip ------------------------------------------------------------
  // the mark under plot-area pixel (px, py), the topmost layer first: {layer, index, custom, hover}
  pick(px, py) {
    for (let k = this.layers.length - 1; k >= 0; k -= 1) {
      const L = this.layers[k];
      if (!L.hover && !L.custom) continue;
      const i = L.kind === "points" ? this.pickPoint(L, px, py) : L.kind === "rects" ? this.pickRect(L, px, py) : -1;
      if (i >= 0) return { layer: L.name, index: i, custom: L.custom ? L.custom[i] : null, hover: hoverOf(L, i) };
    }
    return null;
  }

  pickPoint(L, px, py) {
    let best = -1;
    let bestD = Infinity;
    for (let i = 0; i < L.x.length; i += 1) {
      const reach = Math.max(at(L.size, i) / 2 + 3, 8);
      const dx = Math.abs(this.x2p(L.x[i]) - px);
      const dy = Math.abs(this.y2p(L.y[i]) - py);
      if (dx > reach || dy > reach) continue;
      const d = dx * dx + dy * dy;
      if (d < bestD) [best, bestD] = [i, d];
    }
    return best;
  }

  pickRect(L, px, py) {
    const pad = L.ypad || 0;
    for (let i = L.x0.length - 1; i >= 0; i -= 1) {
      if (at(L.fill, i) == null) continue;
      const x0 = this.x2p(L.x0[i]);
      const x1 = Math.max(this.x2p(L.x1[i]), x0 + 1);
      if (px < x0 - 0.5 || px > x1 + 0.5) continue;
      if (py >= this.y2p(L.y0[i]) + pad - 0.5 && py <= this.y2p(L.y1[i]) - pad + 0.5) return i;
    }
    return -1;
  }

  local(e) {
    const r = this.canvas.getBoundingClientRect();
    const s = this.size;
    return { px: e.clientX - r.left - s.l, py: e.clientY - r.top - s.t };
  }

  inside({ px, py }) {
    const s = this.size;
    return px >= 0 && px <= s.w && py >= 0 && py <= s.h;
  }

  onHover(e) {
    if (this.press || !this.spec) return;
    this.hoverAt = this.local(e);
    if (this.hoverFrame) return;
    this.hoverFrame = requestAnimationFrame(() => {
      this.hoverFrame = null;
      const p = this.hoverAt;
      const hit = p && this.inside(p) ? this.pick(p.px, p.py) : null;
      if (!hit || !hit.hover) this.hideTip();
      else this.showTip(hit.hover, p);
    });
  }

  // lines: an array of strings, each a line of text (the first one bold)
  showTip(lines, { px, py }) {
    const tip = this.tip;
    tip.replaceChildren(...(Array.isArray(lines) ? lines : [lines]).map((t) => {
      const n = document.createElement("div");
      n.textContent = t;
      return n;
    }));
    tip.classList.remove("hidden");
    const s = this.size;
    const w = tip.offsetWidth;
    let left = s.l + px + 12;
    if (left + w > this.width) left = Math.max(0, s.l + px - 12 - w);
    tip.style.left = `${left}px`;
    tip.style.top = `${Math.max(0, s.t + py - tip.offsetHeight - 8)}px`;
  }

  hideTip() {
    this.tip.classList.add("hidden");
  }

  // -- press, drag and click --------------------------------------------------------------
  onDown(e) {
    if (e.button !== 0 || !this.spec) return;
    const p = this.local(e);
    if (!this.inside(p)) return;
    this.hideTip(); // (no text is selected by a drag: .chart is user-select: none)
    // kept in data units as the press saw them: a window drawn meanwhile cannot change what a drag covers
    this.press = { ...p, x: this.p2x(p.px), moved: false, map: [...this.spec.x], w: this.size.w };
    if (this.opts.onPress) this.opts.onPress();
  }

  onMove(e) {
    const p = this.press;
    if (!p || !this.opts.zoom) return;
    const q = this.local(e);
    if (!p.moved && Math.abs(q.px - p.px) <= DRAG_PX) return;
    p.moved = true;
    const s = this.size;
    const a = Math.max(0, Math.min(p.px, q.px));
    const b = Math.min(s.w, Math.max(p.px, q.px));
    Object.assign(this.box.style, { left: `${s.l + a}px`, width: `${b - a}px`, top: `${s.t}px`, height: `${s.h}px` });
    this.box.classList.remove("hidden");
  }

  onUp(e) {
    const p = this.press;
    if (!p || e.button !== 0) return;
    this.press = null;
    this.box.classList.add("hidden");
    const q = this.local(e);
    const toX = (px) => p.map[0] + (Math.min(Math.max(px, 0), p.w) / p.w) * (p.map[1] - p.map[0]);
    if (p.moved && this.opts.zoom) {
      const [x0, x1] = [toX(p.px), toX(q.px)].sort((u, v) => u - v);
      this.release();
      if (x1 > x0) this.opts.onZoom(x0, x1);
      return;
    }
    this.release();
    if (!this.opts.onClick) return;
    // e.detail counts the clicks in a row: the canvas stays the same element whatever is drawn
    this.opts.onClick({ hit: this.pick(p.px, p.py), px: p.px, py: p.py, x: p.x, y: this.p2y(p.py), clicks: e.detail || 1 });
  }

  cancelPress() {
    this.press = null;
    this.box.classList.add("hidden");
    this.release();
  }

  release() {
    const go = this.waiting;
    this.waiting = [];
    for (const resolve of go) resolve();
  }

  // null when the mouse is up, else a promise of its release (a window waits for it before it is drawn)
  released() {
    return this.press ? new Promise((resolve) => this.waiting.push(resolve)) : null;
  }
}
