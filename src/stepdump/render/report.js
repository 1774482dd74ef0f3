// stepdump report: builds the sections from the JSON blob #stepdump-data with report_draw.js and
// report_heat.js. The data hold one or more runs (one colour each, overlaid on shared axes); with
// several, where `stepdump diff` says they part is marked on every chart and difference curves
// follow each scalar. With #stepdump-live (stepdump report --watch) the page polls for fresh data
// and rebuilds itself, keeping what the reader chose: the tensor, log toggles, folded blocks,
// smoothing, zoom, the x axis and the step numbering.
(function () {
  "use strict";
  const { ctx, WIDE, SMALL, el, wantsLog, addLineChart } = SD;
  let D = JSON.parse(document.getElementById("stepdump-data").textContent);
  const liveEl = document.getElementById("stepdump-live"), LIVE = liveEl ? JSON.parse(liveEl.textContent) : null;
  const state = { log: {}, layer: null, folded: {}, zoom: null, diffMode: {} };
  let charts = [], layerCharts = [];

  const colour = i => D.palette[i % D.palette.length];
  const legend = series => several() ? [...new Map(series.map(s => [s.run, [D.runs[s.run].label, colour(s.run)]])).values()] : null;
  const several = () => D.runs.length > 1;
  const who = (i, name) => several() ? `${D.runs[i].label}: ${name}` : name;
  function empty(parent, text) { el("p", { class: "muted", text }, parent); }
  function clear(id) { const e = document.getElementById(id); e.replaceChildren(); return e; }
  function f32(b64) { const bin = atob(b64), u8 = new Uint8Array(bin.length); for (let i = 0; i < bin.length; i++) u8[i] = bin.charCodeAt(i); return new Float32Array(u8.buffer); }
  const val = v => Number.isNaN(v) ? null : v;

  // -- controls: smoothing, x axis, zoom --------------------------------------------------
  function controls() {
    const box = clear("controls");
    const sl = el("label", { class: "toggle", title: "Exponential moving average of the drawn points, as TensorBoard smooths; the raw line stays, faint" }, box);
    sl.appendChild(document.createTextNode("smoothing "));
    const range = el("input", { type: "range", id: "smoothing", min: "0", max: "0.99", step: "0.01", value: String(ctx.smooth) }, sl);
    const shown = el("span", { id: "smoothing-value", class: "mono", text: ctx.smooth.toFixed(2) }, sl);
    range.addEventListener("input", () => { ctx.smooth = +range.value; shown.textContent = ctx.smooth.toFixed(2); drawAll(); });
    const xl = el("label", { class: "toggle", title: "Wall clock and relative time come from when each step was committed to the run" }, box);
    xl.appendChild(document.createTextNode(" x axis "));
    const xs = el("select", { id: "x-axis" }, xl), timed = D.runs.every(r => r.times && r.times.s.length > 1);
    for (const [v, t] of [["step", "step"], ["rel", "relative time"], ["wall", "wall clock"]]) {
      const o = el("option", { value: v, text: t }, xs); if (v !== "step" && !timed) o.disabled = true; if (v === ctx.mode) o.selected = true;
    }
    xs.addEventListener("change", () => { ctx.mode = xs.value; state.zoom = null; domain(); drawAll(); });
    const z = el("span", { id: "zoom", class: "toggle" }, box);
    el("span", { id: "zoom-range", class: "mono", text: "" }, z);
    const reset = el("button", { type: "button", id: "zoom-reset", class: "mini", text: "reset zoom" }, z);
    reset.addEventListener("click", () => ctx.setZoom(null));
    el("span", { class: "muted note", text: " drag across any chart to zoom all of them; double-click to reset" }, box);
  }
  function domain() {
    let a = Infinity, b = -Infinity;
    D.runs.forEach((r, i) => { if (!r.summary.steps_recorded) return; a = Math.min(a, SD.lib.ax(i, r.domain[0])); b = Math.max(b, SD.lib.ax(i, r.domain[1] + 1)); });
    if (!isFinite(a)) { a = D.domain[0]; b = D.domain[1] + 1; }
    if (!(b > a)) b = a + 1;
    [ctx.X0, ctx.X1] = state.zoom || [a, b];
    const zr = document.getElementById("zoom-range"), zoomed = !!state.zoom;
    if (zr) zr.textContent = zoomed ? (ctx.mode === "step" ? `steps ${Math.floor(ctx.X0)}–${Math.ceil(ctx.X1) - 1} ` : "zoomed ") : "";
    const rb = document.getElementById("zoom-reset"); if (rb) rb.hidden = !zoomed;
    document.body.dataset.zoom = zoomed ? JSON.stringify([ctx.X0, ctx.X1]) : "";
  }
  ctx.setZoom = z => { state.zoom = z && z[1] - z[0] > 1e-9 ? z : null; domain(); drawAll(); };

  // -- scalars and moments: one chart per quantity, one series per run -----------------
  function skippedBands() {
    const out = [];
    D.runs.forEach((r, i) => r.nonfinite.skipped_x0.forEach((a, k) => out.push([a, r.nonfinite.skipped_x1[k], i])));
    return out;
  }
  function scalars(skipped) {
    const sc = clear("scalar-charts"), sy = clear("sys-charts");
    const user = D.scalars.filter(c => c.section !== "sys"), sys = D.scalars.filter(c => c.section === "sys");
    if (!user.length) empty(sc, "No scalars were logged.");
    if (!sys.length) empty(sy, "No sys/* scalars (Recorder(profile=True) records iteration time, recorder time and peak memory).");
    for (const ch of D.scalars) {
      const parent = ch.section === "sys" ? sy : sc;
      const pts = ch.series.map(s => s.points > s.x.length ? `${s.points} points, drawn as ${s.x.length} (min and max per bucket)` : `${s.points} points`);
      const note = [several() ? ch.series.map((s, i) => `${D.runs[s.run].label}: ${pts[i]}`).join("; ") : pts[0]].concat(ch.notes).join(". ");
      const series = ch.series.map(s => ({ x: s.x, y: s.y, run: s.run, label: who(s.run, s.name), color: colour(s.run) }));
      charts.push(addLineChart(parent, ch.title, { id: "scalar:" + ch.id, series, legend: legend(ch.series), log: ch.log, toggle: true, height: 190, margin: SMALL,
        bad: ch.series.flatMap(s => s.nonfinite_steps), skipped, smooth: true }, note, state.log));
      if (ch.diff && ch.diff.length) diffChart(parent, ch);
    }
  }
  function diffChart(parent, ch) {   // A − B or the relative error, per other run, at the steps both logged
    const id = "diff:" + ch.id, mode = state.diffMode[id] || "abs";
    const series = ch.diff.map(d => mode === "abs" ? { x: d.x, y: d.y, run: d.run, label: `${D.runs[0].label} − ${D.runs[d.run].label}`, color: colour(d.run) }
      : { x: d.rx, y: d.ry, run: d.run, label: `|A − B| / max(|A|, |B|): ${D.runs[0].label} vs ${D.runs[d.run].label}`, color: colour(d.run) });
    const first = ch.diff.map(d => `${D.runs[d.run].label}: ${d.first_differs === null ? "equal at all " + d.common + " common steps" : "first differs at step " + d.first_differs}`).join("; ");
    const c = addLineChart(parent, `${ch.title}: ${mode === "abs" ? "A − B" : "relative error"}`, { id, series, log: mode === "rel" && wantsLog(series.flatMap(s => s.y)),
      toggle: true, height: 150, margin: SMALL, smooth: true }, first, state.log);
    const sel = el("select", { class: "mini", "data-diff-mode": id }, c.card.head);
    for (const [v, t] of [["abs", "A − B"], ["rel", "relative error"]]) { const o = el("option", { value: v, text: t }, sel); if (v === mode) o.selected = true; }
    sel.addEventListener("change", () => { state.diffMode[id] = sel.value; rebuild(); });
    charts.push(c);
  }
  function moments(skipped) {
    const mc = clear("moment-charts");
    if (!D.moments.length) empty(mc, "No optimizer moments (exp_avg, exp_avg_sq, momentum_buffer) were recorded.");
    for (const ch of D.moments) {
      const series = ch.series.map(s => ({ x: s.x, y: s.y, run: s.run, label: who(s.run, ch.id), color: colour(s.run) }));
      charts.push(addLineChart(mc, ch.title, { id: "moments:" + ch.id, series, legend: legend(ch.series), log: ch.log, toggle: true, height: 190,
        margin: SMALL, skipped, connect: true, smooth: true }, "", state.log));
    }
  }

  // -- per tensor: norms, update ratio and value distribution of the tensor the selector names --
  const LAYER_KINDS = [
    ["grad_norm", "gradient L2 norm", r => r.grad_norms],
    ["param_norm", "weight L2 norm", r => r.param_norms],
    ["update_ratio", "update / weight ratio", r => r.update_ratio && (r.update_ratio.exact || r.update_ratio.lower_bound)],
  ];
  function layerNames() {   // every tensor any run has, in recording order
    const seen = new Set(), out = [];
    for (const r of D.runs) for (const [, , get] of LAYER_KINDS) { const hm = get(r); if (hm) for (const n of hm.names) if (!seen.has(n)) { seen.add(n); out.push(n); } }
    return out;
  }
  function layers(skipped) {
    const box = clear("layer-charts"), names = layerNames();
    layerCharts = [];
    if (!names.length) { empty(box, "No parameters or gradients were recorded."); return; }
    if (!names.includes(state.layer)) state.layer = names[0];
    const bar = el("div", { class: "layer-bar" }, box);
    el("label", { for: "layer-select", text: "Tensor " }, bar);
    const sel = el("select", { id: "layer-select" }, bar), groups = D.runs[0].groups;
    const add = (parent, n) => { const o = el("option", { value: n, text: n, title: n }, parent); if (n === state.layer) o.selected = true; };
    if (groups && names.length >= 16 && groups.blocks.length > 1) {   // options under their block
      const byBlock = new Map();
      for (const n of names) { const b = groups.block[n] || "(other)"; if (!byBlock.has(b)) byBlock.set(b, []); byBlock.get(b).push(n); }
      for (const b of groups.blocks.concat(byBlock.has("(other)") ? ["(other)"] : [])) {
        if (!byBlock.has(b)) continue;
        const og = el("optgroup", { label: b }, sel); for (const n of byBlock.get(b)) add(og, n);
      }
    } else for (const n of names) add(sel, n);
    sel.addEventListener("change", () => { state.layer = sel.value; drawLayers(grid, skipped); });
    el("span", { class: "muted note", text: " (or click a row of a heatmap)" }, bar);
    const grid = el("div", { class: "grid" }, box);
    drawLayers(grid, skipped);
  }
  function distCharts(grid, name) {
    for (const kind of ["params", "grads"]) {
      const bands = [], series = [], qbands = [], qseries = [], notes = [], qnotes = [];
      D.runs.forEach((r, i) => {
        const dist = r.dist && r.dist[kind]; if (!dist) return;
        for (const b of dist.bands) {
          const k = b.names.indexOf(name); if (k < 0) continue;
          const a = b._a || (b._a = f32(b.f32)), T = b.names.length, C = b.x0.length, at = (s, c) => val(a[(s * T + k) * C + c]);
          const mn = [], mx = [], mean = [], lo = [], hi = [];
          for (let c = 0; c < C; c++) { mn.push(at(0, c)); mx.push(at(1, c)); const m = at(2, c), sd = at(3, c); mean.push(m); lo.push(m === null || sd === null ? null : m - sd); hi.push(m === null || sd === null ? null : m + sd); }
          bands.push({ run: i, x: b.x0, lo: mn, hi: mx, color: colour(i), alpha: 0.12 }, { run: i, x: b.x0, lo, hi, color: colour(i), alpha: 0.3 });
          series.push({ run: i, x: b.x0, y: mean, label: who(i, `${name} mean`), color: colour(i) });
          if (b.steps > C) notes.push(`${several() ? D.runs[i].label + ": " : ""}buckets of ${Math.ceil(b.steps / C)} steps (min of minima, max of maxima, average mean and std)`);
          // Lean (stats-only) steps leave mean and std of tensors over 4096 elements unmeasured: say so, not just draw less.
          const blind = mn.filter((v, c) => v !== null && mean[c] === null).length;
          if (blind) notes.push(`${several() ? D.runs[i].label + ": " : ""}mean and std not measured at ${blind} of ${C} ${b.steps > C ? "buckets" : "steps"} (stats-only steps of tensors over 4096 elements: min–max only)`);
        }
        for (const q of dist.quantiles) {
          const k = q.names.indexOf(name); if (k < 0) continue;
          const a = q._a || (q._a = f32(q.f32)), T = q.names.length, S = q.steps.length, lv = l => q.steps.map((_, j) => val(a[(l * T + k) * S + j]));
          qbands.push({ run: i, x: q.steps, lo: lv(0), hi: lv(4), color: colour(i), alpha: 0.15 }, { run: i, x: q.steps, lo: lv(1), hi: lv(3), color: colour(i), alpha: 0.35 });
          qseries.push({ run: i, x: q.steps, y: lv(2), label: who(i, `${name} median`), color: colour(i) });
          qnotes.push(`${several() ? D.runs[i].label + ": " : ""}${S} full steps; ` + (q.sampled.includes(name) ? `quantiles of ${q.sample} evenly strided elements` : "exact quantiles"));
        }
      });
      const what = kind === "params" ? "weight" : "gradient";
      if (series.length) {
        const c = addLineChart(grid, `${what} values: min–max, mean ± std`, { id: "layer:dist:" + kind, series, bands, legend: legend(series), log: false, toggle: true,
          height: 190, margin: SMALL, connect: true }, [name, "from per-step stats"].concat(notes).join(" · "), state.log, cv => { cv.dataset.tensor = name; });
        layerCharts.push(c); c.draw();
      }
      if (qseries.length) {
        const c = addLineChart(grid, `${what} quantiles 5–25–50–75–95 %`, { id: "layer:quantiles:" + kind, series: qseries, bands: qbands, legend: legend(qseries),
          log: false, toggle: true, height: 190, margin: SMALL, connect: true }, [name, "from stored tensors"].concat(qnotes).join(" · "), state.log, cv => { cv.dataset.tensor = name; });
        layerCharts.push(c); c.draw();
      }
    }
  }
  function drawLayers(grid, skipped) {
    grid.replaceChildren(); layerCharts = [];
    ctx.charts = ctx.charts.filter(ch => ch.cv.isConnected);
    const name = state.layer;
    for (const [key, what, get] of LAYER_KINDS) {
      const series = [], notes = [], bad = [];
      D.runs.forEach((r, i) => {
        const hm = get(r), k = hm ? hm.names.indexOf(name) : -1;
        if (k < 0) return;
        bad.push(...SD.rowBad(hm, k));   // buckets where this tensor had a NaN/Inf element: red ticks
        series.push({ run: i, x: hm.x0, x1: hm.x1, y: SD.row(hm, k), label: who(i, `${name} ${what}`), color: colour(i) });
        if (hm.steps > hm.x0.length) notes.push(`${several() ? r.label + ": " : ""}max per bucket of ${Math.ceil(hm.steps / hm.x0.length)} steps`);
        if (key === "update_ratio" && !r.update_ratio.exact) notes.push(`${several() ? r.label + ": " : ""}lower bound from norms`);
      });
      if (!series.length) continue;
      const id = "layer:" + key, log = id in state.log ? state.log[id] : wantsLog(series.flatMap(s => s.y));
      const c = addLineChart(grid, what, { id, series, legend: legend(series), log, toggle: true, height: 190, margin: SMALL, skipped, connect: true, bad },
        [name].concat(notes).join(" · "), state.log, cv => { cv.dataset.tensor = name; });
      layerCharts.push(c); c.draw();
    }
    distCharts(grid, name);
  }
  function pick(name) {
    state.layer = name;
    const sel = document.getElementById("layer-select");
    if (sel) { sel.value = name; sel.dispatchEvent(new Event("change")); sel.scrollIntoView({ block: "nearest" }); }
    else document.getElementById("layers").scrollIntoView({ block: "start" });   // not decoded yet: scrolling there decodes it
  }

  // -- lazy sections: a large page embeds the per-tensor matrices compressed, one element each
  // (#stepdump-lazy-<run>-<key>, zlib + base64); the run's entry reads {lazy: id} until a section
  // that draws them is scrolled to (or its button pressed), then they are inflated and parsed once.
  const LAZY = [
    { sections: ["layers"], keys: ["grad_norms", "param_norms", "update_ratio", "dist"], build: skipped => layers(skipped) },
    { sections: ["grad-norms", "update-ratio"], keys: ["grad_norms", "update_ratio"], build: () => heatmaps() },
  ];
  const inflating = {};
  let observers = [];
  function inflate(id) {
    return inflating[id] || (inflating[id] = (async () => {
      const bin = atob(document.getElementById(id).textContent.trim()), u8 = new Uint8Array(bin.length);
      for (let i = 0; i < bin.length; i++) u8[i] = bin.charCodeAt(i);
      const stream = new Blob([u8]).stream().pipeThrough(new DecompressionStream("deflate"));
      return JSON.parse(await new Response(stream).text());
    })());
  }
  const pendingOf = keys => D.runs.flatMap((r, i) => keys.filter(k => r[k] && r[k].lazy).map(k => [i, k, r[k].lazy]));
  function lazily(group, skipped) {
    const pending = pendingOf(group.keys), secs = group.sections.map(id => document.getElementById(id));
    if (!pending.length) { group.build(skipped); return; }
    const body = secs.map(sec => sec.querySelector("div"));
    secs.forEach((sec, j) => {
      sec.dataset.lazy = "pending";
      const box = clear(body[j].id);
      const b = el("button", { type: "button", class: "mini lazy-load", text: "draw this section" }, box);
      el("span", { class: "muted note", text: " (per-tensor data of a large run: decoded when scrolled to)" }, box);
      b.addEventListener("click", go);
    });
    let started = false;
    const obs = new IntersectionObserver(es => { if (es.some(e => e.isIntersecting)) go(); }, { rootMargin: "200px" });
    secs.forEach(sec => obs.observe(sec));
    observers.push(obs);
    async function go() {
      if (started) return; started = true; obs.disconnect();
      const d = D;
      const vals = await Promise.all(pending.map(([, , id]) => inflate(id)));
      if (d !== D) return;   // a live update replaced the data meanwhile (and rebuilt the page)
      pending.forEach(([i, k], j) => { if (D.runs[i][k] && D.runs[i][k].lazy) D.runs[i][k] = vals[j]; });
      secs.forEach(sec => { sec.dataset.lazy = "decoded"; });
      group.build(skipped); collapseEmpty(); drawAll();
    }
  }

  // -- heatmaps and the NaN/Inf timeline, per run ---------------------------------------
  const folded = id => state.folded[id] || (state.folded[id] = {});
  function heatmaps() {
    const gh = clear("grad-heatmap"), rh = clear("ratio-heatmaps");
    D.runs.forEach((r, i) => {
      const pre = several() ? `${r.label}: ` : "", tag = several() ? `@${i}` : "", hm = r.grad_norms, opts = id => ({ run: i, groups: r.groups, folded: folded(id) });
      if (hm) charts.push(SD.addHeatmap(gh, "grad_norms" + tag, hm, pre + `${hm.names.length} tensors × ${hm.steps} steps` +
        (hm.steps > hm.x0.length ? ` in ${hm.x0.length} columns (max per column)` : ""), pick, opts("grad_norms" + tag)));
      else empty(gh, pre + "No gradients were recorded.");
      const ur = r.update_ratio || {};
      if (ur.exact) charts.push(SD.addHeatmap(rh, "update_ratio:exact" + tag, ur.exact, pre + "Exact ‖θ_{t+1} − θ_t‖ / ‖θ_t‖", pick, opts("update_ratio:exact" + tag)));
      if (ur.lower_bound) charts.push(SD.addHeatmap(rh, "update_ratio:lower_bound" + tag, ur.lower_bound, pre + "Lower bound | ‖θ_{t+1}‖ − ‖θ_t‖ | / ‖θ_t‖ (from stats)", pick, opts("update_ratio:lower_bound" + tag)));
      if (!ur.exact && !ur.lower_bound) empty(rh, pre + "No parameters were recorded.");
    });
  }
  function normDiff() {   // inline data (comparisons): drawn with the first view
    const nd = clear("norm-diff");
    for (const d of D.norm_diff || []) {
      const id = `norm_diff:${d.kind}@${d.run}`;
      charts.push(SD.addHeatmap(nd, id, d.heatmap, `${D.runs[0].label} vs ${D.runs[d.run].label}: ${d.heatmap.label}`, pick,
        { run: 0, groups: D.runs[0].groups, folded: folded(id) }));
    }
  }
  function nonfinite(skipped) {
    const nc = clear("nonfinite-chart"), nf = D.runs.map(r => r.nonfinite);
    const affected = nf.map((n, i) => `${several() ? D.runs[i].label + ": " : ""}${n.steps_with_nonfinite} steps affected, at most ${n.max_count} tensors; ` +
      `${D.runs[i].summary.skipped_steps} skipped steps`).join(" · ");
    if (nf.every((n, i) => !n.steps_with_nonfinite && !D.runs[i].summary.skipped_steps)) {   // nothing to draw: one line
      empty(nc, `No NaN or Inf in any recorded tensor, no skipped step (${D.runs.map(r => r.summary.stats_steps + r.summary.full_steps).join(" / ")} steps with stats).`);
      return;
    }
    charts.push(addLineChart(nc, `tensors with NaN/Inf per step: ${affected} (grey)`, { id: "nonfinite",
      series: nf.map((n, i) => ({ x: n.x0, x1: n.x1, y: n.count, run: i, label: who(i, "tensors with NaN/Inf"), color: several() ? colour(i) : "#d62728" })),
      bars: true, height: 150, margin: WIDE, skipped }));
  }
  function collapseEmpty() {   // a section with nothing drawn shrinks to its title and one line
    for (const s of document.querySelectorAll("main > section")) {
      if (s.id === "summary" || s.id === "findings" || s.hidden || s.dataset.lazy === "pending") continue;
      s.classList.toggle("collapsed", !s.querySelector("canvas[data-plot]") && !s.querySelector("#compare-body table"));
    }
  }

  // -- the whole page -------------------------------------------------------------------
  function build() {
    ctx.times = D.runs.map(r => r.times);
    if (ctx.mode !== "step" && !D.runs.every(r => r.times && r.times.s.length > 1)) ctx.mode = "step";
    domain();
    ctx.findings = D.runs.flatMap(r => r.findings.filter(f => f.step !== null && f.step !== undefined));
    ctx.labels = D.runs.map(r => r.label);
    ctx.divergence = (D.divergence || []).filter(d => d.step !== null && d.step !== undefined)
      .map(d => ({ step: d.step, run: d.run, text: `${D.runs[0].label} and ${D.runs[d.run].label} part at step ${d.step}: ${d.headline}${d.reading ? " — " + d.reading : ""}` }));
    charts = []; ctx.charts = [];
    for (const o of observers) o.disconnect();
    observers = [];
    for (const sec of document.querySelectorAll("main > section[data-lazy]")) delete sec.dataset.lazy;
    const skipped = skippedBands();
    controls(); scalars(skipped); for (const g of LAZY) lazily(g, skipped); normDiff(); moments(skipped); nonfinite(skipped);
    collapseEmpty();
  }
  function rebuild() { build(); drawAll(); }
  const drawAll = () => { for (const c of charts) c.draw(); for (const c of layerCharts) c.draw(); document.body.dataset.ready = "1"; };
  const numbering = document.getElementById("step-numbering");
  numbering.addEventListener("change", () => { ctx.offset = +numbering.value; drawAll(); });
  ctx.offset = +numbering.value;
  let pending = 0;
  window.addEventListener("resize", () => { clearTimeout(pending); pending = setTimeout(drawAll, 120); });
  build(); drawAll();

  if (LIVE) {   // stepdump report --watch: poll, rebuild when the run has moved on
    const status = document.getElementById("live-status");
    let version = LIVE.version, busy = false;
    status.hidden = false; status.textContent = "live";
    const poll = async () => {
      if (busy) return; busy = true;
      try {
        const r = await fetch(LIVE.url, { cache: "no-store" });
        const j = await r.json();
        if (j.version !== version) {
          version = j.version; D = j.data;
          document.getElementById("summary-body").innerHTML = j.summary_html;
          document.getElementById("findings-body").innerHTML = j.findings_html;
          document.getElementById("nfindings").textContent = j.nfindings;
          if (j.compare_html !== undefined) document.getElementById("compare-body").innerHTML = j.compare_html;
          if (j.ranks_html !== undefined) { document.getElementById("ranks-body").innerHTML = j.ranks_html; document.getElementById("ranks").hidden = !j.ranks_html; }
          document.getElementById("compare").hidden = D.runs.length < 2;
          rebuild();
          document.body.dataset.version = version;
        }
        status.textContent = `live · updated ${new Date().toLocaleTimeString()}`;
      } catch (e) {
        status.textContent = "live · not reachable (is stepdump report --watch still running?)";
      } finally { busy = false; }
    };
    document.body.dataset.version = version;
    setInterval(poll, LIVE.interval_ms);
  }
})();
