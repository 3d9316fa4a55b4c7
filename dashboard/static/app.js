// edgefl dashboard: one script for the device page (index.html) and the coordinator page
// (coordinator.html), chosen by <body data-kind>. Plain browser JavaScript, no build step, no
// dependencies. Data: GET /api/status once, then Server-Sent Events from /api/events carrying the
// same document {kind, title, status}; the device page also seeds its RSS chart from /api/history
// (kept by the app) and appends every pushed RSS value. Any missing or null field shows as "–".
// Text from the network is only ever set with textContent.
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

  function levelClass(frac) {
    if (frac === null) return "";
    return frac >= 0.9 ? "level-bad" : frac >= 0.7 ? "level-warn" : "level-ok";
  }

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
    for (const x of opts.xTicks) ctx.fillText(opts.xFmt(x), X(x), pad.t + ph + 6);
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
      ctx.textAlign = "left";
      ctx.textBaseline = "bottom";
      ctx.fillText(line.label, pad.l + 4, Y(line.y) - 2);
    }
    for (const s of opts.series) {
      ctx.strokeStyle = s.color;
      ctx.fillStyle = s.color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      let started = false;
      for (const [x, y] of s.points) {
        if (!isNum(y)) { started = false; continue; }
        if (started) ctx.lineTo(X(x), Y(y)); else ctx.moveTo(X(x), Y(y));
        started = true;
      }
      ctx.stroke();
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
    const tickStep = win <= 60 ? 10 : win <= 180 ? 30 : 60;
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

  function renderDevice(s) {
    lastDevice = s;
    const cap = s.cap_bytes;
    const rssFrac = fraction(s.rss_bytes, cap);
    const fill = document.getElementById("gauge-fill");
    fill.style.width = rssFrac === null ? "0" : Math.min(100, rssFrac * 100).toFixed(2) + "%";
    fill.className = "gauge-fill " + levelClass(rssFrac);
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

    const broker = document.getElementById("broker");
    const connected = s.broker_connected;
    // the agent names its broker state ("refused: not authorized" is not "broker lost")
    const said = typeof s.broker === "string" && s.broker !== "connected" ? "broker " + s.broker : null;
    broker.textContent = connected === true ? "broker connected" : said !== null ? said : connected === false ? "broker lost" : "broker " + DASH;
    broker.className = "pill " + (connected === true ? "pill-ok" : connected === false ? "pill-bad" : "");

    const peaks = s.phase_peaks && typeof s.phase_peaks === "object" ? s.phase_peaks : {};
    for (const phase of PHASES) {
      const row = document.querySelector(`#phases tr[data-phase="${phase}"]`);
      const f = fraction(peaks[phase], cap);
      const bar = row.querySelector(".bar-fill");
      bar.style.width = f === null ? "0" : Math.min(100, f * 100).toFixed(2) + "%";
      bar.className = "bar-fill " + levelClass(f);
      const cell = row.querySelector(".num");
      cell.textContent = bytes(peaks[phase]) + (f === null ? "" : ` · ${(f * 100).toFixed(0)} %`);
      cell.dataset.value = isNum(peaks[phase]) ? String(peaks[phase]) : "";
    }
    fillCounts("rejected", s.rejected);
    addRssPoint(nowS(), s.rss_bytes);
    drawRssChart();
  }

  async function loadHistory() {
    try {
      const r = await fetch("/api/history", { cache: "no-store" });
      if (!r.ok) return;
      const doc = await r.json();
      const now = nowS();
      const seeded = (doc.rss || []).filter((p) => isNum(p[0]) && isNum(p[1])).map(([age, v]) => [now - age, v]);
      const newer = rssPoints.filter((p) => !seeded.length || p[0] > seeded[seeded.length - 1][0]);
      rssPoints.length = 0;
      for (const p of seeded.concat(newer)) rssPoints.push(p);
      drawRssChart();
    } catch (err) {
      console.warn("edgefl: RSS history unavailable", err);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // coordinator page

  let deadline = null; // {left_s, at_s}

  function tickDeadline() {
    if (!deadline) { setText("deadline", DASH); return; }
    setText("deadline", FORMATS.seconds(deadline.left_s - (nowS() - deadline.at_s)));
  }

  let lastCoordinator = {};

  function drawAccuracyChart() {
    const s = lastCoordinator;
    const hist = Array.isArray(s.accuracy_history) ? s.accuracy_history : [];
    const pts = hist
      .filter((e) => e && isNum(e.round))
      .map((e) => [e.round, isNum(e.accuracy) ? e.accuracy * 100 : null]);
    const last = pts.length ? pts[pts.length - 1][1] : null;
    setText("accuracy-last", isNum(last) ? `· latest ${last.toFixed(1)} %` : "");
    const xs = pts.map((p) => p[0]);
    const xMin = xs.length ? Math.min(...xs) : 0;
    const xMax = xs.length ? Math.max(...xs, xMin + 1) : 1;
    const step = Math.max(1, Math.ceil((xMax - xMin) / 10));
    const ticks = [];
    for (let x = xMin; x <= xMax; x += step) ticks.push(x);
    const ys = pts.map((p) => p[1]).filter(isNum);
    const yMin = ys.length ? Math.max(0, Math.floor((Math.min(...ys) - 5) / 10) * 10) : 0;
    const yStep = yMin >= 50 ? 10 : 20;
    const yTicks = [];
    for (let y = 100; y >= yMin; y -= yStep) yTicks.push(y);
    drawChart(document.getElementById("accuracy-chart"), {
      xMin, xMax, yMin, yMax: 100, xTicks: ticks, yTicks,
      xFmt: (x) => "r" + x, yFmt: (y) => y.toFixed(0) + " %",
      series: [{ points: pts, color: css("--rss"), dots: true }],
      lines: [],
    });

  }

  function renderRounds(rounds) {
    const table = document.getElementById("rounds");
    if (!table) return;
    const body = document.createElement("tbody");
    for (const r of (rounds || []).slice().reverse()) {
      const row = body.insertRow();
      row.dataset.round = String(r.round);
      for (const [v, fmt] of [[r.round, "int"], [r.clients, "int"]]) {
        const c = row.insertCell();
        c.className = "num";
        c.textContent = FORMATS[fmt](v);
      }
      const acc = row.insertCell();
      acc.className = "num";
      acc.textContent = isNum(r.accuracy) ? r.accuracy.toFixed(3) : DASH;
      const fed = row.insertCell();
      fed.className = "num";
      fed.textContent = isNum(r.fed_accuracy)
        ? `${r.fed_accuracy.toFixed(3)} (${isNum(r.fed_worst_decile) ? r.fed_worst_decile.toFixed(3) : DASH})` : DASH;
      const by = row.insertCell();
      by.className = "num";
      by.textContent = isNum(r.update_bytes_mean) ? bytes(r.update_bytes_mean) : DASH;
      const sec = row.insertCell();
      sec.className = "num";
      sec.textContent = isNum(r.duration_s) ? r.duration_s.toFixed(2) : DASH;
    }
    if (!rounds || rounds.length === 0) {
      const td = body.insertRow().insertCell();
      td.colSpan = 6;
      td.className = "muted";
      td.textContent = rounds ? "no round has closed yet" : DASH;
    }
    table.replaceChild(body, table.tBodies[0]);
  }

  function renderCoordinator(s) {
    setBadge(document.getElementById("state"), s.state);
    const f = fraction(s.updates_received, s.updates_expected);
    const fill = document.getElementById("progress-fill");
    fill.style.width = f === null ? "0" : Math.min(100, f * 100).toFixed(2) + "%";
    deadline = isNum(s.deadline_s_left) ? { left_s: s.deadline_s_left, at_s: nowS() } : null;
    tickDeadline();

    lastCoordinator = s;
    drawAccuracyChart();

    const devices = s.devices && typeof s.devices === "object" ? s.devices : null;
    const table = document.getElementById("devices");
    const body = document.createElement("tbody");
    const names = devices ? Object.keys(devices).sort() : [];
    let online = 0;
    for (const name of names) {
      const d = devices[name] && typeof devices[name] === "object" ? devices[name] : {};
      if (d.online === true) online += 1;
      const row = body.insertRow();
      row.dataset.device = name;
      row.insertCell().textContent = name;
      const on = row.insertCell();
      const pill = document.createElement("span");
      pill.className = "pill " + (d.online === true ? "pill-ok" : d.online === false ? "pill-bad" : "");
      pill.textContent = d.online === true ? "online" : d.online === false ? "offline" : DASH;
      on.appendChild(pill);
      const st = document.createElement("span");
      setBadge(st, d.state);
      row.insertCell().appendChild(st);
      const mem = row.insertCell();
      mem.className = "wide-col";
      const hf = fraction(d.rss_bytes, d.cap_bytes);
      const bar = document.createElement("div");
      bar.className = "bar";
      const bf = document.createElement("div");
      bf.className = "bar-fill " + levelClass(hf);
      bf.style.width = hf === null ? "0" : Math.min(100, hf * 100).toFixed(2) + "%";
      bar.appendChild(bf);
      const label = document.createElement("span");
      label.className = "bar-label";
      label.textContent = isNum(d.rss_bytes) || isNum(d.cap_bytes)
        ? `${bytes(d.rss_bytes)} of ${bytes(d.cap_bytes)}` : DASH;
      mem.append(bar, label);
      const lr = row.insertCell();
      lr.className = "num";
      lr.textContent = FORMATS.int(d.last_round);
      const why = typeof d.model_mismatch === "string" && d.model_mismatch
        ? "model mismatch: " + d.model_mismatch : d.reason;
      row.insertCell().textContent = typeof why === "string" && why ? why : DASH;
      const refused = d.refused && typeof d.refused === "object" ? d.refused : {};
      const declined = d.declined && typeof d.declined === "object" ? d.declined : {};  // rounds it refused
      const parts = Object.keys(refused).sort().map((k) => `${k} ${refused[k]}`)
        .concat(Object.keys(declined).sort().map((k) => `declined ${k} ${declined[k]}`));
      row.insertCell().textContent = parts.length ? parts.join(", ") : DASH;
    }
    if (names.length === 0) {
      const td = body.insertRow().insertCell();
      td.colSpan = 7;
      td.className = "muted";
      td.textContent = devices ? "no device has reported yet" : DASH;
    }
    table.replaceChild(body, table.tBodies[0]);
    setText("online-count", devices ? `devices ${online} / ${names.length} online` : "devices " + DASH);
    const mism = s.model_mismatches && typeof s.model_mismatches === "object" ? Object.keys(s.model_mismatches) : null;
    setText("mismatch-count", mism === null ? "model mismatches " + DASH : `model mismatches ${mism.length}`);
    setText("privacy", isNum(s.epsilon) ? `privacy ε ${s.epsilon.toFixed(2)}` : "privacy ε " + DASH);
    renderRounds(Array.isArray(s.rounds) ? s.rounds : null);
    fillCounts("rejected", s.rejected);
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

  function setLive(ok, text) {
    const live = document.getElementById("live");
    live.textContent = text;
    live.className = "pill " + (ok ? "pill-ok" : "pill-wait");
  }

  async function loadStatus() {
    try {
      const r = await fetch("/api/status", { cache: "no-store" });
      if (r.ok) render(await r.json());
    } catch (err) {
      console.warn("edgefl: status unavailable", err);
    }
  }

  let reloadHistory = false;

  function connect() {
    const source = new EventSource("/api/events");
    source.onopen = () => {
      setLive(true, "live");
      if (reloadHistory && KIND === "device") loadHistory();
      reloadHistory = false;
    };
    source.onmessage = (ev) => {
      try {
        render(JSON.parse(ev.data));
      } catch (err) {
        console.warn("edgefl: bad event", err);
      }
    };
    source.onerror = () => {
      // EventSource reconnects by itself (retry: from the server) unless the server answered with
      // an error (503: too many streams, 401); then try again in a while. After a reconnect the
      // history is reloaded so the chart has no gap.
      setLive(false, "reconnecting…");
      reloadHistory = true;
      if (source.readyState === EventSource.CLOSED) setTimeout(connect, 5000);
    };
  }

  loadStatus().then(() => { if (KIND === "device") loadHistory(); });
  connect();
  window.addEventListener("resize", () => { if (KIND === "device") drawRssChart(); else drawAccuracyChart(); });
  if (KIND === "coordinator") setInterval(tickDeadline, 500);
  else setInterval(drawRssChart, 2000); // keeps the time axis moving when nothing is pushed
})();
