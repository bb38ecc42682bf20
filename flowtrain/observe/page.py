"""The live status page (``/`` of ``flowtrain.observe.server``): one HTML file with its script and
style inline, nothing fetched from anywhere but the job itself (the machine may be offline).

Every second it reads ``/metrics`` (the Prometheus text, parsed in the page) and ``/status.json``;
the numbers it shows are the ``/metrics`` samples as they are (each element carries
``data-metric``, ``data-labels`` and ``data-value``; ``<body data-sample>`` says which snapshot),
and it keeps the last ``WINDOW_S`` seconds of them for the charts (plain canvas): events/s (the
rate of ``flowtrain_events_total`` between two snapshots), the loss and prequential metric, the
published and serving model versions; the scorer's drift panel (``drift`` of ``/status.json``): features
ranked by drift, each row (``data-feature``, ``data-alarm``) with its measures and an SVG of its reference
and current histograms.
"""
from __future__ import annotations

WINDOW_S = 600

PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{title}} status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font-family:system-ui,sans-serif;margin:0;background:#f6f7f9;color:#222}
header{background:#223;color:#fff;padding:10px 18px;display:flex;gap:18px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}
#state{font-weight:bold;padding:2px 8px;border-radius:4px;background:#567}
#state.running{background:#2a7d3b}#state.stopped{background:#777}#state.failed{background:#b33}
main{padding:12px 18px;display:grid;grid-template-columns:repeat(auto-fit,minmax(320px,1fr));gap:12px}
section{background:#fff;border:1px solid #dde;border-radius:6px;padding:10px 12px}
section h2{font-size:14px;margin:0 0 8px;color:#445}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(130px,1fr));gap:8px;grid-column:1/-1}
.card{background:#fff;border:1px solid #dde;border-radius:6px;padding:8px 10px}
.card .label{font-size:11px;color:#667;text-transform:uppercase}.card .num{font-size:20px;font-weight:600}
table{border-collapse:collapse;width:100%;font-size:12px}th,td{border-bottom:1px solid #eee;padding:3px 5px;
text-align:left;vertical-align:top}td.num{text-align:right;font-variant-numeric:tabular-nums}
canvas{width:100%;height:160px;display:block}.wide{grid-column:1/-1}.muted{color:#889;font-size:12px}
.err{color:#b33}code{font-size:11px;word-break:break-all}
</style></head>
<body data-sample="0">
<header><h1>{{title}}</h1><span id="state">connecting</span><span id="halves"></span>
<span class="muted" id="sampled"></span><span class="err" id="error"></span></header>
<main>
<div class="cards" id="cards"></div>
<section><h2>events/s</h2><canvas id="chart-events" data-points="0"></canvas></section>
<section><h2>loss and prequential metric</h2><canvas id="chart-loss" data-points="0"></canvas></section>
<section><h2>model version (published, serving)</h2><canvas id="chart-version" data-points="0"></canvas></section>
<section><h2>consumer lag per partition</h2><table id="lag"><thead><tr><th>partition</th><th>records</th></tr>
</thead><tbody></tbody></table></section>
<section><h2>dead letters by reason</h2><table id="reasons"><thead><tr><th>reason</th><th>count</th></tr></thead>
<tbody></tbody></table></section>
<section class="wide"><h2>newest dead letters</h2><table id="dead-letters"><thead><tr><th>time</th><th>reason</th>
<th>source</th><th>payload</th></tr></thead><tbody></tbody></table></section>
<section class="wide" id="drift-panel"><h2>drift: scorer window against the training data</h2>
<p class="muted" id="drift-summary">no drift window yet</p><table id="drift"><thead><tr><th>feature</th>
<th>measures</th><th>alarm</th><th>histograms (reference, current)</th></tr></thead><tbody></tbody></table></section>
<section class="wide"><h2>model versions</h2><table id="versions"><thead><tr><th>version</th><th>state</th>
<th>reason</th><th>time</th></tr></thead><tbody></tbody></table></section>
<section class="wide"><h2>all metrics (/metrics)</h2><table id="metrics"><thead><tr><th>metric</th><th>labels</th>
<th>value</th></tr></thead><tbody></tbody></table></section>
</main>
<script>
"use strict";
const WINDOW_S = 600;
const samples = [];  // {t, sample, metrics}
const CARDS = [
  ["events/s", null, "rate"], ["events", "flowtrain_events_total"], ["rows", "flowtrain_rows_total"],
  ["dead letters", "flowtrain_dead_letters_total"], ["trainer step", "flowtrain_trainer_step"],
  ["rows trained", "flowtrain_rows_trained_total"], ["train loss", "flowtrain_train_loss"],
  ["published version", "flowtrain_published_version"], ["serving version", "flowtrain_serving_version"],
  ["announced version", "flowtrain_announced_version"], ["serving lag (s)", "flowtrain_serving_lag_seconds"],
  ["model freshness (s)", "flowtrain_model_freshness_seconds"], ["predictions", "flowtrain_predictions_total"]];

function parseMetrics(text) {
  // Prometheus text format: name{label="value",...} value
  const out = {};
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    let name, labels = {}, rest;
    const brace = line.indexOf("{");
    const space = line.indexOf(" ");
    if (brace >= 0 && brace < space) {
      name = line.slice(0, brace);
      let i = brace + 1;
      while (line[i] !== "}") {
        const eq = line.indexOf("=", i);
        const key = line.slice(i, eq).trim();
        let j = eq + 2, value = "";
        while (line[j] !== '"') {
          if (line[j] === "\\") { j++; value += line[j] === "n" ? "\n" : line[j]; } else { value += line[j]; }
          j++;
        }
        labels[key] = value;
        i = j + 1;
        if (line[i] === ",") i++;
      }
      rest = line.slice(i + 1).trim();
    } else {
      name = line.slice(0, space);
      rest = line.slice(space + 1).trim();
    }
    const valueText = rest.split(/\s+/)[0];
    (out[name] = out[name] || []).push({labels, valueText, value: parseFloat(valueText)});
  }
  return out;
}

function one(metrics, name, labels) {
  const found = metrics[name] || [];
  const want = JSON.stringify(labels || {});
  return found.find(s => JSON.stringify(s.labels) === want);
}

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Number.isInteger(v)) return v.toLocaleString("en-US");
  return Math.abs(v) >= 100 ? v.toFixed(1) : v.toPrecision(4);
}

function numberCell(tag, name, sample) {
  const el = document.createElement(tag);
  el.className = "num";
  el.dataset.metric = name;
  el.dataset.labels = JSON.stringify(sample.labels);
  el.dataset.value = sample.valueText;
  el.textContent = fmt(sample.value);
  return el;
}

function rate() {
  if (samples.length < 2) return null;
  const a = samples[samples.length - 2], b = samples[samples.length - 1];
  const ea = one(a.metrics, "flowtrain_events_total"), eb = one(b.metrics, "flowtrain_events_total");
  if (!ea || !eb || b.t <= a.t) return null;
  return Math.max(0, (eb.value - ea.value) / (b.t - a.t));
}

function renderCards(metrics) {
  const cards = document.getElementById("cards");
  cards.replaceChildren();
  const preq = metrics["flowtrain_prequential"] || [];
  const list = CARDS.concat(preq.map(s => ["prequential " + s.labels.metric, "flowtrain_prequential", null, s]));
  for (const [label, name, kind, given] of list) {
    const card = document.createElement("div");
    card.className = "card";
    const l = document.createElement("div");
    l.className = "label";
    l.textContent = label;
    card.appendChild(l);
    if (kind === "rate") {
      const el = document.createElement("div");
      el.className = "num";
      el.id = "events-rate";
      const r = samples.length ? samples[samples.length - 1].rate : null;
      el.textContent = r === null ? "–" : fmt(Math.round(r));
      card.appendChild(el);
    } else {
      const sample = given || one(metrics, name);
      const labelled = metrics[name] || [];
      if (sample) {
        card.appendChild(numberCell("div", name, sample));
      } else if (labelled.length) {  // a counter by label (predictions by model version): their sum
        const el = document.createElement("div");
        el.className = "num";
        el.title = labelled.map(s => JSON.stringify(s.labels) + " " + s.valueText).join("\n");
        el.textContent = fmt(labelled.reduce((a, s) => a + s.value, 0));
        card.appendChild(el);
      } else {
        continue;
      }
    }
    cards.appendChild(card);
  }
}

function renderTable(id, rows) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...rows);
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = 4; td.className = "muted"; td.textContent = "none";
    tr.appendChild(td);
    body.appendChild(tr);
  }
}

function textCell(text) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "–" : String(text);
  return td;
}

function renderMetrics(metrics) {
  const lag = (metrics["flowtrain_consumer_lag"] || []).map(s => {
    const tr = document.createElement("tr");
    tr.append(textCell(s.labels.partition), numberCell("td", "flowtrain_consumer_lag", s));
    return tr;
  });
  renderTable("lag", lag);
  const reasons = (metrics["flowtrain_dead_letters_by_reason_total"] || []).map(s => {
    const tr = document.createElement("tr");
    tr.append(textCell(s.labels.reason), numberCell("td", "flowtrain_dead_letters_by_reason_total", s));
    return tr;
  });
  renderTable("reasons", reasons);
  const all = [];
  for (const name of Object.keys(metrics).sort()) {
    for (const s of metrics[name]) {
      const tr = document.createElement("tr");
      const labels = Object.entries(s.labels).map(([k, v]) => k + "=" + v).join(", ");
      tr.append(textCell(name), textCell(labels), numberCell("td", name, s));
      all.push(tr);
    }
  }
  renderTable("metrics", all);
}

function renderStatus(status) {
  const state = document.getElementById("state");
  state.textContent = status.state || "?";
  state.className = status.state || "";
  document.getElementById("halves").textContent = Object.entries(status.halves || {})
    .map(([k, v]) => k + ": " + v).join("  ");
  document.getElementById("error").textContent = status.sample_error || "";
  const letters = (status.dead_letters || []).map(d => {
    const tr = document.createElement("tr");
    const code = document.createElement("code");
    code.textContent = d.payload || "";
    const td = document.createElement("td");
    td.appendChild(code);
    tr.append(textCell(d.time ? new Date(d.time * 1000).toLocaleTimeString() : ""), textCell(d.reason),
              textCell(d.source), td);
    return tr;
  });
  renderTable("dead-letters", letters);
  const versions = (status.versions || []).map(v => {
    const tr = document.createElement("tr");
    tr.append(textCell(v.version), textCell(v.state), textCell(v.reason),
              textCell(v.time ? new Date(v.time * 1000).toLocaleTimeString() : ""));
    return tr;
  });
  renderTable("versions", versions);
}

const SVG = "http://www.w3.org/2000/svg";
function histogram(buckets, reference, current) {
  // grouped bars: the reference's share (grey) and the window's (orange) of each bucket
  const w = 360, h = 70, n = Math.max(1, buckets.length), slot = w / n, bar = Math.max(1, slot * 0.4);
  const top = Math.max(1e-9, ...reference, ...current);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", h); svg.setAttribute("class", "drift-histogram");
  buckets.forEach((name, i) => {
    [[reference, "#7a8ca6", "reference"], [current, "#e08a2c", "current"]].forEach(([shares, color, what], j) => {
      const share = shares[i] || 0, bh = h * share / top;
      const r = document.createElementNS(SVG, "rect");
      r.setAttribute("x", i * slot + j * bar); r.setAttribute("y", h - bh);
      r.setAttribute("width", bar); r.setAttribute("height", bh); r.setAttribute("fill", color);
      r.dataset.series = what; r.dataset.share = String(share);
      const t = document.createElementNS(SVG, "title");
      t.textContent = String(name) + " " + what + ": " + (100 * share).toFixed(1) + "%";
      r.appendChild(t); svg.appendChild(r);
    });
  });
  return svg;
}

function renderDrift(drift) {
  const summary = document.getElementById("drift-summary");
  if (!drift) { summary.textContent = "no drift window yet"; renderTable("drift", []); return; }
  summary.textContent = drift.rows + " scored events in the window (" + drift.instances + " scorer instance(s)); " +
    (drift.alarms.length ? "ALARM: " + drift.alarms.join(", ") : "no measure over its threshold");
  summary.className = drift.alarms.length ? "err" : "muted";
  const rows = (drift.features || []).map(e => {  // ranked by drift (largest measure / threshold first)
    const tr = document.createElement("tr");
    tr.dataset.feature = e.feature; tr.dataset.alarm = e.alarm ? "1" : "0";
    const measures = Object.entries(e.measures || {}).map(([k, v]) =>
      k + " " + (typeof v === "number" ? fmt(v) : v)).join(", ");
    const alarm = textCell(e.alarm ? e.alarms.join(", ") : "");
    if (e.alarm) alarm.className = "err";
    const chart = document.createElement("td");
    if ((e.buckets || []).length) chart.appendChild(histogram(e.buckets, e.reference || [], e.current || []));
    tr.append(textCell(e.feature + " (" + e.kind + ")"), textCell(measures), alarm, chart);
    return tr;
  });
  renderTable("drift", rows);
}

function drawChart(id, series) {
  const canvas = document.getElementById(id);
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 300, h = canvas.clientHeight || 160;
  canvas.width = w * ratio; canvas.height = h * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, w, h);
  const points = series.flatMap(s => s.points);
  canvas.dataset.points = String(points.length);
  const left = 48, bottom = 18, top = 16;
  ctx.strokeStyle = "#ccd"; ctx.beginPath(); ctx.moveTo(left, top); ctx.lineTo(left, h - bottom);
  ctx.lineTo(w - 4, h - bottom); ctx.stroke();
  if (!points.length) return;
  const now = samples[samples.length - 1].t;
  let lo = Math.min(...points.map(p => p[1])), hi = Math.max(...points.map(p => p[1]));
  if (hi === lo) { hi += 1; lo -= lo === 0 ? 0 : 1; }
  const span = Math.max(10, Math.min(WINDOW_S, now - samples[0].t));  // the last minutes (at most WINDOW_S)
  const x = t => left + (w - left - 6) * (1 - (now - t) / span);
  const y = v => h - bottom - (h - bottom - top) * (v - lo) / (hi - lo);
  ctx.fillStyle = "#667"; ctx.font = "10px sans-serif";
  ctx.fillText(fmt(hi), 2, top + 4); ctx.fillText(fmt(lo), 2, h - bottom);
  ctx.fillText(span >= 120 ? "-" + Math.round(span / 60) + " min" : "-" + Math.round(span) + " s", left, h - 4);
  ctx.fillText("now", w - 24, h - 4);
  let legend = left + 4;
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.fillStyle = s.color; ctx.lineWidth = 1.5; ctx.beginPath();
    s.points.forEach((p, i) => i ? ctx.lineTo(x(p[0]), y(p[1])) : ctx.moveTo(x(p[0]), y(p[1])));
    ctx.stroke();
    if (s.points.length === 1) ctx.fillRect(x(s.points[0][0]) - 2, y(s.points[0][1]) - 2, 4, 4);
    ctx.fillText(s.name, legend, 11); legend += ctx.measureText(s.name).width + 14;
  }
}

function series(name, labels, color, label) {
  const points = [];
  for (const h of samples) {
    const s = one(h.metrics, name, labels);
    if (s && Number.isFinite(s.value)) points.push([h.t, s.value]);
  }
  return {name: label, color, points};
}

function drawCharts() {
  drawChart("chart-events", [{name: "events/s", color: "#2a6fdb",
    points: samples.filter(h => h.rate !== null).map(h => [h.t, h.rate])}]);
  const preq = (samples.length ? samples[samples.length - 1].metrics["flowtrain_prequential"] || [] : [])
    .filter(s => s.labels.metric !== "rows" && s.labels.metric !== "positive_rate");
  drawChart("chart-loss", [series("flowtrain_train_loss", {}, "#d9822b", "train loss")].concat(
    preq.slice(0, 3).map((s, i) => series("flowtrain_prequential", s.labels, ["#2a7d3b", "#8a3ab9", "#b33"][i],
                                         "prequential " + s.labels.metric))));
  drawChart("chart-version", [series("flowtrain_published_version", {}, "#2a6fdb", "published"),
                              series("flowtrain_serving_version", {}, "#2a7d3b", "serving")]);
}

async function poll() {
  try {
    const [m, s] = await Promise.all([fetch("/metrics", {cache: "no-store"}),
                                      fetch("/status.json", {cache: "no-store"})]);
    const metrics = parseMetrics(await m.text());
    const status = await s.json();
    const sample = one(metrics, "flowtrain_sample_number");
    const at = one(metrics, "flowtrain_sample_timestamp_seconds");
    const number = sample ? sample.value : 0;
    if (!samples.length || samples[samples.length - 1].sample !== number) {
      samples.push({t: at ? at.value : Date.now() / 1000, sample: number, metrics, rate: null});
      samples[samples.length - 1].rate = rate();
      while (samples.length && samples[samples.length - 1].t - samples[0].t > WINDOW_S) samples.shift();
    }
    renderCards(metrics);
    renderMetrics(metrics);
    renderStatus(status);
    renderDrift(status.drift);
    drawCharts();
    document.body.dataset.sample = String(number);
    document.getElementById("sampled").textContent = "snapshot " + number + " at " +
      new Date((at ? at.value : 0) * 1000).toLocaleTimeString();
  } catch (err) {
    document.getElementById("state").textContent = "unreachable";
    document.getElementById("state").className = "failed";
  }
}
poll();
setInterval(poll, 1000);
</script>
</body></html>
"""
