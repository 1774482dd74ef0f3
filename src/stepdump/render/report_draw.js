// stepdump report, drawing: line charts on <canvas>, no libraries (heatmaps: report_heat.js).
// Every chart shares one x axis [ctx.X0, ctx.X1) in axis units: steps (step s is the cell
// [s, s + 1), lines pass through cell centres), or seconds (wall clock, or since the run's first
// step), a run's steps mapped through its step commit times (ctx.ax). Data arrive already
// downsampled (min/max per bucket for lines, max for heatmaps), so spikes are kept. Charts share
// the zoom (drag to select a range, double-click to reset) and the hover read-out (a crosshair
// and the values at that point on every chart). report.js sets ctx and builds the sections.
const SD = (function () {
  "use strict";
  const ctx = { X0: 0, X1: 1, offset: 0, findings: [], labels: [], divergence: [], mode: "step", times: [],
    smooth: 0, charts: [], setZoom: null, dragged: false };
  const tip = document.getElementById("tip");
  const SEV = { error: "#d62728", warning: "#e08a00", info: "#1f77b4" }, DIVERGE = "#7b2cbf";
  const WIDE = { l: 150, r: 16, t: 14, b: 24 };   // full-width charts: room for tensor names
  const SMALL = { l: 58, r: 12, t: 10, b: 24 };   // small multiples
  const LOG_SPAN = 50, LOG_SPIKE = 10;             // as stepdump.analysis.report_scalars.wants_log

  // -- helpers -------------------------------------------------------------------
  const fmt = v => v === null || v === undefined || Number.isNaN(v) ? "—"
    : v === 0 ? "0" : Math.abs(v) >= 1e4 || Math.abs(v) < 1e-3 ? v.toExponential(3).replace(/\.?0+e/, "e")
    : String(+v.toPrecision(4));
  // Steps as the reader counts them: stepdump's t (from 0) or a Trainer's global_step t + 1.
  const stepText = s => ctx.offset ? `global_step ${s + ctx.offset} (step ${s})` : `step ${s}`;
  // -- the x axis: steps, or seconds through each run's step times ------------------------
  function interp(tm, s) {   // time of (fractional) step s from the run's (step, time) pairs
    const xs = tm.s, ts = tm.t, n = xs.length;
    if (n === 1) return ts[0];
    let j = lower(xs, s); j = Math.max(0, Math.min(n - 2, j));
    const a = xs[j], b = xs[j + 1], f = b > a ? (s - a) / (b - a) : 0;
    return ts[j] + (ts[j + 1] - ts[j]) * f;   // beyond the ends: the nearest pair's pace
  }
  function ax(run, s) {   // axis coordinate of step s of run `run`
    if (ctx.mode === "step") return s;
    const tm = ctx.times[run || 0] || ctx.times[0];
    if (!tm || !tm.s.length) return s;
    return interp(tm, s) - (ctx.mode === "rel" ? tm.t[0] : 0);
  }
  function stepAt(run, u) {   // the step of run `run` at axis coordinate u (inverse of ax)
    if (ctx.mode === "step") return u;
    const tm = ctx.times[run || 0] || ctx.times[0];
    if (!tm || !tm.s.length) return u;
    const t = u + (ctx.mode === "rel" ? tm.t[0] : 0);
    return interp({ s: tm.t, t: tm.s }, t);
  }
  const dur = v => { const a = Math.abs(v); return a < 120 ? `${+v.toFixed(a < 10 ? 1 : 0)}s` : a < 7200 ? `${+(v / 60).toFixed(1)}m` : `${+(v / 3600).toFixed(2)}h`; };
  const clock = v => new Date(v * 1000).toLocaleTimeString([], { hour12: false });
  function timeText(run, s) {
    if (ctx.mode === "step") return "";
    const u = ax(run, s + 0.5);
    return ctx.mode === "rel" ? ` · +${dur(u)}` : ` · ${clock(u)}`;
  }
  // EMA as TensorBoard smooths (debiased, over the points drawn); null stays null.
  function ema(ys, w) {
    if (!(w > 0)) return ys;
    let last = 0, n = 0;
    return ys.map(v => { if (v === null || !Number.isFinite(v)) return null; last = last * w + (1 - w) * v; n++; return last / (1 - Math.pow(w, n)); });
  }
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
    cv.dataset.domain = JSON.stringify([X0, X1]);
    cv.style.height = height + "px";
    const w = cv.clientWidth;   // CSS width: 100% of the card
    cv.width = Math.round(w * dpr); cv.height = Math.round(height * dpr);
    const g = cv.getContext("2d"); g.setTransform(dpr, 0, 0, dpr, 0, 0); g.clearRect(0, 0, w, height);
    const W = w - m.l - m.r, H = height - m.t - m.b;
    return { g, m, W, H, dpr, sx: u => m.l + (u - X0) / (X1 - X0) * W, at: px => X0 + (px - m.l) / W * (X1 - X0),
      step: px => stepAt(0, X0 + (px - m.l) / W * (X1 - X0)) };
  }
  function xAxis(cv, f) {
    const { g, m, W, H } = f, shown = [], n = Math.max(2, Math.floor(W / 90));
    g.fillStyle = "#666"; g.font = "11px system-ui, sans-serif"; g.textAlign = "center"; g.textBaseline = "top";
    if (ctx.mode === "step") {
      for (const s of niceTicks(ctx.X0 + ctx.offset, ctx.X1 - 1 + ctx.offset, n)) {
        if (s !== Math.round(s)) continue;
        const x = f.sx(s - ctx.offset + 0.5); g.fillRect(x, m.t + H, 1, 3); g.fillText(String(s), x, m.t + H + 5); shown.push(s);
      }
    } else {
      for (const u of niceTicks(ctx.X0, ctx.X1, n)) {
        const x = f.sx(u), text = ctx.mode === "rel" ? dur(u) : clock(u);
        g.fillRect(x, m.t + H, 1, 3); g.fillText(text, x, m.t + H + 5); shown.push(text);
      }
    }
    cv.dataset.xticks = JSON.stringify(shown);
  }
  function markers(f, full, cv) {   // findings: dashed lines (or ticks above heatmaps); where runs part: solid
    const { g, m, H } = f, parts = [];
    for (const fd of ctx.findings) {
      const x = Math.round(f.sx(ax(fd.run, fd.step + 0.5))) + 0.5;
      g.strokeStyle = g.fillStyle = SEV[fd.severity] || "#555";
      if (full) { g.setLineDash([4, 3]); g.beginPath(); g.moveTo(x, m.t); g.lineTo(x, m.t + H); g.stroke(); g.setLineDash([]); }
      g.beginPath(); g.moveTo(x - 4, m.t - 7); g.lineTo(x + 4, m.t - 7); g.lineTo(x, m.t - 1); g.fill();
    }
    for (const d of ctx.divergence) {
      const u = ax(0, d.step + 0.5), x = Math.round(f.sx(u)) + 0.5;
      if (u < ctx.X0 || u > ctx.X1) continue;
      g.strokeStyle = g.fillStyle = DIVERGE; g.lineWidth = 1.5;
      g.beginPath(); g.moveTo(x, m.t); g.lineTo(x, m.t + H); g.stroke(); g.lineWidth = 1;
      g.font = "10px system-ui, sans-serif"; g.textAlign = "left"; g.textBaseline = "top";
      g.fillText(`parts @${d.step + ctx.offset}`, x + 3, m.t + 2);
      parts.push({ step: d.step, run: d.run, x: x - 0.5 });
    }
    if (cv) cv.dataset.divergence = JSON.stringify(parts);
  }
  function findingsNear(f, px) {
    const who = fd => ctx.labels.length > 1 ? `${ctx.labels[fd.run || 0]}: ` : "";
    return ctx.findings.filter(fd => Math.abs(f.sx(ax(fd.run, fd.step + 0.5)) - px) <= 4)
      .map(fd => `⚑ ${who(fd)}${stepText(fd.step)} ${fd.rule} (${fd.severity}): ${fd.message}`)
      .concat(ctx.divergence.filter(d => Math.abs(f.sx(ax(0, d.step + 0.5)) - px) <= 4)
        .map(d => `⟂ ${d.text}`));
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

  // -- shared zoom and hover read-out ----------------------------------------------------
  // Each chart registers {cv, ov (overlay canvas), f() (its geometry), readout(u) (lines at axis u)}.
  function overlay(c, cv) {
    c.card.classList.add("has-overlay");
    return el("canvas", { class: "overlay", "data-overlay-for": cv.dataset.plot }, c.card);
  }
  function placeOverlay(cv, ov) {
    ov.style.left = cv.offsetLeft + "px"; ov.style.top = cv.offsetTop + "px";
    ov.style.width = cv.clientWidth + "px"; ov.style.height = cv.clientHeight + "px";
    ov.width = cv.width; ov.height = cv.height;
  }
  function crosshair(ch, u, brush) {
    const f = ch.f(), ov = ch.ov; if (!f) return;
    const g = ov.getContext("2d"); g.setTransform(f.dpr, 0, 0, f.dpr, 0, 0); g.clearRect(0, 0, ov.width, ov.height);
    if (u === null) { ov.dataset.readout = ""; return; }
    const H = f.H || ch.cv.clientHeight - f.m.t - f.m.b;
    if (brush) { g.fillStyle = "rgba(43,91,156,0.15)"; const a = f.sx(brush[0]), b = f.sx(brush[1]); g.fillRect(Math.min(a, b), f.m.t, Math.abs(b - a), H); }
    if (u < ctx.X0 || u > ctx.X1) { ov.dataset.readout = ""; return; }
    const x = Math.round(f.sx(u)) + 0.5;
    g.strokeStyle = "rgba(0,0,0,0.45)"; g.beginPath(); g.moveTo(x, f.m.t); g.lineTo(x, f.m.t + H); g.stroke();
    const lines = ch.readout ? ch.readout(u) : [];
    ov.dataset.readout = lines.join("\n");
    if (!lines.length) return;
    g.font = "11px ui-monospace, monospace"; g.textAlign = "left"; g.textBaseline = "top";
    const w = Math.min(f.W - 8, Math.max(...lines.map(l => g.measureText(l).width)) + 8), left = x + w + 8 < f.m.l + f.W ? x + 4 : x - w - 4;
    g.fillStyle = "rgba(255,255,255,0.88)"; g.fillRect(left, f.m.t + 2, w, 14 * lines.length + 4);
    g.fillStyle = "#222"; lines.forEach((l, i) => g.fillText(l, left + 4, f.m.t + 4 + 14 * i, w - 6));
  }
  function visibleCharts() {
    const vh = window.innerHeight;
    return ctx.charts.filter(ch => { if (!ch.cv.isConnected) return false; const r = ch.cv.getBoundingClientRect(); return r.bottom > 0 && r.top < vh; });
  }
  function hoverAll(u, brush, only) { for (const ch of visibleCharts()) crosshair(ch, u, ch === only ? brush : null); }
  function interact(ch) {
    ctx.charts.push(ch);
    const cv = ch.cv; let down = null;
    const ux = ev => { const f = ch.f(), r = cv.getBoundingClientRect(); return f ? f.at(ev.clientX - r.left) : null; };
    cv.addEventListener("mousedown", ev => { const f = ch.f(), px = ev.clientX - cv.getBoundingClientRect().left;
      if (f && px >= f.m.l && px <= f.m.l + f.W) { down = { u: ux(ev), px }; ctx.dragged = false; } });
    cv.addEventListener("mousemove", ev => {
      const u = ux(ev); if (u === null) return;
      if (down && Math.abs(ev.clientX - cv.getBoundingClientRect().left - down.px) > 4) ctx.dragged = true;
      hoverAll(u, down && ctx.dragged ? [down.u, u] : null, ch);
    });
    window.addEventListener("mouseup", ev => {
      if (!down) return;
      const u = ux(ev), start = down.u; down = null;
      if (ctx.dragged && u !== null && ctx.setZoom) ctx.setZoom([Math.max(Math.min(start, u), ctx.X0), Math.min(Math.max(start, u), ctx.X1)]);
    });
    cv.addEventListener("mouseleave", () => { if (!down) hoverAll(null); });
    cv.addEventListener("dblclick", () => { if (ctx.setZoom) ctx.setZoom(null); });
  }

  // -- line and bar charts ---------------------------------------------------------
  // spec: {series: [{x, y, label, color, x1, run}], log, height, margin, bars, connect, smooth,
  //        bands: [{run, x, lo, hi, color, alpha}], skipped: [[a, b, run]], bad: [steps]}
  // A null y is a value not there (not logged, not measured at a lean step, non-finite): never
  // drawn as 0. Lines break there, or with `connect` join the points on either side. With
  // `smooth` and ctx.smooth > 0 the raw line is drawn faint under its EMA.
  function lineChart(cv, spec) {
    const f = frame(cv, spec.height, spec.margin), { g, m, W, H } = f;
    const T = v => spec.log ? (v > 0 ? Math.log10(v) : null) : v;
    const smoothing = spec.smooth && ctx.smooth > 0 && !spec.bars;
    for (const s of spec.series) {
      s.u = s.x.map(x => ax(s.run, x + (spec.bars ? 0 : 0.5)));
      s.ys = smoothing ? ema(s.y, ctx.smooth) : s.y;
    }
    const inView = u => u >= ctx.X0 - 1e-9 && u <= ctx.X1 + 1e-9;
    let lo = Infinity, hi = -Infinity, vlo = Infinity, vhi = -Infinity;
    const take = (v, raw) => { const t = v === null ? null : T(v); if (t !== null && Number.isFinite(t)) { lo = Math.min(lo, t); hi = Math.max(hi, t); if (raw) { vlo = Math.min(vlo, v); vhi = Math.max(vhi, v); } } };
    for (const s of spec.series) s.y.forEach((v, j) => { if (inView(s.u[j])) { take(v, true); if (smoothing) take(s.ys[j], false); } });
    for (const b of spec.bands || []) b.x.forEach((x, j) => { if (inView(ax(b.run, x + 0.5))) { take(b.lo[j], false); take(b.hi[j], false); } });
    if (spec.bars) lo = 0;
    if (!isFinite(lo)) { lo = 0; hi = 1; }
    if (hi - lo < 1e-12) { const p = spec.log ? 0.1 : Math.abs(hi) * 0.1 || 0.5; lo -= p; hi += p; }   // flat line
    else if (!spec.bars) { const p = (hi - lo) * 0.06; lo -= p; hi += p; }
    const sy = t => m.t + H - (t - lo) / (hi - lo) * H;
    g.fillStyle = "#fafafa"; g.fillRect(m.l, m.t, W, H);
    g.save(); g.beginPath(); g.rect(m.l, m.t, W, H); g.clip();
    for (const [a, b, run] of spec.skipped || []) { g.fillStyle = "rgba(120,120,120,0.25)"; const x = f.sx(ax(run, a)); g.fillRect(x, m.t, Math.max(2, f.sx(ax(run, b + 1)) - x), H); }
    g.restore();
    g.font = "11px system-ui, sans-serif"; g.textAlign = "right"; g.textBaseline = "middle";
    let ticks = spec.log ? niceTicks(Math.floor(lo), Math.ceil(hi), 5).filter(t => t === Math.round(t) && t >= lo && t <= hi)
      : niceTicks(lo, hi, Math.max(2, Math.floor(H / 28)));
    if (spec.log && ticks.length < 2)   // less than a decade: nice values, placed on the log axis
      ticks = niceTicks(Math.pow(10, lo), Math.pow(10, hi), 4).filter(v => v > 0).map(Math.log10);
    for (const t of ticks) {
      const y = Math.round(sy(t)) + 0.5; g.strokeStyle = "#e4e4e4"; g.beginPath(); g.moveTo(m.l, y); g.lineTo(m.l + W, y); g.stroke();
      g.fillStyle = "#666"; g.fillText(!spec.log ? fmt(t) : t === Math.round(t) && Math.abs(t) > 3 ? "1e" + t : fmt(+Math.pow(10, t).toPrecision(6)), m.l - 5, y);
    }
    g.save(); g.beginPath(); g.rect(m.l, m.t, W, H); g.clip();
    let banded = 0;   // band columns drawn in view (a lean run's envelope has no mean line to count)
    for (const b of spec.bands || []) {   // value bands (distributions): filled between lo and hi
      g.fillStyle = b.color; g.globalAlpha = b.alpha; let seg = [];
      const flush = () => { if (seg.length) { g.beginPath(); seg.forEach(([x, t], i) => i ? g.lineTo(x, sy(t)) : g.moveTo(x, sy(t)));
        for (let i = seg.length - 1; i >= 0; i--) g.lineTo(seg[i][0], sy(seg[i][2])); g.closePath(); g.fill(); } seg = []; };
      b.x.forEach((x, j) => { const a = T(b.lo[j]), c = T(b.hi[j]); if (b.lo[j] === null || b.hi[j] === null || a === null || c === null) { flush(); return; }
        const px = f.sx(ax(b.run, x + 0.5)); seg.push([px, c, a]); if (inView(ax(b.run, x + 0.5))) banded++; });
      flush(); g.globalAlpha = 1;
    }
    let drawn = 0;
    const path = (s, ys) => {
      g.beginPath(); let pen = false, last = null, n = 0;
      ys.forEach((v, j) => {
        const t = v === null ? null : T(v);
        if (t === null) { if (!spec.connect) pen = false; return; }
        const x = f.sx(s.u[j]), y = sy(t);
        pen ? g.lineTo(x, y) : g.moveTo(x, y); pen = true; if (inView(s.u[j])) n++; last = [x, y];
      });
      g.stroke();
      if (n === 1 && last) { g.beginPath(); g.arc(last[0], last[1], 2.5, 0, 7); g.fill(); }
      return n;
    };
    const per = spec.series.map(s => {
      let n = 0;
      g.strokeStyle = g.fillStyle = s.color; g.lineWidth = 1.3;
      if (spec.bars) {
        s.y.forEach((v, j) => {
          if (!v) return; const a = f.sx(s.u[j]), b = f.sx(ax(s.run, (s.x1 || s.x)[j] + 1));
          g.fillRect(a, sy(T(v)), Math.max(1.5, b - a), sy(lo) - sy(T(v))); if (inView(s.u[j])) n++;
        });
        drawn += n; return n;
      }
      if (smoothing) { g.globalAlpha = 0.25; path(s, s.y); g.globalAlpha = 1; g.lineWidth = 1.6; }
      n = path(s, s.ys);
      drawn += n; return n;
    });
    g.lineWidth = 1;
    for (const b of spec.bad || []) {   // non-finite values: red ticks on the floor
      const x = f.sx(ax(0, b + 0.5)); g.fillStyle = "#d62728"; g.fillRect(x - 1, m.t + H - 6, 2, 6);
    }
    g.restore();
    g.strokeStyle = "#999"; g.strokeRect(m.l + 0.5, m.t + 0.5, W - 1, H - 1);
    markers(f, true, cv); xAxis(cv, f);
    // What was drawn, for people and tests: point count, scale, series and their value range.
    cv.dataset.bad = JSON.stringify(spec.bad || []);
    cv.dataset.drawn = drawn; cv.dataset.banded = banded; cv.dataset.log = spec.log ? "1" : "0"; cv.dataset.smooth = smoothing ? String(ctx.smooth) : "0";
    cv.dataset.series = JSON.stringify(spec.series.map((s, i) => ({ label: s.label, points: per[i] })));
    cv.dataset.range = JSON.stringify(isFinite(vlo) ? [vlo, vhi] : null);
    cv._sd = { series: spec.series.map(s => ({ label: s.label, x: s.x, y: s.y, ys: s.ys, px: s.ys.map((v, j) => v === null || T(v) === null ? null : [f.sx(s.u[j]), sy(T(v))]) })) };
    return f;
  }
  function nearest(se, u) {
    const j = lower(se.u, u); if (j < 0) return se.u.length ? 0 : -1;
    return j + 1 < se.u.length && Math.abs(se.u[j + 1] - u) < Math.abs(se.u[j] - u) ? j + 1 : j;
  }
  function lineReadout(spec) {
    return u => {
      const out = [];
      for (const se of spec.series) {
        if (!se.u) continue;
        const k = nearest(se, u); if (k < 0) continue;
        const sm = se.ys && se.ys !== se.y ? ` (smoothed ${fmt(se.ys[k])})` : "";
        out.push(`${stepText(se.x[k])}${timeText(se.run, se.x[k])}  ${se.label}: ${fmt(se.y[k])}${sm}`);
      }
      return out;
    };
  }
  function lineHover(cv, spec, fref) {
    const ro = lineReadout(spec);
    hover(cv, (px, py) => {
      const f = fref(); if (!f || px < f.m.l || px > f.m.l + f.W) return null;
      const u = f.at(px), out = [];
      for (const se of spec.series) {
        if (!se.u) continue;
        const k = nearest(se, u); if (k < 0) continue;
        const range = se.x1 && se.x1[k] !== se.x[k] ? `${stepText(se.x[k])}–${se.x1[k] + ctx.offset}` : stepText(se.x[k]);
        const sm = se.ys && se.ys !== se.y ? ` (smoothed ${fmt(se.ys[k])})` : "";
        out.push(`${range}${timeText(se.run, se.x[k])}  ${se.label}: ${fmt(se.y[k])}${sm}`);
      }
      return out.concat(findingsNear(f, px));
    });
    return ro;
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
    const cv = el("canvas", { "data-plot": spec.id }, c.card), ov = overlay(c, cv);
    let f = null; const draw = () => { f = lineChart(cv, spec); placeOverlay(cv, ov); if (onDraw) onDraw(cv); };
    const readout = lineHover(cv, spec, () => f);
    interact({ cv, ov, f: () => f, readout });
    return { draw, canvas: cv, card: c };
  }

  const lib = { ctx, WIDE, SMALL, fmt, el, card, wantsLog, frame, xAxis, markers, hover, lower, fitMiddle, stepText, ax, stepAt,
    findingsNear, overlay, placeOverlay, interact, hoverAll, ema };
  return { ctx, WIDE, SMALL, fmt, el, card, wantsLog, addLineChart, lib };
})();
