"""What the server reports about the engine: /metrics (Prometheus text) and the dashboard's feed.

One `Monitor` samples `llm.stats()` a few times a second (the engine loop fills it in; reading it
costs a lock and a copy, never a model step). From consecutive samples it derives tokens/s over a
sliding window; the dashboard's snapshots and the Prometheus text are both rendered from the
latest sample, so the two always agree.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

RATE_WINDOW_S = 3.0     # tokens/s is averaged over this many seconds: smooth, yet live


def quantile(values, q: float) -> float | None:
    return float(np.quantile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def page_owners(stats: dict) -> list[int]:
    """One entry per KV page: the id of the request holding it, or -1 when free."""
    owners = [-1] * int(stats["pages_total"])
    for rid, pages in stats.get("page_tables", {}).items():
        for p in pages:
            owners[p] = int(rid)
    return owners


class Monitor:
    def __init__(self, llm, model_name: str):
        self.llm, self.model_name = llm, model_name
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int]] = deque()   # (time, tokens generated so far)
        self.stats: dict = {}
        self.tokens_per_s = 0.0
        self.sample()

    def sample(self) -> dict:
        """Read the engine's counters once; returns the dashboard snapshot."""
        stats = self.llm.stats()
        now = time.monotonic()
        with self._lock:
            self._samples.append((now, int(stats["tokens_generated"])))
            while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
                self._samples.popleft()
            (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
            self.tokens_per_s = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
            self.stats = stats
        return self.snapshot()

    def snapshot(self) -> dict:
        """The dashboard's picture: counts, the page map, request states, rates (plain JSON)."""
        s = self.stats
        ttft = list(s.get("ttft_s", []))
        return {
            "time": time.time(), "model": self.model_name,
            "running": s["running"], "waiting": s["waiting"],
            "pages_total": s["pages_total"], "pages_used": s["pages_used"], "page_size": s.get("page_size"),
            "page_owner": page_owners(s),
            "requests": [{"id": int(rid), "state": r["state"]} for rid, r in s.get("requests", {}).items()],
            "tokens_generated": s["tokens_generated"], "tokens_per_s": round(self.tokens_per_s, 1),
            "finished": s.get("finished", 0), "preemptions": s.get("preemptions", 0),
            "ttft_p50_ms": None if not ttft else round(1e3 * quantile(ttft, 0.5), 1),
            "ttft_p99_ms": None if not ttft else round(1e3 * quantile(ttft, 0.99), 1),
        }

    def prometheus(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        s = self.stats
        ttft = list(s.get("ttft_s", []))
        lines = []

        def metric(name, kind, help_, value, labels=""):
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{labels} {value}"])

        metric("engine_requests_running", "gauge", "Requests in the running batch.", s["running"])
        metric("engine_requests_waiting", "gauge", "Requests queued for admission.", s["waiting"])
        metric("engine_kv_pages_used", "gauge", "KV cache pages holding some request's keys and values.",
               s["pages_used"])
        metric("engine_kv_pages_total", "gauge", "KV cache pages in the pool.", s["pages_total"])
        metric("engine_generation_tokens_total", "counter", "Tokens generated since start.", s["tokens_generated"])
        metric("engine_tokens_per_second", "gauge", f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.",
               f"{self.tokens_per_s:.3f}")
        lines += ["# HELP engine_time_to_first_token_seconds Time from arrival to the first generated token.",
                  "# TYPE engine_time_to_first_token_seconds summary"]
        for q in (0.5, 0.9, 0.99):
            value = quantile(ttft, q)
            lines.append(f'engine_time_to_first_token_seconds{{quantile="{q}"}} '
                         f'{"NaN" if value is None else f"{value:.6f}"}')
        lines += [f"engine_time_to_first_token_seconds_sum {sum(ttft):.6f}",
                  f"engine_time_to_first_token_seconds_count {len(ttft)}"]
        return "\n".join(lines) + "\n"
