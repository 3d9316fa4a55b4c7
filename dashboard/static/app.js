// edgefl dashboard: one script for the device page (index.html with device.html) and the coordinator
// page (index.html with coordinator.html), chosen by <body data-kind>. Plain browser JavaScript, no build step, no
// dependencies. Data: GET /api/status once, then Server-Sent Events from /api/events carrying the
// same document {kind, title, status}; the device page also seeds its RSS chart from /api/history
// (kept by the app) and appends every pushed RSS value; the coordinator page seeds its memory chart
// the same way and reads the rounds history from /api/rounds. Any missing or null field shows as
// "–". Text from the network is only ever set with textContent. Colours against the cap mean one
// thing on both pages: amber under 15 % of the cap free, red under 5 %.
"use strict";

(() => {
  const DASH = "–";
  const KIND = document.body.dataset.kind;
  const CHART_WINDOW_S = 300;
  const PHASES = ["inference", "batch", "train", "encode", "publish", "apply"];
  const STATES = new Set(["idle", "training", "uploading", "waiting", "deferred", "offline",
    "open", "collecting", "aggregating", "done", "closed", "online"]);

  // ---------------------------------------------------------------------------------------------
  // formatting

  const isNum = (v) => typeof v === "number" && Number.isFinite(v);

  function bytes(v) {
    if (!isNum(v)) return DASH;
    const a = Math.abs(v);
    if (a >= 1024 ** 3) return (v / 1024 ** 3).toFixed(2) + " GiB";
    if (a >= 1024 ** 2) return (v / 1024 ** 2).toFixed(1) + " MiB";
    if (a >= 1024) return (v / 1024).toFixed(1) + " KiB";
    return Math.round(v) + " B";
  }

  const FORMATS = {
    bytes,
    int: (v) => (isNum(v) ? Math.round(v).toLocaleString("en-US") : DASH),
    percent: (v) => (isNum(v) ? (100 * v).toFixed(1) + " %" : DASH),
    rate: (v) => (isNum(v) ? v.toFixed(v < 10 ? 2 : 1) + " samples/s" : DASH),
    seconds: (v) => (isNum(v) ? Math.max(0, v).toFixed(0) + " s" : DASH),
    text: (v) => (typeof v === "string" && v !== "" ? v : isNum(v) ? String(v) : DASH),
  };

  function setText(id, text) {
    const el = document.getElementById(id);
    if (el) el.textContent = text;
  }

  // Every element with data-field="key" shows status[key] in its data-format; the raw value is kept
  // in data-value (the tests compare it with /proc).
  function fillFields(status) {
    for (const el of document.querySelectorAll("[data-field]")) {
      const v = status[el.dataset.field];
      const fmt = FORMATS[el.dataset.format] || FORMATS.text;
      el.textContent = fmt(v);
      el.dataset.value = v === undefined || v === null ? "" : String(v);
    }
  }

  function setBadge(el, state) {
    el.className = "badge";
    if (typeof state === "string" && state !== "") {
      el.textContent = state;
      el.dataset.state = state;
      if (STATES.has(state)) el.classList.add("state-" + state);
    } else {
      el.textContent = DASH;
      el.dataset.state = "";
    }
  }

  function fraction(part, whole) {
    return isNum(part) && isNum(whole) && whole > 0 ? Math.max(0, part / whole) : null;
  }

  // headroom = the share of the cap still free; under 15 % is a warning, under 5 % is trouble
  const WARN_HEADROOM = 0.15;
  const BAD_HEADROOM = 0.05;
  function headroomClass(free) {
    if (free === null || !isNum(free)) return "level-none";
    return free < BAD_HEADROOM ? "level-bad" : free < WARN_HEADROOM ? "level-warn" : "level-ok";
  }
  // for a share of the cap in use
  const levelClass = (used) => (used === null ? "" : headroomClass(1 - used));

  function fillCounts(tableId, counts) {
    const table = document.getElementById(tableId);
    const body = document.createElement("tbody");
    const entries = counts && typeof counts === "object" ? Object.entries(counts) : [];
    entries.sort((a, b) => (Number(b[1]) || 0) - (Number(a[1]) || 0));
    if (entries.length === 0) {
      const td = body.insertRow().insertCell();
      td.className = "muted";
      td.textContent = counts && typeof counts === "object" ? "none" : DASH;
    }
    for (const [reason, n] of entries) {
      const row = body.insertRow();
      row.insertCell().textContent = reason;
      const td = row.insertCell();
      td.className = "num";
      td.textContent = FORMATS.int(n);
    }
    table.replaceChild(body, table.tBodies[0]);
  }

  // who refused what: rows {by, reason, count, detail} (the coordinator's own refusals and each
  // device's); an older coordinator sends only its own {reason: count}
  function fillRefusals(tableId, rows, own) {
    if (!Array.isArray(rows)) {
      fillCounts(tableId, own);
      return;
    }
    const table = document.getElementById(tableId);
    const body = document.createElement("tbody");
    const kept = rows.filter((r) => obj(r) && typeof r.reason === "string" && isNum(r.count));
    if (kept.length === 0) {
      const td = body.insertRow().insertCell();
      td.className = "muted";
      td.textContent = "none";
    }
    for (const r of kept) {
      const row = body.insertRow();
      row.dataset.by = String(r.by);
      const who = row.insertCell();
      who.className = "by";
      who.textContent = r.by === "coordinator" ? "coordinator" : `device ${r.by}`;
      const why = row.insertCell();
      why.textContent = r.reason;
      if (typeof r.detail === "string" && r.detail) {
        const detail = document.createElement("div");
        detail.className = "muted detail";
        detail.textContent = r.detail;
        why.append(detail);
        why.title = r.detail;
      }
      const td = row.insertCell();
      td.className = "num";
      td.textContent = FORMATS.int(r.count);
    }
    table.replaceChild(body, table.tBodies[0]);
  }

  // ---------------------------------------------------------------------------------------------
  // a small line chart on a canvas (no library)

  function css(name) {
    return getComputedStyle(document.body).getPropertyValue(name).trim() || "#888";
  }

  function prepareCanvas(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth;
    const h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
      canvas.width = Math.round(w * ratio);
      canvas.height = Math.round(h * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h };
  }

  // the smallest of 1, 2, 2.5, 5 x 10^k that is >= x (axis steps people can read)
  function niceStep(x) {
    const p = 10 ** Math.floor(Math.log10(x));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= x) return m * p;
    return 10 * p;
  }

  // series: [{points: [[x, y]...], color, dots}], lines: [{y, color, label}]
  function drawChart(canvas, opts) {
    const { ctx, w, h } = prepareCanvas(canvas);
    const pad = { l: 58, r: 12, t: 10, b: 22 };
    const pw = w - pad.l - pad.r;
    const ph = h - pad.t - pad.b;
    if (pw <= 10 || ph <= 10) return;
    const X = (x) => pad.l + ((x - opts.xMin) / (opts.xMax - opts.xMin || 1)) * pw;
    const Y = (y) => pad.t + ph - ((y - opts.yMin) / (opts.yMax - opts.yMin || 1)) * ph;
    ctx.strokeStyle = css("--grid");
    ctx.fillStyle = css("--muted");
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const yTicks = opts.yTicks || [0, 1, 2, 3, 4].map((i) => opts.yMin + ((opts.yMax - opts.yMin) * i) / 4);
    for (const y of yTicks) {
      ctx.beginPath();
      ctx.moveTo(pad.l, Y(y) + 0.5);
      ctx.lineTo(pad.l + pw, Y(y) + 0.5);
      ctx.stroke();
      ctx.fillText(opts.yFmt(y), pad.l - 6, Y(y));
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (const x of opts.xTicks) {
      // a label at either end stays inside the canvas
      const text = opts.xFmt(x);
      const half = ctx.measureText(text).width / 2;
      ctx.fillText(text, Math.min(w - half - 1, Math.max(half + 1, X(x))), pad.t + ph + 6);
    }
    for (const line of opts.lines || []) {
      if (!isNum(line.y)) continue;
      ctx.save();
      ctx.setLineDash([5, 4]);
      ctx.strokeStyle = line.color;
      ctx.beginPath();
      ctx.moveTo(pad.l, Y(line.y) + 0.5);
      ctx.lineTo(pad.l + pw, Y(line.y) + 0.5);
      ctx.stroke();
      ctx.restore();
      ctx.fillStyle = line.color;
      ctx.textBaseline = "bottom";
      // labels alternate between the left and the right end, so two close lines stay readable
      const right = (opts.lines || []).indexOf(line) % 2 === 1;
      ctx.textAlign = right ? "right" : "left";
      ctx.fillText(line.label, right ? pad.l + pw - 4 : pad.l + 4, Y(line.y) - 2);
    }
    for (const s of opts.series) {
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      ctx.lineWidth = 2;
      ctx.setLineDash(s.dashed ? [6, 4] : []);
      ctx.beginPath();
      let started = false;
      for (const [x, y] of s.points) {
        if (!isNum(y)) { started = false; continue; }
        if (started) ctx.lineTo(X(x), Y(y)); else ctx.moveTo(X(x), Y(y));
        started = true;
      }
      ctx.stroke();
      ctx.setLineDash([]);
      if (s.dots) {
        for (const [x, y] of s.points) {
          if (!isNum(y)) continue;
          ctx.beginPath();
          ctx.arc(X(x), Y(y), 3, 0, 2 * Math.PI);
          ctx.fill();
        }
      }
    }
  }

  // ---------------------------------------------------------------------------------------------
  // device page

  const rssPoints = []; // [local time in s, bytes], bounded to CHART_WINDOW_S
  let lastDevice = {};
  const nowS = () => performance.now() / 1000;

  function addRssPoint(t, v) {
    if (!isNum(v)) return;
    if (rssPoints.length && t - rssPoints[rssPoints.length - 1][0] < 0.5) {
      rssPoints[rssPoints.length - 1] = [t, v];
    } else {
      rssPoints.push([t, v]);
    }
    while (rssPoints.length && rssPoints[0][0] < t - CHART_WINDOW_S) rssPoints.shift();
  }

  // The time axis spans the data there is, from 1 minute (just started) up to CHART_WINDOW_S.
  function drawRssChart() {
    const canvas = document.getElementById("rss-chart");
    const s = lastDevice;
    const now = nowS();
    const pts = rssPoints.map(([t, v]) => [t - now, v / 1024 ** 2]);
    const span = pts.length ? -pts[0][0] : 0;
    const win = Math.min(CHART_WINDOW_S, Math.max(60, Math.ceil(span / 60) * 60));
    // labels at least ~60 px apart: none overlap on a phone
    const room = Math.max(2, Math.floor((canvas.clientWidth - 70) / 60));
    const tickStep = [10, 15, 30, 60, 120].find((st) => win / st <= room) || 300;
    const ticks = [];
    for (let x = -win; x <= 0; x += tickStep) ticks.push(x);
    setText("chart-window", win < 120 ? `last ${win} s` : `last ${win / 60} min`);
    const cap = isNum(s.cap_bytes) ? s.cap_bytes / 1024 ** 2 : null;
    const peak = isNum(s.peak_rss_bytes) ? s.peak_rss_bytes / 1024 ** 2 : null;
    const top = Math.max(cap || 0, peak || 0, ...pts.map((p) => p[1]), 1) * 1.05;
    const step = niceStep(top / 4);
    const yMax = Math.ceil(top / step) * step;
    const yTicks = [];
    for (let y = 0; y <= yMax + step / 2; y += step) yTicks.push(y);
    drawChart(canvas, {
      xMin: -win, xMax: 0, yMin: 0, yMax, yTicks,
      xTicks: ticks,
      xFmt: (x) => (x === 0 ? "now" : tickStep < 60 ? x + " s" : x / 60 + " min"),
      yFmt: (y) => Number(y.toFixed(1)) + " MiB",
      series: [{ points: pts, color: css("--rss") }],
      lines: [
        { y: cap, color: css("--bad"), label: "cap" },
        { y: peak, color: css("--peak"), label: "peak" },
      ],
    });
  }

  let lastUpdate = null; // {bytes, age_s (at at_s, or null), at_s}

  function ago(seconds) {
    if (!isNum(seconds)) return "";
    const v = Math.max(0, seconds);
    if (v < 90) return `${v.toFixed(0)} s ago`;
    if (v < 5400) return `${(v / 60).toFixed(0)} min ago`;
    if (v < 172800) return `${(v / 3600).toFixed(0)} h ago`;
    return `${(v / 86400).toFixed(0)} days ago`;
  }

  function tickLastUpdate() {
    if (!lastUpdate) { setText("update-bytes", DASH); return; }
    const age = lastUpdate.age_s === null ? null : lastUpdate.age_s + (nowS() - lastUpdate.at_s);
    setText("update-bytes", bytes(lastUpdate.bytes) + (age === null ? "" : ", " + ago(age)));
  }

  function renderDevice(s) {
    lastDevice = s;
    const cap = s.cap_bytes;
    const rssFrac = fraction(s.rss_bytes, cap);
    const fill = document.getElementById("gauge-fill");
    fill.style.width = rssFrac === null ? "0" : Math.min(100, rssFrac * 100).toFixed(2) + "%";
    fill.className = "gauge-fill " + levelClass(rssFrac);
    document.getElementById("gauge").dataset.level = levelClass(rssFrac).replace("level-", "");
    for (const [id, key] of [["gauge-pss", "pss_bytes"], ["gauge-peak", "peak_rss_bytes"]]) {
      const f = fraction(s[key], cap);
      const mark = document.getElementById(id);
      mark.hidden = f === null;
      if (f !== null) mark.style.left = Math.min(100, f * 100).toFixed(2) + "%";
    }
    const gauge = document.getElementById("gauge");
    if (rssFrac === null) gauge.removeAttribute("aria-valuenow");
    else gauge.setAttribute("aria-valuenow", (rssFrac * 100).toFixed(1));
    setText("rss-pct", rssFrac === null ? DASH : (rssFrac * 100).toFixed(1) + " %");
    setText("headroom", isNum(cap) && isNum(s.rss_bytes) ? bytes(cap - s.rss_bytes) : DASH);

    setBadge(document.getElementById("state"), s.state);
    setText("reason", typeof s.reason === "string" && s.reason ? s.reason : "");

    // the agent's own words for its broker connection ("refused: not authorized", "connecting",
    // "lost") come first: a device that never connected does not say "lost"
    const broker = document.getElementById("broker");
    const connected = s.broker_connected;
    const said = typeof s.broker === "string" && s.broker && s.broker !== "connected" ? s.broker : null;
    broker.textContent = said ? "broker " + said
      : connected === true ? "broker connected" : connected === false ? "broker disconnected" : "broker " + DASH;
    broker.className = "pill " + (connected === true ? "pill-ok" : connected === false || said ? "pill-bad" : "");
    broker.dataset.state = said || (connected === true ? "connected" : connected === false ? "disconnected" : "");

    lastUpdate = isNum(s.last_update_bytes) && s.last_update_bytes > 0
      ? { bytes: s.last_update_bytes,
          age_s: isNum(s.ts) && isNum(s.last_update_ts) ? Math.max(0, s.ts - s.last_update_ts) : null,
          at_s: nowS() }
      : null;
    tickLastUpdate();
    const globalAcc = isNum(s.global_accuracy) ? s.global_accuracy : s.eval_accuracy;
    setText("global-accuracy", FORMATS.percent(globalAcc)
      + (isNum(s.eval_count) && !isNum(s.global_accuracy) ? ` of ${FORMATS.int(s.eval_count)}` : ""));

    const peaks = s.phase_peaks && typeof s.phase_peaks === "object" ? s.phase_peaks : {};
    const rises = s.phase_rise && typeof s.phase_rise === "object" ? s.phase_rise : {};
    for (const phase of PHASES) {
      const row = document.querySelector(`#phases tr[data-phase="${phase}"]`);
      const f = fraction(peaks[phase], cap);
      const bar = row.querySelector(".bar-fill");
      bar.style.width = f === null ? "0" : Math.min(100, f * 100).toFixed(2) + "%";
      bar.className = "bar-fill " + levelClass(f);
      const cell = row.querySelector(".num");
      const rise = rises[phase];
      if (!isNum(peaks[phase]) && phase === "batch" && s.pipeline_mode === "fused") {
        cell.textContent = "part of inference (fused pipeline)";
      } else {
        cell.textContent = bytes(peaks[phase]) + (f === null ? "" : ` · ${(f * 100).toFixed(0)} %`)
          + (isNum(rise) ? ` · +${bytes(rise)}` : "");
      }
      cell.dataset.value = isNum(peaks[phase]) ? String(peaks[phase]) : "";
      cell.dataset.rise = isNum(rise) ? String(rise) : "";
    }
    fillCounts("rejected", s.rejected);
    addRssPoint(nowS(), s.rss_bytes);
    drawRssChart();
  }

  // Seed a chart from /api/history: ``seed(doc, now)`` gets the document and this page's clock (s).
  async function fetchHistory(what, seed) {
    try {
      const r = await fetch("/api/history", { cache: "no-store" });
      if (!r.ok) return;
      seed(await r.json(), nowS());
    } catch (err) {
      console.warn(`edgefl: ${what} history unavailable`, err);
    }
  }

  // The seeded points, then the points of ``known`` newer than the last seeded one.
  function seededThen(seeded, known) {
    return seeded.concat(known.filter((p) => !seeded.length || p[0] > seeded[seeded.length - 1][0]));
  }

  function loadHistory() {
    return fetchHistory("RSS", (doc, now) => {
      const seeded = (doc.rss || []).filter((p) => isNum(p[0]) && isNum(p[1])).map(([age, v]) => [now - age, v]);
      const points = seededThen(seeded, rssPoints);
      rssPoints.length = 0;
      for (const p of points) rssPoints.push(p);
      drawRssChart();
    });
  }

  // ---------------------------------------------------------------------------------------------
  // coordinator page: the fleet's state in words, one row per device (worst headroom first), the
  // accuracy and memory charts, the rounds history (from /api/rounds, paged)

  let deadline = null; // {left_s, at_s}

  function tickDeadline() {
    if (!deadline) { setText("deadline", DASH); return; }
    setText("deadline", FORMATS.seconds(deadline.left_s - (nowS() - deadline.at_s)));
  }

  let lastCoordinator = {};
  const obj = (v) => (v && typeof v === "object" && !Array.isArray(v) ? v : null);

  // The fleet's state in words: the coordinator's fleet_state when it sends one; otherwise what its
  // other fields tell (a broker the coordinator cannot reach first).
  function fleetState(s) {
    const fs = obj(s.fleet_state);
    const state = fs && typeof fs.state === "string" && fs.state ? fs.state : null;
    const text = fs && typeof fs.text === "string" && fs.text ? fs.text : null;
    if (state) return { state, text: text || state.replace(/_/g, " ") };
    if (s.broker_connected === false) {
      return { state: "broker_unreachable", text: "broker unreachable: the coordinator is reconnecting" };
    }
    if (s.state === "collecting") {
      return { state: "collecting", text: `collecting ${FORMATS.int(s.updates_received)} of ${FORMATS.int(s.updates_expected)}` };
    }
    if (s.state === "aggregated") return { state: "aggregated", text: `between rounds: round ${FORMATS.int(s.round)} aggregated` };
    if (s.state === "idle") return { state: "idle", text: "idle: no round opened yet" };
    if (typeof s.state === "string" && s.state) return { state: s.state, text: s.state };
    return { state: "", text: DASH };
  }

  function headroomOf(d) {
    if (!isNum(d.cap_bytes) || d.cap_bytes <= 0 || !isNum(d.rss_bytes)) return null;
    return { bytes: d.cap_bytes - d.rss_bytes, frac: (d.cap_bytes - d.rss_bytes) / d.cap_bytes };
  }

  // a device's claimed accuracy: a number in [0, 1], else null (shown as a dash, never "5000 %")
  const isAcc = (v) => isNum(v) && v >= 0 && v <= 1;
  function accuracyOf(d, key) {
    if (key === "global") return isAcc(d.global_accuracy) ? d.global_accuracy : isAcc(d.eval_accuracy) ? d.eval_accuracy : null;
    return isAcc(d.personal_accuracy) ? d.personal_accuracy : null;
  }

  // sort keys: smaller = worse = first when ascending; offline and unknown devices are the worst
  const SORTS = {
    device: (name) => name,
    headroom: (name, d) => (d.online === false ? -2 : headroomOf(d) === null ? -1 : headroomOf(d).frac),
    peak: (name, d) => (isNum(d.peak_rss_bytes) && isNum(d.cap_bytes) && d.cap_bytes > 0
      ? -(d.peak_rss_bytes / d.cap_bytes) : 1),
    state: (name, d) => (typeof d.state === "string" ? d.state : "~"),
    last_round: (name, d) => (isNum(d.last_round) ? d.last_round : -1),
    personal: (name, d) => (isNum(accuracyOf(d, "personal")) ? accuracyOf(d, "personal") : 2),
    global: (name, d) => (isNum(accuracyOf(d, "global")) ? accuracyOf(d, "global") : 2),
  };
  let sortBy = { key: "headroom", dir: 1 };
  const DEVICE_ROWS = 20;
  let showAllDevices = false;

  function countsText(counts) {
    const o = obj(counts);
    if (!o) return "";
    return Object.keys(o).sort().filter((k) => Number(o[k]) > 0).map((k) => `${k} ${o[k]}`).join(", ");
  }

  function cell(row, col, text, cls) {
    const td = row.insertCell();
    td.dataset.col = col;
    td.dataset.label = HEADERS[col] || col;
    if (cls) td.className = cls;
    if (text !== undefined) td.textContent = text;
    return td;
  }
  const HEADERS = {
    device: "device", headroom: "headroom", peak: "peak", state: "state", reason: "reason",
    last_round: "last round", personal: "personal", global: "global", round: "round", time: "time",
    clients: "clients", accuracy: "accuracy", federated: "federated", refused: "refused",
    declined: "declined", bytes: "per update", seconds: "seconds",
  };

  function renderDevices(s) {
    const devices = obj(s.devices);
    const table = document.getElementById("devices");
    const body = document.createElement("tbody");
    const names = devices ? Object.keys(devices) : [];
    const key = SORTS[sortBy.key] || SORTS.headroom;
    const entry = (n) => obj(devices[n]) || {};
    names.sort((a, b) => {
      const ka = key(a, entry(a));
      const kb = key(b, entry(b));
      return (ka < kb ? -1 : ka > kb ? 1 : a < b ? -1 : a > b ? 1 : 0) * sortBy.dir;
    });
    let online = 0;
    for (const name of names) {
      const d = entry(name);
      if (d.online !== false && d.state !== "offline") online += 1;
    }
    // a large fleet: the worst rows first, the rest one click away (the charts stay near the top)
    const shown = showAllDevices ? names : names.slice(0, DEVICE_ROWS);
    for (const name of shown) {
      const d = entry(name);
      const row = body.insertRow();
      row.dataset.device = name;
      cell(row, "device", name);
      const hr = headroomOf(d);
      const head = cell(row, "headroom", undefined, "num");
      const level = headroomClass(hr ? hr.frac : null);
      const dot = document.createElement("i");
      dot.className = "dot " + level;
      const label = document.createElement("span");
      label.textContent = hr ? `${bytes(hr.bytes)} · ${(100 * hr.frac).toFixed(0)} %` : DASH;
      head.append(dot, label);
      head.dataset.level = level.replace("level-", "");
      head.dataset.value = hr ? String(hr.frac) : "";
      head.title = hr ? `${bytes(d.rss_bytes)} in use of a ${bytes(d.cap_bytes)} cap` : "no memory report";
      const pf = fraction(d.peak_rss_bytes, d.cap_bytes);
      const peak = cell(row, "peak", isNum(d.peak_rss_bytes)
        ? `${bytes(d.peak_rss_bytes)}${pf === null ? "" : ` · ${(100 * pf).toFixed(0)} %`}` : DASH, "num");
      peak.title = "lifetime peak RSS; % of the cap";
      peak.classList.add("text-" + headroomClass(pf === null ? null : 1 - pf).replace("level-", ""));
      const st = document.createElement("span");
      setBadge(st, d.online === false && !d.state ? "offline" : d.state);
      cell(row, "state").appendChild(st);
      const parts = [];
      if (typeof d.model_mismatch === "string" && d.model_mismatch) parts.push("model mismatch: " + d.model_mismatch);
      if (typeof d.reason === "string" && d.reason) parts.push(d.reason);
      const refused = countsText(d.refused);
      if (refused) parts.push("refused " + refused);
      const declined = countsText(d.declined);
      if (declined) parts.push("declined " + declined);
      const why = cell(row, "reason", parts.length ? parts.join(" · ") : DASH, "reason-cell");
      why.title = why.textContent;
      cell(row, "last_round", FORMATS.int(d.last_round), "num");
      cell(row, "personal", FORMATS.percent(accuracyOf(d, "personal")), "num");
      cell(row, "global", FORMATS.percent(accuracyOf(d, "global")), "num");
    }
    if (names.length === 0) {
      const td = body.insertRow().insertCell();
      td.colSpan = 8;
      td.className = "muted";
      td.textContent = devices ? "no device has reported yet" : DASH;
    }
    table.replaceChild(body, table.tBodies[0]);
    const more = document.getElementById("devices-more");
    more.hidden = names.length <= DEVICE_ROWS;
    more.textContent = showAllDevices ? `show the first ${DEVICE_ROWS}` : `show all ${names.length} devices`;
    for (const b of table.querySelectorAll("th button[data-sort]")) {
      const th = b.parentElement;
      if (b.dataset.sort === sortBy.key) th.setAttribute("aria-sort", sortBy.dir > 0 ? "ascending" : "descending");
      else th.removeAttribute("aria-sort");
    }
    setText("online-count", devices ? `devices ${online} / ${names.length} online` : "devices " + DASH);
  }

  // ---- the rounds history: the whole of it from /api/rounds, then what is new ----

  const rounds = []; // round records, oldest first, at most MAX_ROUNDS_KEPT
  const MAX_ROUNDS_KEPT = 20000; // a page left open for months stays small
  function keepRounds() {
    if (rounds.length > MAX_ROUNDS_KEPT) rounds.splice(0, rounds.length - MAX_ROUNDS_KEPT);
  }
  let roundsLoading = false;
  let roundsServed = true; // false when the coordinator serves no /api/rounds (then: status.rounds)
  const PAGE_ROWS = 15;
  let roundsPage = 0; // 0 = newest

  async function loadRounds() {
    if (roundsLoading) return;
    roundsLoading = true;
    try {
      for (;;) {
        const after = rounds.length ? rounds[rounds.length - 1].round : -1;
        const r = await fetch(`/api/rounds?after=${after}`, { cache: "no-store" });
        if (!r.ok) { roundsServed = false; break; }
        const doc = await r.json();
        const got = Array.isArray(doc.rounds) ? doc.rounds.filter((e) => obj(e) && isNum(e.round)) : [];
        if (isNum(doc.total) && doc.total === 0) roundsServed = false;
        else roundsServed = true;
        if (isNum(doc.last) && rounds.length && doc.last < rounds[rounds.length - 1].round) {
          rounds.length = 0; // another history (a new job): start over
          continue;
        }
        for (const e of got) if (!rounds.length || e.round > rounds[rounds.length - 1].round) rounds.push(e);
        keepRounds();
        if (!got.length || !isNum(doc.last) || rounds[rounds.length - 1].round >= doc.last) break;
      }
    } catch (err) {
      console.warn("edgefl: rounds unavailable", err);
    } finally {
      roundsLoading = false;
    }
    drawAccuracyChart();
    renderRounds();
  }

  function roundsFromStatus(s) {
    // without /api/rounds (an older coordinator, a site), the status's latest rounds are the history
    if (roundsServed || !Array.isArray(s.rounds)) return;
    rounds.length = 0;
    for (const e of s.rounds) if (obj(e) && isNum(e.round)) rounds.push(e);
  }

  // The status carries the latest round records: new ones join the history from there; a gap
  // (the page was away) or another history (a new job) is read from /api/rounds.
  function maybeLoadRounds(s) {
    if (roundsLoading || !Array.isArray(s.rounds) || !s.rounds.length) return;
    const latest = obj(s.rounds[s.rounds.length - 1]);
    const first = obj(s.rounds[0]);
    if (!latest || !first || !isNum(latest.round) || !isNum(first.round)) return;
    const have = rounds.length ? rounds[rounds.length - 1].round : null;
    if (have === latest.round) return;
    if (have === null || latest.round < have || first.round > have + 1) {
      if (latest.round < (have ?? -1)) rounds.length = 0;
      loadRounds();
      return;
    }
    for (const e of s.rounds) if (obj(e) && isNum(e.round) && e.round > have) rounds.push(e);
    keepRounds();
    drawAccuracyChart();
    renderRounds();
  }

  function roundTime(r) {
    if (typeof r.time === "string" && r.time) return r.time;
    return isNum(r.closed_unix) ? new Date(r.closed_unix * 1000).toISOString() : null;
  }

  function timeText(iso) {
    if (typeof iso !== "string" || !iso) return DASH;
    const t = new Date(iso);
    if (Number.isNaN(t.getTime())) return DASH;
    const today = new Date().toDateString() === t.toDateString();
    const hms = t.toLocaleTimeString("en-GB", { hour12: false });
    return today ? hms : `${t.toISOString().slice(0, 10)} ${hms}`;
  }

  const acc3 = (v) => (isNum(v) ? v.toFixed(3) : DASH);

  function renderRounds() {
    const table = document.getElementById("rounds");
    const body = document.createElement("tbody");
    const pages = Math.max(1, Math.ceil(rounds.length / PAGE_ROWS));
    roundsPage = Math.min(roundsPage, pages - 1);
    const end = rounds.length - roundsPage * PAGE_ROWS;
    const shown = rounds.slice(Math.max(0, end - PAGE_ROWS), end).reverse();
    for (const r of shown) {
      const row = body.insertRow();
      row.dataset.round = String(r.round);
      if (r.sampled === true) { // older than the last 1000: one round of several, read from the round log
        row.classList.add("sampled");
        row.title = "sampled: the rounds between are in the coordinator's round log";
      }
      cell(row, "round", FORMATS.int(r.round), "num");
      const when = roundTime(r);
      const t = cell(row, "time", timeText(when));
      if (when) t.title = when;
      const counted = r.counted;
      cell(row, "clients", isNum(r.asked) ? `${FORMATS.int(counted)} of ${FORMATS.int(r.asked)}` : FORMATS.int(counted), "num");
      cell(row, "accuracy", acc3(r.accuracy), "num");
      cell(row, "federated", isNum(r.fed_accuracy)
        ? `${acc3(r.fed_accuracy)} (${acc3(r.fed_worst_decile)})` : DASH, "num");
      // refused updates by reason, and why the round's head was not published (round_refused)
      const refused = [obj(r.refused) ? countsText(r.refused) : typeof r.refused === "string" ? r.refused : "",
        typeof r.round_refused === "string" && r.round_refused ? `head kept: ${r.round_refused}` : ""]
        .filter((t) => t).join(" · ");
      cell(row, "refused", refused || DASH, "reason-cell");
      const devices = isNum(r.declined_devices) ? r.declined_devices : isNum(r.declined) ? r.declined : 0;
      const declined = obj(r.declined) && countsText(r.declined) ? countsText(r.declined)
        : devices > 0 ? `${devices} device${devices === 1 ? "" : "s"}` : "";
      // the devices asked that sent nothing the round counted (no update, no decline): what it waited for
      const quiet = Array.isArray(r.silent) ? r.silent.filter((d) => typeof d === "string") : [];
      const quietTotal = isNum(r.silent_devices) ? r.silent_devices : quiet.length;
      const silent = quiet.length ? `no answer: ${quiet.slice(0, 5).join(", ")}`
        + (quietTotal > 5 ? ` (+${FORMATS.int(quietTotal - 5)})` : "") : "";
      cell(row, "declined", [declined, silent].filter((t) => t).join(" · ") || DASH, "reason-cell");
      cell(row, "bytes", isNum(r.update_bytes_mean) && r.update_bytes_mean > 0 ? bytes(r.update_bytes_mean) : DASH, "num");
      cell(row, "seconds", isNum(r.duration_s) ? r.duration_s.toFixed(2) : DASH, "num");
    }
    if (shown.length === 0) {
      const td = body.insertRow().insertCell();
      td.colSpan = 9;
      td.className = "muted";
      td.textContent = "no round has closed yet";
    }
    table.replaceChild(body, table.tBodies[0]);
    setText("rounds-count", rounds.length ? `· ${FORMATS.int(rounds.length)}` : "");
    setText("rounds-page", `page ${roundsPage + 1} of ${pages}`);
    document.getElementById("rounds-newer").disabled = roundsPage === 0;
    document.getElementById("rounds-older").disabled = roundsPage >= pages - 1;
  }

  // ---- charts ----

  let accuracyWindow = 100; // rounds; 0 = all

  // at most one point per pixel column: the mean of the rounds that fall in it (the line stays
  // readable at thousands of rounds)
  function bucketed(points, xMin, xMax, columns) {
    if (points.length <= columns) return points;
    const out = [];
    const width = (xMax - xMin) / columns || 1;
    let key = null, sx = 0, sy = 0, n = 0;
    for (const [x, y] of points) {
      const k = Math.floor((x - xMin) / width);
      if (k !== key && n) { out.push([sx / n, sy / n]); sx = sy = n = 0; }
      key = k;
      if (isNum(y)) { sx += x; sy += y; n += 1; }
    }
    if (n) out.push([sx / n, sy / n]);
    return out;
  }

  function xTicksFor(xMin, xMax, widthPx) {
    const room = Math.max(2, Math.floor(widthPx / 70)); // labels ~70 px apart: no overlap on a phone
    // whole rounds only: 1, 2, 5 x 10^k
    let step = Math.max(1, niceStep((xMax - xMin) / room));
    if (!Number.isInteger(step) || String(step)[0] === "2" && String(step).includes("5")) step = niceStep(step * 1.01);
    if (!Number.isInteger(step)) step = Math.ceil(step);
    const ticks = [];
    for (let x = Math.ceil(xMin / step) * step; x <= xMax; x += step) ticks.push(x);
    return ticks;
  }

  function drawAccuracyChart() {
    const canvas = document.getElementById("accuracy-chart");
    const all = rounds.length ? rounds : [];
    const win = accuracyWindow > 0 ? all.slice(-accuracyWindow) : all;
    const last = all.length ? all[all.length - 1] : null;
    setText("accuracy-last", last && isNum(last.accuracy) ? `· round ${last.round}: ${(100 * last.accuracy).toFixed(1)} %` : "");
    const xs = win.map((r) => r.round);
    const xMin = xs.length ? xs[0] : 0;
    const xMax = xs.length ? Math.max(xs[xs.length - 1], xMin + 1) : 1;
    const columns = Math.max(10, canvas.clientWidth - 70);
    const series = [
      ["accuracy", "--rss", false], ["fed_accuracy", "--ok", false], ["fed_worst_decile", "--warn", true],
    ].map(([k, color, dashed]) => ({
      points: bucketed(win.map((r) => [r.round, isNum(r[k]) ? 100 * r[k] : null]), xMin, xMax, columns / 2),
      color: css(color), dashed,
    }));
    series.forEach((s) => { s.dots = s.points.length <= 30; });
    const ys = series.flatMap((s) => s.points.map((p) => p[1])).filter(isNum);
    const yMin = ys.length ? Math.max(0, Math.floor((Math.min(...ys) - 5) / 10) * 10) : 0;
    const yStep = yMin >= 50 ? 10 : 20;
    const yTicks = [];
    for (let y = 100; y >= yMin; y -= yStep) yTicks.push(y);
    drawChart(canvas, {
      xMin, xMax, yMin, yMax: 100, yTicks,
      xTicks: xs.length ? xTicksFor(xMin, xMax, canvas.clientWidth - 70) : [],
      xFmt: (x) => "r" + x, yFmt: (y) => y.toFixed(0) + " %",
      series, lines: [],
    });
  }

  const deviceMemory = new Map(); // device -> [[local s, rss fraction of cap]]
  const MEMORY_WINDOW_S = 1800;
  const PALETTE = ["--rss", "--pss", "--ok", "--warn", "--bad", "--peak", "--c7", "--c8", "--c9", "--c10"];

  function addMemoryPoint(name, t, frac) {
    if (!isNum(frac)) return;
    let pts = deviceMemory.get(name);
    if (!pts) { pts = []; deviceMemory.set(name, pts); }
    if (pts.length && t - pts[pts.length - 1][0] < 1) pts[pts.length - 1] = [t, frac];
    else pts.push([t, frac]);
    while (pts.length && pts[0][0] < t - MEMORY_WINDOW_S) pts.shift();
  }

  function loadDeviceHistory() {
    return fetchHistory("memory", (doc, now) => {
      for (const [name, series] of Object.entries(obj(doc.devices) || {})) {
        if (!Array.isArray(series)) continue;
        const seeded = series.filter((p) => Array.isArray(p) && isNum(p[0]) && isNum(p[1]) && isNum(p[2]) && p[2] > 0)
          .map(([age, rss, cap]) => [now - age, rss / cap]);
        deviceMemory.set(name, seededThen(seeded, deviceMemory.get(name) || []));
      }
      drawMemoryChart();
    });
  }

  function drawMemoryChart() {
    const canvas = document.getElementById("memory-chart");
    const now = nowS();
    const names = [...deviceMemory.keys()].sort();
    let oldest = now;
    for (const pts of deviceMemory.values()) if (pts.length) oldest = Math.min(oldest, pts[0][0]);
    const win = Math.min(MEMORY_WINDOW_S, Math.max(60, Math.ceil((now - oldest) / 60) * 60));
    setText("memory-window", `RSS as % of its cap · last ${win < 120 ? win + " s" : Math.round(win / 60) + " min"}`);
    const legend = document.getElementById("memory-legend");
    const keys = [];
    const series = names.map((name, i) => {
      const color = css(PALETTE[i % PALETTE.length]);
      const span = document.createElement("span");
      const key = document.createElement("i");
      key.className = "key";
      key.style.background = color;
      span.append(key, document.createTextNode(name));
      keys.push(span);
      return { points: deviceMemory.get(name).map(([t, f]) => [t - now, 100 * f]), color };
    });
    legend.replaceChildren(...keys);
    const top = Math.max(100, ...series.flatMap((s) => s.points.map((p) => p[1])));
    const yMax = Math.ceil(top / 20) * 20;
    const yTicks = [];
    for (let y = 0; y <= yMax; y += 20) yTicks.push(y);
    const room = Math.max(2, Math.floor((canvas.clientWidth - 70) / 70));
    const tickStep = [10, 30, 60, 120, 300, 600].find((st) => win / st <= room) || 900;
    const xTicks = [];
    for (let x = -Math.floor(win / tickStep) * tickStep; x <= 0; x += tickStep) xTicks.push(x);
    drawChart(canvas, {
      xMin: -win, xMax: 0, yMin: 0, yMax, yTicks, xTicks,
      xFmt: (x) => (x === 0 ? "now" : tickStep < 60 ? x + " s" : x / 60 + " min"),
      yFmt: (y) => y.toFixed(0) + " %",
      series,
      lines: [
        { y: 85, color: css("--warn"), label: "15 % free" },
        { y: 95, color: css("--bad"), label: "5 % free" },
      ],
    });
  }

  function renderCoordinator(s) {
    lastCoordinator = s;
    const fs = fleetState(s);
    const el = document.getElementById("fleet-state");
    el.textContent = fs.text;
    el.dataset.state = fs.state;
    el.className = "fleet-state fleet-" + (fs.state || "unknown");
    const broker = document.getElementById("broker");
    const bc = s.broker_connected;
    broker.textContent = bc === true ? "broker connected" : bc === false ? "broker unreachable" : "broker " + DASH;
    broker.className = "pill " + (bc === true ? "pill-ok" : bc === false ? "pill-bad" : "");
    broker.dataset.state = bc === true ? "connected" : bc === false ? "unreachable" : "";

    const f = fraction(s.updates_received, s.updates_expected);
    const fill = document.getElementById("progress-fill");
    fill.style.width = f === null ? "0" : Math.min(100, f * 100).toFixed(2) + "%";
    deadline = isNum(s.deadline_s_left) ? { left_s: s.deadline_s_left, at_s: nowS() } : null;
    tickDeadline();

    renderDevices(s);
    const now = nowS();
    for (const [name, d] of Object.entries(obj(s.devices) || {})) {
      const e = obj(d);
      if (e) addMemoryPoint(name, now, fraction(e.rss_bytes, e.cap_bytes));
    }
    drawMemoryChart();
    const mism = obj(s.model_mismatches) ? Object.keys(s.model_mismatches) : null;
    setText("mismatch-count", mism === null ? "model mismatches " + DASH : `model mismatches ${mism.length}`);
    setText("privacy", isNum(s.epsilon) ? `privacy ε ${s.epsilon.toFixed(2)}` : "privacy ε " + DASH);
    roundsFromStatus(s);
    if (!roundsServed) { drawAccuracyChart(); renderRounds(); } else maybeLoadRounds(s);
    fillRefusals("rejected", s.refusals, s.rejected);
  }

  function setupCoordinator() {
    for (const b of document.querySelectorAll("#devices th button[data-sort]")) {
      b.addEventListener("click", () => {
        const key = b.dataset.sort;
        sortBy = { key, dir: sortBy.key === key ? -sortBy.dir : 1 };
        renderDevices(lastCoordinator);
      });
    }
    document.getElementById("devices-more").addEventListener("click", () => {
      showAllDevices = !showAllDevices;
      renderDevices(lastCoordinator);
    });
    for (const b of document.querySelectorAll(".window button[data-window]")) {
      b.addEventListener("click", () => {
        accuracyWindow = Number(b.dataset.window);
        for (const o of document.querySelectorAll(".window button")) o.setAttribute("aria-pressed", String(o === b));
        drawAccuracyChart();
      });
    }
    document.getElementById("rounds-newer").addEventListener("click", () => { roundsPage = Math.max(0, roundsPage - 1); renderRounds(); });
    document.getElementById("rounds-older").addEventListener("click", () => { roundsPage += 1; renderRounds(); });
    loadRounds();
    loadDeviceHistory();
  }

  // ---------------------------------------------------------------------------------------------
  // data flow

  function render(doc) {
    if (!doc || typeof doc !== "object") return;
    const status = doc.status && typeof doc.status === "object" ? doc.status : {};
    if (typeof doc.title === "string" && doc.title) {
      setText("title", doc.title);
      document.title = `edgefl · ${doc.title}`;
    }
    fillFields(status);
    if (KIND === "device") renderDevice(status); else renderCoordinator(status);
    setText("updated", new Date().toLocaleTimeString());
  }

  // The page's own liveness: "live" while the event stream is open and the server answers a probe
  // of /healthz every PROBE_S; once either fails, the data on the page is marked stale with its age
  // (and stays, so a finished job's last state remains readable). Pushes come only on change, so
  // the data is as old as the last moment the server was known to answer. window.edgeflProbeS
  // (set by a test before the page loads) shortens the probe period.
  const PROBE_S = Number(window.edgeflProbeS) > 0 ? Number(window.edgeflProbeS) : 10;
  const SILENT_S = 2.5 * PROBE_S;
  let lastDataAt = null; // local s of the last document received
  let lastAliveAt = null; // local s the server last answered (document, stream opened, probe)
  let streamOpen = false;

  function alive() {
    lastAliveAt = nowS();
  }

  function setLive() {
    const live = document.getElementById("live");
    const note = document.getElementById("stale-note");
    const main = document.getElementById("main");
    const who = KIND === "device" ? "agent" : "coordinator";
    const silent = lastAliveAt !== null && nowS() - lastAliveAt > SILENT_S;
    if (streamOpen && !silent) {
      live.textContent = "live";
      live.className = "pill pill-ok";
      live.dataset.state = "live";
      note.hidden = true;
      main.classList.remove("stale");
      return;
    }
    if (lastDataAt === null) {
      live.textContent = "connecting…";
      live.className = "pill pill-wait";
      live.dataset.state = "connecting";
      return;
    }
    const age = nowS() - (lastAliveAt ?? lastDataAt);
    live.textContent = `stale · ${ago(age).replace(" ago", " old")}`;
    live.className = "pill pill-bad";
    live.dataset.state = "stale";
    note.hidden = false;
    const at = new Date(Date.now() - age * 1000).toLocaleTimeString("en-GB", { hour12: false });
    note.textContent = `the ${who} does not answer: what you see is from ${ago(age)} (${at})`;
    main.classList.add("stale");
  }

  async function probe() {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), (PROBE_S * 1000) / 2);
    try {
      await fetch("/healthz", { cache: "no-store", signal: abort.signal });
      alive(); // any answer (503 names a problem the status shows) means the server runs
    } catch (err) {
      // no answer in time: the data ages (setLive tells)
    } finally {
      clearTimeout(timer);
    }
    setLive();
  }

  async function loadStatus() {
    try {
      const r = await fetch("/api/status", { cache: "no-store" });
      if (r.ok) { render(await r.json()); lastDataAt = nowS(); alive(); }
    } catch (err) {
      console.warn("edgefl: status unavailable", err);
    }
  }

  let reloadHistory = false;

  function connect() {
    const source = new EventSource("/api/events");
    source.onopen = () => {
      streamOpen = true;
      alive();
      setLive();
      if (reloadHistory) {
        if (KIND === "device") loadHistory(); else { loadDeviceHistory(); loadRounds(); }
      }
      reloadHistory = false;
    };
    source.onmessage = (ev) => {
      try {
        render(JSON.parse(ev.data));
        lastDataAt = nowS();
        alive();
        if (!streamOpen) streamOpen = true;
        setLive();
      } catch (err) {
        console.warn("edgefl: bad event", err);
      }
    };
    source.onerror = () => {
      // EventSource reconnects by itself (retry: from the server) unless the server answered with
      // an error (503: too many streams, 401); then try again in a while. After a reconnect the
      // history is reloaded so the charts have no gap.
      if (streamOpen) alive(); // the data was current until now
      streamOpen = false;
      setLive();
      reloadHistory = true;
      if (source.readyState === EventSource.CLOSED) setTimeout(connect, 5000);
    };
  }

  if (KIND === "coordinator") setupCoordinator();
  loadStatus().then(() => { if (KIND === "device") loadHistory(); });
  connect();
  window.addEventListener("resize", () => {
    if (KIND === "device") drawRssChart(); else { drawAccuracyChart(); drawMemoryChart(); }
  });
  setInterval(setLive, 1000);
  setInterval(() => { if (streamOpen) probe(); }, PROBE_S * 1000);
  if (KIND === "coordinator") {
    setInterval(tickDeadline, 500);
    setInterval(() => { if (streamOpen) drawMemoryChart(); }, 5000); // keeps the time axis moving
  } else {
    setInterval(tickLastUpdate, 1000);
    setInterval(drawRssChart, 2000); // keeps the time axis moving when nothing is pushed
  }
})();
