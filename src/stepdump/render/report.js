// stepdump report: builds the sections from the JSON blob #stepdump-data with report_draw.js.
// The data hold one or more runs (one colour each, overlaid on shared step axes). With
// #stepdump-live (stepdump report --watch) the page polls for fresh data and rebuilds itself,
// keeping what the reader chose: the tensor, log toggles, the step numbering.
(function () {
  "use strict";
  const { ctx, WIDE, SMALL, el, card, wantsLog, row, addLineChart, addHeatmap } = SD;
  let D = JSON.parse(document.getElementById("stepdump-data").textContent);
  const liveEl = document.getElementById("stepdump-live"), LIVE = liveEl ? JSON.parse(liveEl.textContent) : null;
  const state = { log: {}, layer: null };
  let charts = [], layerCharts = [];

  const colour = i => D.palette[i % D.palette.length];
  const legend = series => several() ? [...new Map(series.map(s => [s.run, [D.runs[s.run].label, colour(s.run)]])).values()] : null;
  const several = () => D.runs.length > 1;
  const who = (i, name) => several() ? `${D.runs[i].label}: ${name}` : name;
  function empty(parent, text) { el("p", { class: "muted", text }, parent); }
  function clear(id) { const e = document.getElementById(id); e.replaceChildren(); return e; }

  // -- scalars and moments: one chart per quantity, one series per run -----------------
  function skippedBands() {
    const out = [];
    for (const r of D.runs) r.nonfinite.skipped_x0.forEach((a, i) => out.push([a, r.nonfinite.skipped_x1[i]]));
    return out;
  }
  function scalars(skipped) {
    const sc = clear("scalar-charts");
    if (!D.scalars.length) empty(sc, "No scalars were logged.");
    for (const ch of D.scalars) {
      const pts = ch.series.map(s => s.points > s.x.length ? `${s.points} points, drawn as ${s.x.length} (min and max per bucket)` : `${s.points} points`);
      const note = [several() ? ch.series.map((s, i) => `${D.runs[s.run].label}: ${pts[i]}`).join("; ") : pts[0]].concat(ch.notes).join(". ");
      const series = ch.series.map(s => ({ x: s.x, y: s.y, label: who(s.run, s.name), color: colour(s.run) }));
      charts.push(addLineChart(sc, ch.title, { id: "scalar:" + ch.id, series, legend: legend(ch.series), log: ch.log, toggle: true, height: 190, margin: SMALL,
        bad: ch.series.flatMap(s => s.nonfinite_steps), skipped }, note, state.log));
    }
  }
  function moments(skipped) {
    const mc = clear("moment-charts");
    if (!D.moments.length) empty(mc, "No optimizer moments (exp_avg, exp_avg_sq, momentum_buffer) were recorded.");
    for (const ch of D.moments) {
      const series = ch.series.map(s => ({ x: s.x, y: s.y, label: who(s.run, ch.id), color: colour(s.run) }));
      charts.push(addLineChart(mc, ch.title, { id: "moments:" + ch.id, series, legend: legend(ch.series), log: ch.log, toggle: true, height: 190,
        margin: SMALL, skipped, connect: true }, "", state.log));
    }
  }

  // -- per tensor: grad norm, weight norm, update ratio of the tensor the selector names --
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
    const sel = el("select", { id: "layer-select" }, bar);
    for (const n of names) { const o = el("option", { value: n, text: n, title: n }, sel); if (n === state.layer) o.selected = true; }
    sel.addEventListener("change", () => { state.layer = sel.value; drawLayers(grid, skipped); });
    el("span", { class: "muted note", text: " (or click a row of a heatmap)" }, bar);
    const grid = el("div", { class: "grid" }, box);
    drawLayers(grid, skipped);
  }
  function drawLayers(grid, skipped) {
    grid.replaceChildren(); layerCharts = [];
    const name = state.layer;
    for (const [key, what, get] of LAYER_KINDS) {
      const series = [], notes = [];
      D.runs.forEach((r, i) => {
        const hm = get(r), k = hm ? hm.names.indexOf(name) : -1;
        if (k < 0) return;
        series.push({ run: i, x: hm.x0, x1: hm.x1, y: row(hm, k), label: who(i, `${name} ${what}`), color: colour(i) });
        if (hm.steps > hm.x0.length) notes.push(`${several() ? r.label + ": " : ""}max per bucket of ${Math.ceil(hm.steps / hm.x0.length)} steps`);
        if (key === "update_ratio" && !r.update_ratio.exact) notes.push(`${several() ? r.label + ": " : ""}lower bound from norms`);
      });
      if (!series.length) continue;
      const id = "layer:" + key, log = id in state.log ? state.log[id] : wantsLog(series.flatMap(s => s.y));
      const c = addLineChart(grid, what, { id, series, legend: legend(series), log, toggle: true, height: 190, margin: SMALL, skipped, connect: true },
        [name].concat(notes).join(" · "), state.log, cv => { cv.dataset.tensor = name; });
      layerCharts.push(c); c.draw();
    }
  }
  function pick(name) {
    state.layer = name;
    const sel = document.getElementById("layer-select");
    if (sel) { sel.value = name; sel.dispatchEvent(new Event("change")); sel.scrollIntoView({ block: "nearest" }); }
  }

  // -- heatmaps and the NaN/Inf timeline, per run ---------------------------------------
  function heatmaps() {
    const gh = clear("grad-heatmap"), rh = clear("ratio-heatmaps");
    D.runs.forEach((r, i) => {
      const pre = several() ? `${r.label}: ` : "", tag = several() ? `@${i}` : "", hm = r.grad_norms;
      if (hm) charts.push(addHeatmap(gh, "grad_norms" + tag, hm, pre + `${hm.names.length} tensors × ${hm.steps} steps` +
        (hm.steps > hm.x0.length ? ` in ${hm.x0.length} columns (max per column)` : ""), pick));
      else empty(gh, pre + "No gradients were recorded.");
      const ur = r.update_ratio || {};
      if (ur.exact) charts.push(addHeatmap(rh, "update_ratio:exact" + tag, ur.exact, pre + "Exact ‖θ_{t+1} − θ_t‖ / ‖θ_t‖", pick));
      if (ur.lower_bound) charts.push(addHeatmap(rh, "update_ratio:lower_bound" + tag, ur.lower_bound, pre + "Lower bound | ‖θ_{t+1}‖ − ‖θ_t‖ | / ‖θ_t‖ (from stats)", pick));
      if (!ur.exact && !ur.lower_bound) empty(rh, pre + "No parameters were recorded.");
    });
  }
  function nonfinite(skipped) {
    const nc = clear("nonfinite-chart"), nf = D.runs.map(r => r.nonfinite);
    const affected = nf.map((n, i) => `${several() ? D.runs[i].label + ": " : ""}${n.steps_with_nonfinite} steps affected, at most ${n.max_count} tensors; ` +
      `${D.runs[i].summary.skipped_steps} skipped steps`).join(" · ");
    charts.push(addLineChart(nc, `tensors with NaN/Inf per step: ${affected} (grey)`, { id: "nonfinite",
      series: nf.map((n, i) => ({ x: n.x0, x1: n.x1, y: n.count, label: who(i, "tensors with NaN/Inf"), color: several() ? colour(i) : "#d62728" })),
      bars: true, height: 150, margin: WIDE, skipped }));
  }

  // -- the whole page -------------------------------------------------------------------
  function build() {
    ctx.X0 = D.domain[0]; ctx.X1 = D.domain[1] + 1;
    ctx.findings = D.runs.flatMap(r => r.findings.filter(f => f.step !== null && f.step !== undefined));
    ctx.labels = D.runs.map(r => r.label);
    charts = [];
    const skipped = skippedBands();
    scalars(skipped); layers(skipped); heatmaps(); moments(skipped); nonfinite(skipped);
  }
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
          build(); drawAll();
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
