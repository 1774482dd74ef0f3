// stepdump report, heatmaps: tensors x steps on a log colour scale, rows grouped by block (report_groups.py):
// a block's header row is the maximum over its tensors; click it to fold or unfold the block.
// Large models start folded. Uses the drawing core SD.lib (report_draw.js).
(function () {
  "use strict";
  const { ctx, WIDE, el, card, fmt, frame, xAxis, markers, hover, lower, fitMiddle, stepText, ax, overlay, placeOverlay, interact } = SD.lib;
  const GROUP_MIN = 16, FOLD_FROM = 60;   // group rows from this many tensors; start folded from this many
  const SHORT = { attention: "attn", mlp: "mlp", norm: "norm", embedding: "emb", head: "head" };
  const VIRIDIS = ["#440154", "#482878", "#3e4a89", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"]
    .map(h => [1, 3, 5].map(i => parseInt(h.slice(i, i + 2), 16)));
  function color(t) {   // t in [0, 1] -> [r, g, b]
    const p = Math.min(Math.max(t, 0), 1) * (VIRIDIS.length - 1), i = Math.min(Math.floor(p), VIRIDIS.length - 2), a = p - i;
    return VIRIDIS[i].map((c, k) => Math.round(c + (VIRIDIS[i + 1][k] - c) * a));
  }
  const LUT = Array.from({ length: 256 }, (_, i) => color(i / 255)), ZERO = [20, 20, 20], NONFINITE = "#ff1f5a";
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
  // The rows shown: one per tensor, or (grouped) a header per block then its tensors unless folded.
  function view(hm, groups, folded) {
    const n = hm.names.length;
    if (!groups || n < GROUP_MIN) return hm.names.map((name, i) => ({ label: name, idx: [i], name }));
    const at = new Map(hm.names.map((nm, i) => [nm, i])), blocks = new Map();
    const order = groups.order.filter(nm => at.has(nm)).concat(hm.names.filter(nm => !(nm in groups.block)));
    for (const nm of order) { const b = groups.block[nm] || "(other)"; if (!blocks.has(b)) blocks.set(b, []); blocks.get(b).push(nm); }
    if (blocks.size < 2) return hm.names.map((name, i) => ({ label: name, idx: [i], name }));
    const out = [];
    for (const [b, names] of blocks) {
      if (!(b in folded)) folded[b] = n >= FOLD_FROM;
      const kinds = [...new Set(names.map(nm => SHORT[groups.kind[nm]] || "other"))].join(", ");
      out.push({ label: `${folded[b] ? "▸" : "▾"} ${b} (${names.length}: ${kinds})`, idx: names.map(nm => at.get(nm)), block: b, header: true });
      if (!folded[b]) for (const nm of names) {
        const k = SHORT[groups.kind[nm]], short = nm.startsWith(b + ".") ? nm.slice(b.length + 1) : nm;
        out.push({ label: "  " + short + (k ? ` [${k}]` : ""), idx: [at.get(nm)], name: nm, kind: groups.kind[nm] });
      }
    }
    return out;
  }
  function heatmap(cv, hm, rowsView, run) {
    const rows = rowsView.length, cols = hm.x0.length, p = hm.packed, vals = decode(p);
    const rh = Math.max(2, Math.min(16, Math.floor(520 / rows)));
    const probe = cv.getContext("2d"); probe.font = "10px ui-monospace, monospace";
    const longest = Math.max(...rowsView.map(v => probe.measureText(v.label).width));   // room for names, up to 35%
    const l = Math.round(Math.min(Math.max(WIDE.l, longest + 12), Math.max(WIDE.l, cv.clientWidth * 0.35)));
    const f = frame(cv, rows * rh + WIDE.t + WIDE.b + 30, { ...WIDE, l, b: WIDE.b + 30 }), { g, m, W } = f;
    f.rh = rh; const H = rows * rh; f.H = H;
    const PW = Math.max(1, Math.round(W * f.dpr)), best = new Float32Array(rows * PW).fill(NaN);
    const rowVal = (r, c) => { let b = NaN; for (const i of rowsView[r].idx) { const v = vals[i * cols + c]; if (!(b >= v)) b = Number.isNaN(v) ? b : v; } return b; };
    for (let c = 0; c < cols; c++) {   // columns -> device pixels, keeping the max
      const end = c + 1 < cols ? hm.x0[c + 1] : hm.x1[c] + 1;
      const a = Math.floor((f.sx(ax(run, hm.x0[c])) - m.l) * f.dpr), b = Math.max(a + 1, Math.floor((f.sx(ax(run, end)) - m.l) * f.dpr));
      if (b <= 0 || a >= PW) continue;
      for (let r = 0; r < rows; r++) {
        const v = rowVal(r, c); if (Number.isNaN(v)) continue;
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
    // Cells whose bucket holds a step with a NaN/±Inf element: the norm of the finite elements
    // would hide it, so they are painted in a colour the scale does not use (and listed for tests).
    const marks = [], rowOf = new Map();
    rowsView.forEach((v, i) => { for (const t of v.idx) { if (!rowOf.has(t)) rowOf.set(t, []); rowOf.get(t).push(i); } });
    g.fillStyle = NONFINITE;
    for (const [t, c] of hm.nonfinite || []) {
      const end = c + 1 < cols ? hm.x0[c + 1] : hm.x1[c] + 1, xa = f.sx(ax(run, hm.x0[c])), xb = f.sx(ax(run, end));
      if (xb < m.l || xa > m.l + W) continue;   // zoomed out of view
      const x = Math.max(m.l, Math.min(xa, m.l + W - 3)), w = Math.max(3, Math.min(m.l + W, xb) - x);
      for (const r of rowOf.get(t) || []) { g.fillRect(x, m.t + r * rh, w, rh); marks.push({ row: r, tensor: hm.names[t], x0: hm.x0[c], x1: hm.x1[c], x: x + w / 2, y: m.t + (r + 0.5) * rh, w, h: rh }); }
    }
    cv.dataset.nonfinite = JSON.stringify(marks);
    g.strokeStyle = "#999"; g.strokeRect(m.l + 0.5, m.t + 0.5, W - 1, H - 1);
    g.fillStyle = "#333"; g.textAlign = "right"; g.textBaseline = "middle";
    const every = Math.ceil(11 / rh), labels = [];   // label every row that has room (and every block header)
    for (let r = 0; r < rows; r++) {
      if (r % every && !rowsView[r].header) continue;
      g.font = rowsView[r].header ? "bold 10px ui-monospace, monospace" : "10px ui-monospace, monospace";
      const name = fitMiddle(g, rowsView[r].label, m.l - 10); labels.push(name);
      g.fillText(name, m.l - 5, m.t + (r + 0.5) * rh);
      if (rowsView[r].header && r) { g.fillStyle = "#fff"; g.fillRect(m.l, m.t + r * rh, W, 1); g.fillStyle = "#333"; }
    }
    cv.dataset.labels = JSON.stringify(labels);
    cv.dataset.rows = JSON.stringify(rowsView.map(v => v.header ? { block: v.block, tensors: v.idx.length } : { name: v.name, kind: v.kind || null }));
    markers({ ...f, H }, false, cv);
    xAxis(cv, { ...f, H });
    const cy = m.t + H + 30, cw = Math.min(260, W);   // colour bar
    for (let i = 0; i < cw; i++) { const [R, G, B] = color(i / (cw - 1)); g.fillStyle = `rgb(${R},${G},${B})`; g.fillRect(m.l + i, cy, 1, 9); }
    g.fillStyle = "#555"; g.font = "11px system-ui, sans-serif"; g.textBaseline = "middle"; g.textAlign = "right";
    g.fillText(fmt(Math.pow(10, p.lo)), m.l - 5, cy + 5); g.textAlign = "left";
    g.fillText(`${fmt(Math.pow(10, p.hi))}   (log colour scale; ${hm.label}; black: 0, grey: no value${(hm.nonfinite || []).length ? ", red: NaN/Inf in the bucket" : ""})`, m.l + cw + 6, cy + 5);
    cv.dataset.drawn = drawn;
    f.rowVal = rowVal;
    return f;
  }
  // A card with a heatmap; hovering a row (its label or its cells) shows the full tensor name,
  // clicking it calls onPick(name), clicking a block's header folds or unfolds it.
  // opts: {run, groups (the run's tensor groups), folded (block -> bool, kept across redraws)}.
  function addHeatmap(parent, id, hm, title, onPick, opts) {
    const o = opts || {}, run = o.run || 0, folded = o.folded || {};
    const c = card(parent, title, hm.note), cv = el("canvas", { "data-plot": id }, c.card), ov = overlay(c, cv);
    let f = null, rv = view(hm, o.groups, folded);
    const badCells = new Set((hm.nonfinite || []).map(([t, c]) => t * hm.x0.length + c));
    if (rv.some(v => v.header)) {   // fold / unfold every block
      const bar = el("span", { class: "toggle" }, c.head);
      for (const [text, fold] of [["fold all", true], ["unfold all", false]]) {
        const b = el("button", { type: "button", class: "mini", "data-fold": fold ? "1" : "0", text }, bar);
        b.addEventListener("click", () => { for (const k in folded) folded[k] = fold; draw(); });
      }
    }
    const rowAt = py => f ? Math.floor((py - f.m.t) / f.rh) : -1;
    hover(cv, (px, py) => {
      if (!f || px > f.m.l + f.W) return null;
      const r = rowAt(py), inRows = r >= 0 && r < rv.length, v = inRows ? rv[r] : null;
      const what = v ? (v.header ? `${v.block}: max of ${v.idx.length} tensors (click to ${folded[v.block] ? "unfold" : "fold"})` : v.name) : null;
      if (px < f.m.l) return what ? [what] : null;   // the label column: the full name
      const u = f.at(px), step = SD.lib.stepAt(run, u), col = lower(hm.x0, step), near = SD.lib.findingsNear(f, px);
      if (!inRows || col < 0) return near;
      const val = f.rowVal(r, col), bad = v.idx.some(t => badCells.has(t * hm.x0.length + col));
      const range = hm.x1[col] !== hm.x0[col] ? `${stepText(hm.x0[col])}–${hm.x1[col] + ctx.offset} (max)` : stepText(hm.x0[col]);
      return [`${what}  ${range}`, `${hm.label}: ${Number.isNaN(val) ? "—" : val === -Infinity ? "0" : fmt(Math.pow(10, val))}`].concat(bad ? ["NaN/Inf in this bucket"] : [], near);
    });
    cv.addEventListener("click", ev => {
      if (ctx.dragged) { ctx.dragged = false; return; }
      const r = rowAt(ev.clientY - cv.getBoundingClientRect().top); if (r < 0 || r >= rv.length) return;
      if (rv[r].header) { folded[rv[r].block] = !folded[rv[r].block]; draw(); }
      else if (onPick) onPick(rv[r].name);
    });
    if (onPick || rv.some(v => v.header)) cv.style.cursor = "pointer";
    const readout = u => { const s = SD.lib.stepAt(run, u), col = lower(hm.x0, s); return col < 0 ? [] : [stepText(hm.x0[col])]; };
    interact({ cv, ov, f: () => f, readout });
    const draw = () => { rv = view(hm, o.groups, folded); f = heatmap(cv, hm, rv, run); placeOverlay(cv, ov); };
    return { draw, canvas: cv, card: c };
  }
  // The first step of each column where tensor r's bucket holds a NaN/±Inf element (a line chart's `bad` ticks).
  function rowBad(hm, r) { return (hm.nonfinite || []).filter(([t]) => t === r).map(([, c]) => hm.x0[c]); }
  SD.row = row; SD.rowBad = rowBad; SD.addHeatmap = addHeatmap; SD.decode = decode;
})();
