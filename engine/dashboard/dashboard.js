// The live dashboard: one EventSource on /dashboard/events, one snapshot (JSON) every quarter second.
// Plain canvas drawing, no libraries: the page works in a room without internet.
"use strict";

const WINDOW_S = 60;                       // the timeline and the rate plot show the last minute
const STATE_COLOR = { waiting: "#9e9e9e", prefill: "#ef8a17", decode: "#2e7dd7", preempted: "#d7263d" };
const FREE_COLOR = "#e4e4e4";

const rateHistory = [];                    // [time, tokens/s]
const requestHistory = new Map();          // request id -> [[time, state], ...]; "done" once it leaves

function ownerColor(id) {                  // a stable, well-spread hue per request id (golden angle)
  return `hsl(${(id * 137.508) % 360}, 65%, 50%)`;
}

function setText(id, text) { document.getElementById(id).textContent = text; }

function recordSnapshot(s) {
  const now = s.time;
  rateHistory.push([now, s.tokens_per_s]);
  while (rateHistory.length && rateHistory[0][0] < now - WINDOW_S) rateHistory.shift();
  const live = new Set();
  for (const r of s.requests) {
    live.add(r.id);
    if (!requestHistory.has(r.id)) requestHistory.set(r.id, []);
    requestHistory.get(r.id).push([now, r.state]);
  }
  for (const [id, marks] of requestHistory) {
    const last = marks[marks.length - 1];
    if (!live.has(id) && last[1] !== "done") marks.push([now, "done"]);
    if (last[1] === "done" && last[0] < now - WINDOW_S) requestHistory.delete(id);
  }
}

function drawPageMap(s) {
  const canvas = document.getElementById("pagemap"), ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const n = s.page_owner.length;
  if (!n) return;
  // The largest square cell that fits all pages in the canvas.
  let cols = Math.ceil(Math.sqrt(n * canvas.width / canvas.height));
  let cell = Math.floor(canvas.width / cols);
  while (Math.ceil(n / cols) * cell > canvas.height) { cols += 1; cell = Math.floor(canvas.width / cols); }
  const gap = cell > 4 ? 1 : 0;
  s.page_owner.forEach((owner, p) => {
    ctx.fillStyle = owner < 0 ? FREE_COLOR : ownerColor(owner);
    ctx.fillRect((p % cols) * cell, Math.floor(p / cols) * cell, cell - gap, cell - gap);
  });
}

function drawRate(now) {
  const canvas = document.getElementById("rate"), ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, pad = 30;
  ctx.clearRect(0, 0, W, H);
  const top = Math.max(1, ...rateHistory.map(([, v]) => v)) * 1.1;
  ctx.strokeStyle = "#bbb"; ctx.fillStyle = "#666"; ctx.font = "11px sans-serif";
  ctx.beginPath(); ctx.moveTo(pad, 5); ctx.lineTo(pad, H - pad); ctx.lineTo(W - 5, H - pad); ctx.stroke();
  ctx.fillText(top.toFixed(0), 2, 12); ctx.fillText("0", 2, H - pad); ctx.fillText(`-${WINDOW_S} s`, pad, H - 10);
  ctx.fillText("now", W - 30, H - 10);
  ctx.strokeStyle = "#2e7dd7"; ctx.lineWidth = 2; ctx.beginPath();
  rateHistory.forEach(([t, v], i) => {
    const x = pad + (W - 5 - pad) * (1 - (now - t) / WINDOW_S), y = H - pad - (H - pad - 5) * v / top;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke(); ctx.lineWidth = 1;
}

function drawTimeline(now) {
  const canvas = document.getElementById("timeline"), ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, left = 50;
  ctx.clearRect(0, 0, W, H);
  const ids = [...requestHistory.keys()].sort((a, b) => a - b);
  const rows = ids.slice(-Math.floor(H / 3));          // the newest requests that fit, >= 3 px each
  const rowH = Math.min(14, H / Math.max(rows.length, 1));
  const xOf = (t) => left + (W - left) * (1 - (now - t) / WINDOW_S);
  ctx.font = "10px sans-serif"; ctx.fillStyle = "#666";
  rows.forEach((id, i) => {
    const marks = requestHistory.get(id), y = i * rowH;
    if (rowH >= 9) { ctx.fillStyle = "#666"; ctx.fillText(`#${id}`, 2, y + rowH - 2); }
    for (let k = 0; k < marks.length; k++) {
      const [t, state] = marks[k];
      if (state === "done") break;
      const end = k + 1 < marks.length ? marks[k + 1][0] : now;
      ctx.fillStyle = STATE_COLOR[state] || "#000";
      const x0 = Math.max(left, xOf(t)), x1 = xOf(end);
      if (x1 > x0) ctx.fillRect(x0, y + 1, Math.max(1, x1 - x0), rowH - 2);
    }
  });
}

function render(s) {
  setText("model", s.model);
  setText("running", s.running);
  setText("waiting", s.waiting);
  setText("pages", `${s.pages_used} / ${s.pages_total}`);
  setText("tps", s.tokens_per_s.toFixed(1));
  setText("ttft", s.ttft_p50_ms === null ? "–" : `${s.ttft_p50_ms} / ${s.ttft_p99_ms} ms`);
  setText("tokens", s.tokens_generated);
  drawPageMap(s);
  drawRate(s.time);
  drawTimeline(s.time);
}

function connect() {
  const status = document.getElementById("connection");
  const source = new EventSource("/dashboard/events");
  source.onopen = () => { status.textContent = "live"; status.className = "on"; };
  source.onerror = () => { status.textContent = "reconnecting"; status.className = "off"; };
  source.onmessage = (event) => {
    const snapshot = JSON.parse(event.data);
    recordSnapshot(snapshot);
    render(snapshot);
  };
}

connect();
