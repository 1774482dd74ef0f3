// stepdump report, drawing: line charts and heatmaps on <canvas>, no libraries.
// Every chart shares one step axis [ctx.X0, ctx.X1): step s is the cell [s, s + 1), lines pass
// through cell centres, heatmap columns fill from their first step to the next column's. Data
// arrive already downsampled (min/max per bucket for lines, max for heatmaps), so spikes are kept.
// report.js sets ctx (axis, findings, step numbering) and builds the sections from these.
const SD = (function () {
  "use strict";
  const ctx = { X0: 0, X1: 1, offset: 0, findings: [], labels: [] };
  const tip = document.getElementById("tip");
  const SEV = { error: "#d62728", warning: "#e08a00", info: "#1f77b4" };
  const WIDE = { l: 150, r: 16, t: 14, b: 24 };   // full-width charts: room for tensor names
  const SMALL = { l: 58, r: 12, t: 10, b: 24 };   // small multiples
  const LOG_SPAN = 50, LOG_SPIKE = 10;             // as stepdump.analysis.report_scalars.wants_log

  // -- helpers -------------------------------------------------------------------
  const fmt = v => v === null || v === undefined || Number.isNaN(v) ? "—"
    : v === 0 ? "0" : Math.abs(v) >= 1e4 || Math.abs(v) < 1e-3 ? v.toExponential(3).replace(/\.?0+e/, "e")
    : String(+v.toPrecision(4));
  // Steps as the reader counts them: stepdump's t (from 0) or a Trainer's global_step t + 1.
  const stepText = s => ctx.offset ? `global_step ${s + ctx.offset} (step ${s})` : `step ${s}`;
  function wantsLog(ys) {   // positive, and spanning decades or holding a spike
    const v = ys.filter(y => y !== null && Number.isFinite(y)).sort((a, b) => a - b);
    if (v.length < 2 || v[0] <= 0) return false;
    const med = v[Math.floor(v.length / 2)], hi = v[v.length - 1];
    return hi / v[0] >= LOG_SPAN || hi / med >= LOG_SPIKE;
  }
  function el(tag, attrs, parent) {
    const e = document.createElement(tag);
    for (const k in attrs || {}) k === "text" ? (e.textContent = attrs[k]) : e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function card(parent, title, note) {
    const c = el("div", { class: "card" }, parent);
    const h = el("div", { class: "card-head" }, c);
    el("span", { class: "card-title", text: title, title }, h);   // wraps (CSS); full text on hover
    if (note) el("p", { class: "note", text: note }, c);
    return { card: c, head: h };
  }
  // A name that fits `width` px, cut from the middle: both its head (the module path) and its
  // tail (layer index, ".weight") stay readable.
  function fitMiddle(g, name, width) {
    if (g.measureText(name).width <= width) return name;
    for (let keep = name.length - 1; keep > 2; keep--) {
      const head = Math.floor(keep * 0.4), s = name.slice(0, head) + "…" + name.slice(name.length - (keep - head));
      if (g.measureText(s).width <= width) return s;
    }
    return name.slice(0, 1) + "…";
  }
  function lower(xs, v) { let lo = 0, hi = xs.length; while (lo < hi) { const m = (lo + hi) >> 1; xs[m] <= v ? lo = m + 1 : hi = m; } return lo - 1; }
  function niceTicks(lo, hi, n) {
    const span = hi - lo || 1, raw = span / n, p = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map(k => k * p).find(s => span / s <= n) || 10 * p;
    const out = []; for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9 * span; v += step) out.push(+v.toPrecision(12));
    return out;
  }
  function frame(cv, height, m) {   // size the canvas for the screen, return drawing geometry
    const dpr = window.devicePixelRatio || 1, X0 = ctx.X0, X1 = ctx.X1;
    cv.style.height = height + "px";
    const w = cv.clientWidth;   // CSS width: 100% of the card
    cv.width = Math.round(w * dpr); cv.height = Math.round(height * dpr);
    const g = cv.getContext("2d"); g.setTransform(dpr, 0, 0, dpr, 0, 0); g.clearRect(0, 0, w, height);
    const W = w - m.l - m.r, H = height - m.t - m.b;
    return { g, m, W, H, dpr, sx: s => m.l + (s - X0) / (X1 - X0) * W, step: px => X0 + (px - m.l) / W * (X1 - X0) };
  }
  function xAxis(cv, f) {
    const { g, m, W, H } = f, shown = [];
    g.fillStyle = "#666"; g.font = "11px system-ui, sans-serif"; g.textAlign = "center"; g.textBaseline = "top";
    for (const s of niceTicks(ctx.X0 + ctx.offset, ctx.X1 - 1 + ctx.offset, Math.max(2, Math.floor(W / 90)))) {
      if (s !== Math.round(s)) continue;
      const x = f.sx(s - ctx.offset + 0.5); g.fillRect(x, m.t + H, 1, 3); g.fillText(String(s), x, m.t + H + 5); shown.push(s);
    }
    cv.dataset.xticks = JSON.stringify(shown);
  }
  function markers(f, full) {   // findings: dashed lines (or ticks above heatmaps)
    const { g, m, H } = f;
    for (const fd of ctx.findings) {
      const x = Math.round(f.sx(fd.step + 0.5)) + 0.5;
      g.strokeStyle = g.fillStyle = SEV[fd.severity] || "#555";
      if (full) { g.setLineDash([4, 3]); g.beginPath(); g.moveTo(x, m.t); g.lineTo(x, m.t + H); g.stroke(); g.setLineDash([]); }
      g.beginPath(); g.moveTo(x - 4, m.t - 7); g.lineTo(x + 4, m.t - 7); g.lineTo(x, m.t - 1); g.fill();
    }
  }
  function findingsNear(f, px) {
    const who = fd => ctx.labels.length > 1 ? `${ctx.labels[fd.run || 0]}: ` : "";
    return ctx.findings.filter(fd => Math.abs(f.sx(fd.step + 0.5) - px) <= 4)
      .map(fd => `⚑ ${who(fd)}${stepText(fd.step)} ${fd.rule} (${fd.severity}): ${fd.message}`);
  }
  function hover(cv, fn) {
    cv.addEventListener("mousemove", ev => {
      const r = cv.getBoundingClientRect(), lines = fn(ev.clientX - r.left, ev.clientY - r.top);
      if (!lines || !lines.length) { tip.hidden = true; return; }
      tip.textContent = lines.join("\n"); tip.hidden = false;
      const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
      tip.style.left = x + "px"; tip.style.top = (ev.clientY + 14) + "px";
    });
    cv.addEventListener("mouseleave", () => { tip.hidden = true; });
  }

  // -- line and bar charts ---------------------------------------------------------
  // spec: {series: [{x, y, label, color, x1}], log, height, margin, bars, connect, skipped: [[a, b]], bad: [steps]}
  // A null y is a value not there (not logged, not measured at a lean step, non-finite): never
  // drawn as 0. Lines break there, or with `connect` join the points on either side.
  function lineChart(cv, spec) {
    const f = frame(cv, spec.height, spec.margin), { g, m, W, H } = f;
    const T = v => spec.log ? (v > 0 ? Math.log10(v) : null) : v;
    let lo = Infinity, hi = -Infinity, vlo = Infinity, vhi = -Infinity;
    for (const s of spec.series) for (const v of s.y) {
      const t = v === null ? null : T(v);
      if (t !== null) { lo = Math.min(lo, t); hi = Math.max(hi, t); vlo = Math.min(vlo, v); vhi = Math.max(vhi, v); }
    }
    if (spec.bars) lo = 0;
    if (!isFinite(lo)) { lo = 0; hi = 1; }
    if (hi - lo < 1e-12) { const p = spec.log ? 0.1 : Math.abs(hi) * 0.1 || 0.5; lo -= p; hi += p; }   // flat line
    else if (!spec.bars) { const p = (hi - lo) * 0.06; lo -= p; hi += p; }
    const sy = t => m.t + H - (t - lo) / (hi - lo) * H;
    g.fillStyle = "#fafafa"; g.fillRect(m.l, m.t, W, H);
    for (const [a, b] of spec.skipped || []) { g.fillStyle = "rgba(120,120,120,0.25)"; g.fillRect(f.sx(a), m.t, Math.max(2, f.sx(b + 1) - f.sx(a)), H); }
    g.font = "11px system-ui, sans-serif"; g.textAlign = "right"; g.textBaseline = "middle";
    let ticks = spec.log ? niceTicks(Math.floor(lo), Math.ceil(hi), 5).filter(t => t === Math.round(t) && t >= lo && t <= hi)
      : niceTicks(lo, hi, Math.max(2, Math.floor(H / 28)));
    if (spec.log && ticks.length < 2)   // less than a decade: nice values, placed on the log axis
      ticks = niceTicks(Math.pow(10, lo), Math.pow(10, hi), 4).filter(v => v > 0).map(Math.log10);
    for (const t of ticks) {
      const y = Math.round(sy(t)) + 0.5; g.strokeStyle = "#e4e4e4"; g.beginPath(); g.moveTo(m.l, y); g.lineTo(m.l + W, y); g.stroke();
      g.fillStyle = "#666"; g.fillText(!spec.log ? fmt(t) : t === Math.round(t) && Math.abs(t) > 3 ? "1e" + t : fmt(+Math.pow(10, t).toPrecision(6)), m.l - 5, y);
    }
    let drawn = 0;
    const per = spec.series.map(s => {
      let n = 0;
      g.strokeStyle = g.fillStyle = s.color; g.lineWidth = 1.3;
      if (spec.bars) {
        s.y.forEach((v, j) => {
          if (!v) return; const a = f.sx(s.x[j]), b = f.sx((s.x1 || s.x)[j] + 1);
          g.fillRect(a, sy(T(v)), Math.max(1.5, b - a), sy(lo) - sy(T(v))); n++;
        });
        drawn += n; return n;
      }
      g.beginPath(); let pen = false, last = null;
      s.y.forEach((v, j) => {
        const t = v === null ? null : T(v);
        if (t === null) { if (!spec.connect) pen = false; return; }
        const x = f.sx(s.x[j] + 0.5), y = sy(t);
        pen ? g.lineTo(x, y) : g.moveTo(x, y); pen = true; n++; last = [x, y];
      });
      g.stroke();
      if (n === 1 && last) { g.beginPath(); g.arc(last[0], last[1], 2.5, 0, 7); g.fill(); }
      drawn += n; return n;
    });
    g.lineWidth = 1;
    for (const b of spec.bad || []) {   // non-finite values: red ticks on the floor
      const x = f.sx(b + 0.5); g.fillStyle = "#d62728"; g.fillRect(x - 1, m.t + H - 6, 2, 6);
    }
    g.strokeStyle = "#999"; g.strokeRect(m.l + 0.5, m.t + 0.5, W - 1, H - 1);
    markers(f, true); xAxis(cv, f);
    // What was drawn, for people and tests: point count, scale, series and their value range.
    cv.dataset.drawn = drawn; cv.dataset.log = spec.log ? "1" : "0";
    cv.dataset.series = JSON.stringify(spec.series.map((s, i) => ({ label: s.label, points: per[i] })));
    cv.dataset.range = JSON.stringify(isFinite(vlo) ? [vlo, vhi] : null);
    return f;
  }
  function lineHover(cv, spec, fref) {
    hover(cv, (px, py) => {
      const f = fref(); if (!f || px < f.m.l || px > f.m.l + f.W) return null;
      const s = f.step(px), out = [];
      for (const se of spec.series) {
        const j = lower(se.x, s); if (j < 0) continue;
        const k = j + 1 < se.x.length && Math.abs(se.x[j + 1] - s) < Math.abs(se.x[j] - s) ? j + 1 : j;
        const range = se.x1 && se.x1[k] !== se.x[k] ? `${stepText(se.x[k])}–${se.x1[k] + ctx.offset}` : stepText(se.x[k]);
        out.push(`${range}  ${se.label}: ${fmt(se.y[k])}`);
      }
      return out.concat(findingsNear(f, px));
    });
  }
  // A card with a line chart; spec.toggle adds a log checkbox whose state `logState` keeps
  // across redraws (a live page redraws every update).
  function addLineChart(parent, title, spec, note, logState, onDraw) {
    const c = card(parent, title, note);
    if (spec.legend) {   // several runs: which colour is which
      const lg = el("div", { class: "legend" }, c.card);
      for (const [label, color] of spec.legend) {
        const item = el("span", { class: "legend-item", title: label }, lg);
        el("span", { class: "swatch", style: `background:${color}` }, item); item.appendChild(document.createTextNode(label));
      }
    }
    if (logState && spec.id in logState) spec.log = logState[spec.id];
    if (spec.toggle) {
      const lab = el("label", { class: "toggle" }, c.head), box = el("input", { type: "checkbox", "data-log-for": spec.id }, lab);
      lab.appendChild(document.createTextNode(" log"));
      box.checked = !!spec.log;
      box.addEventListener("change", () => { spec.log = box.checked; if (logState) logState[spec.id] = box.checked; draw(); });
    }
    const cv = el("canvas", { "data-plot": spec.id }, c.card);
    let f = null; const draw = () => { f = lineChart(cv, spec); if (onDraw) onDraw(cv); };
    lineHover(cv, spec, () => f);
    return { draw, canvas: cv, card: c };
  }

  // -- heatmaps ---------------------------------------------------------------------
  const VIRIDIS = ["#440154", "#482878", "#3e4a89", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"]
    .map(h => [1, 3, 5].map(i => parseInt(h.slice(i, i + 2), 16)));
  function color(t) {   // t in [0, 1] -> [r, g, b]
    const p = Math.min(Math.max(t, 0), 1) * (VIRIDIS.length - 1), i = Math.min(Math.floor(p), VIRIDIS.length - 2), a = p - i;
    return VIRIDIS[i].map((c, k) => Math.round(c + (VIRIDIS[i + 1][k] - c) * a));
  }
  const LUT = Array.from({ length: 256 }, (_, i) => color(i / 255)), ZERO = [20, 20, 20];
  function decode(p) {   // uint16 codes -> log10 values (NaN: none, -Infinity: zero); once per matrix
    if (p._vals) return p._vals;
    const bin = atob(p.b64), n = p.rows * p.cols, out = new Float32Array(n), span = p.hi - p.lo;
    for (let i = 0; i < n; i++) {
      const c = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
      out[i] = c === 0 ? NaN : c === 1 ? -Infinity : p.lo + (c - 2) / 65533 * span;
    }
    Object.defineProperty(p, "_vals", { value: out });
    return out;
  }
  function row(hm, r) {   // one tensor's values (null: no value) at the heatmap's columns
    const vals = decode(hm.packed), cols = hm.x0.length, out = new Array(cols);
    for (let c = 0; c < cols; c++) { const v = vals[r * cols + c]; out[c] = Number.isNaN(v) ? null : v === -Infinity ? 0 : Math.pow(10, v); }
    return out;
  }
  function heatmap(cv, hm) {
    const rows = hm.names.length, cols = hm.x0.length, p = hm.packed, vals = decode(p);
    const rh = Math.max(2, Math.min(16, Math.floor(520 / rows)));
    const probe = cv.getContext("2d"); probe.font = "10px ui-monospace, monospace";
    const longest = Math.max(...hm.names.map(n => probe.measureText(n).width));   // room for names, up to 35%
    const l = Math.round(Math.min(Math.max(WIDE.l, longest + 12), Math.max(WIDE.l, cv.clientWidth * 0.35)));
    const f = frame(cv, rows * rh + WIDE.t + WIDE.b + 30, { ...WIDE, l, b: WIDE.b + 30 }), { g, m, W } = f;
    f.rh = rh; const H = rows * rh;
    const PW = Math.max(1, Math.round(W * f.dpr)), best = new Float32Array(rows * PW).fill(NaN);
    for (let c = 0; c < cols; c++) {   // columns -> device pixels, keeping the max
      const end = c + 1 < cols ? hm.x0[c + 1] : hm.x1[c] + 1;
      const a = Math.floor((f.sx(hm.x0[c]) - m.l) * f.dpr), b = Math.max(a + 1, Math.floor((f.sx(end) - m.l) * f.dpr));
      for (let r = 0; r < rows; r++) {
        const v = vals[r * cols + c]; if (Number.isNaN(v)) continue;
        for (let x = Math.max(0, a); x < Math.min(b, PW); x++) { const o = r * PW + x; if (!(best[o] >= v)) best[o] = v; }
      }
    }
    const img = new ImageData(PW, rows), px = img.data, span = p.hi - p.lo || 1; let drawn = 0;
    for (let i = 0; i < best.length; i++) {
      const v = best[i]; if (Number.isNaN(v)) continue;
      const rgb = v === -Infinity ? ZERO : LUT[Math.round(Math.min(Math.max((v - p.lo) / span, 0), 1) * 255)];
      px[4 * i] = rgb[0]; px[4 * i + 1] = rgb[1]; px[4 * i + 2] = rgb[2]; px[4 * i + 3] = 255; drawn++;
    }
    const off = document.createElement("canvas"); off.width = PW; off.height = rows; off.getContext("2d").putImageData(img, 0, 0);
    g.fillStyle = "#eee"; g.fillRect(m.l, m.t, W, H);
    g.imageSmoothingEnabled = false; g.drawImage(off, m.l, m.t, W, H);
    g.strokeStyle = "#999"; g.strokeRect(m.l + 0.5, m.t + 0.5, W - 1, H - 1);
    g.fillStyle = "#333"; g.font = "10px ui-monospace, monospace"; g.textAlign = "right"; g.textBaseline = "middle";
    const every = Math.ceil(11 / rh), labels = [];   // label every row that has room
    for (let r = 0; r < rows; r += every) {
      const name = fitMiddle(g, hm.names[r], m.l - 10); labels.push(name);
      g.fillText(name, m.l - 5, m.t + (r + 0.5) * rh);
    }
    cv.dataset.labels = JSON.stringify(labels);
    markers({ ...f, H }, false);
    xAxis(cv, { ...f, H });
    const cy = m.t + H + 30, cw = Math.min(260, W);   // colour bar
    for (let i = 0; i < cw; i++) { const [R, G, B] = color(i / (cw - 1)); g.fillStyle = `rgb(${R},${G},${B})`; g.fillRect(m.l + i, cy, 1, 9); }
    g.fillStyle = "#555"; g.font = "11px system-ui, sans-serif"; g.textBaseline = "middle"; g.textAlign = "right";
    g.fillText(fmt(Math.pow(10, p.lo)), m.l - 5, cy + 5); g.textAlign = "left";
    g.fillText(`${fmt(Math.pow(10, p.hi))}   (log colour scale; ${hm.label}; black: 0, grey: no value)`, m.l + cw + 6, cy + 5);
    cv.dataset.drawn = drawn;
    return f;
  }
  // A card with a heatmap; hovering a row (its label or its cells) shows the full tensor name,
  // clicking it calls onPick(name).
  function addHeatmap(parent, id, hm, title, onPick) {
    const c = card(parent, title, hm.note), cv = el("canvas", { "data-plot": id }, c.card), vals = decode(hm.packed);
    let f = null;
    const rowAt = py => f ? Math.floor((py - f.m.t) / f.rh) : -1;
    hover(cv, (px, py) => {
      if (!f || px > f.m.l + f.W) return null;
      const r = rowAt(py), inRows = r >= 0 && r < hm.names.length;
      if (px < f.m.l) return inRows ? [hm.names[r]] : null;   // the label column: the full name
      const col = lower(hm.x0, f.step(px)), near = findingsNear(f, px);
      if (!inRows || col < 0) return near;
      const v = vals[r * hm.x0.length + col];
      const range = hm.x1[col] !== hm.x0[col] ? `${stepText(hm.x0[col])}–${hm.x1[col] + ctx.offset} (max)` : stepText(hm.x0[col]);
      return [`${hm.names[r]}  ${range}`, `${hm.label}: ${Number.isNaN(v) ? "—" : v === -Infinity ? "0" : fmt(Math.pow(10, v))}`].concat(near);
    });
    if (onPick) {
      cv.style.cursor = "pointer";
      cv.addEventListener("click", ev => { const r = rowAt(ev.clientY - cv.getBoundingClientRect().top); if (r >= 0 && r < hm.names.length) onPick(hm.names[r]); });
    }
    return { draw: () => { f = heatmap(cv, hm); }, canvas: cv, card: c };
  }

  return { ctx, WIDE, SMALL, fmt, el, card, wantsLog, row, addLineChart, addHeatmap };
})();
