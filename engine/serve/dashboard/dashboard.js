// The live dashboard: one EventSource on /dashboard/events, one snapshot (JSON) every quarter second.
// Plain canvas drawing, no libraries: the page works in a room without internet.
"use strict";

const WINDOW_S = 60;                       // the timeline and the rate plot show the last minute
const STATE_COLOR = { waiting: "#9e9e9e", prefill: "#ef8a17", decode: "#2e7dd7", preempted: "#d7263d" };
const FREE_COLOR = "#e4e4e4";
const CACHED_COLOR = "#b9dfc0";           // free, but still holding a cached prefix (page owner -2)

const rateHistory = [];                    // [time, tokens/s], kept by the page

function ownerColor(id) {                  // a stable, well-spread hue per request id (golden angle)
  return `hsl(${(id * 137.508) % 360}, 65%, 50%)`;
}

function setText(id, text) { document.getElementById(id).textContent = text; }

function recordRate(s) {
  rateHistory.push([s.time, s.tokens_per_s]);
  while (rateHistory.length && rateHistory[0][0] < s.time - WINDOW_S) rateHistory.shift();
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
    ctx.fillStyle = owner === -2 ? CACHED_COLOR : owner < 0 ? FREE_COLOR : ownerColor(owner);
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

// Each request comes with its timeline from the engine: [[state, seconds before now], ...], one
// entry per state change (waiting, prefill, decode, preempted, finished), so short prefills show too.
function drawTimeline(requests) {
  const canvas = document.getElementById("timeline"), ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, left = 50;
  ctx.clearRect(0, 0, W, H);
  const rows = [...requests].sort((a, b) => a.id - b.id).slice(-Math.floor(H / 3));   // >= 3 px per row
  const rowH = Math.min(14, H / Math.max(rows.length, 1));
  const xOf = (ago) => left + (W - left) * (1 + ago / WINDOW_S);
  ctx.font = "10px sans-serif";
  rows.forEach((r, i) => {
    const y = i * rowH;
    if (rowH >= 9) { ctx.fillStyle = "#666"; ctx.fillText(`#${r.id}`, 2, y + rowH - 2); }
    r.timeline.forEach(([state, ago], k) => {
      if (state === "finished") return;
      const end = k + 1 < r.timeline.length ? r.timeline[k + 1][1] : 0;
      const x0 = Math.max(left, xOf(ago)), x1 = xOf(end);
      ctx.fillStyle = STATE_COLOR[state] || "#000";
      if (x1 > left) ctx.fillRect(x0, y + 1, Math.max(1, x1 - x0), rowH - 2);
    });
  });
}

function render(s) {
  setText("model", s.model);
  setText("running", s.running);
  setText("waiting", s.waiting);
  setText("pages", `${s.pages_used} / ${s.pages_total}`);
  const prefix = s.prefix_cache;
  setText("prefix", prefix.enabled
    ? `${(100 * prefix.hit_rate).toFixed(0)}% · ${s.pages_shared} shared, ${s.pages_cached} cached`
    : "off");
  setText("tps", s.tokens_per_s.toFixed(1));
  setText("ttft", s.ttft_p50_ms === null ? "–" : `${s.ttft_p50_ms} / ${s.ttft_p99_ms} ms`);
  setText("tokens", s.tokens_generated);
  const spec = s.speculative || {enabled: false};
  setText("spec", !spec.enabled ? "off" : spec.verify_rows === 0 ? `${spec.method}: no verify row yet`
    : `${(100 * spec.acceptance_rate).toFixed(0)}% · ${spec.mean_accepted_length.toFixed(2)}`);
  drawPageMap(s);
  drawRate(s.time);
  drawTimeline(s.requests);
}

function connect() {
  const status = document.getElementById("connection");
  // a server with API keys: the page's own ?key= goes along (EventSource cannot send headers)
  const key = new URLSearchParams(location.search).get("key");
  const source = new EventSource("/dashboard/events" + (key ? "?key=" + encodeURIComponent(key) : ""));
  source.onopen = () => { status.textContent = "live"; status.className = "on"; };
  source.onerror = () => { status.textContent = "reconnecting"; status.className = "off"; };
  source.onmessage = (event) => {
    const snapshot = JSON.parse(event.data);
    const up = snapshot.engine === "ok";      // the engine process died: say so, keep the last picture
    status.textContent = up ? "live" : "engine " + snapshot.engine;
    status.className = up ? "on" : "off";
    recordRate(snapshot);
    render(snapshot);
  };
}

connect();
