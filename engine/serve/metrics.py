"""What the server reports about the engine: /metrics (Prometheus text) and the dashboard's feed.

One `Monitor` samples `llm.stats()` a few times a second (the engine loop builds it between two
steps: a copy of counters, never a model step). The dashboard's snapshots and the Prometheus text
are both rendered from the latest sample, so the two always agree.
"""
from __future__ import annotations

import threading
import time

import numpy as np

TIMELINE_S = 60.0       # the dashboard's timeline shows the requests of the last minute


def quantile(values, q: float) -> float | None:
    return float(np.quantile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def timeline(request: dict, now: float) -> list[list]:
    """[[state, seconds before now], ...]: when the request entered each state (the last is still on)."""
    return [[state, round(at - now, 3)] for state, at in request["timeline"]]


def server_state() -> dict:
    """What a server adds to the engine's stats (OpenAIServer.state): no server, nothing to add."""
    return {"engine": "ok", "restarts": 0, "admission": {"requests": 0, "clients": 0, "refused": 0}}


class Monitor:
    def __init__(self, llm, model_name: str, state=server_state):
        """state(): the server's side of the picture (the engine process's state, admission counts)."""
        self.llm, self.model_name, self.state = llm, model_name, state
        self._lock = threading.Lock()
        self.stats: dict = {}
        self.sample()

    def sample(self) -> None:
        """Read the engine's counters once (the loop builds them between two steps)."""
        stats = self.llm.stats()
        with self._lock:
            self.stats = stats

    def snapshot(self) -> dict:
        """The dashboard's picture: counts, the page map, request timelines, rates (plain JSON)."""
        with self._lock:
            s = self.stats
        now, ttft = s["now"], s["time_to_first_token"]
        p50, p99 = quantile(ttft, 0.5), quantile(ttft, 0.99)      # None without any request yet
        recent = [r for r in s["requests"] if r["finished"] is None or r["finished"] >= now - TIMELINE_S]
        server = self.state()
        return {
            "time": time.time(), "model": self.model_name,
            "engine": server["engine"], "restarts": server["restarts"], "admission": server["admission"],
            "running": s["running"], "waiting": s["waiting"],
            "pages_total": s["pages_total"], "pages_used": s["pages_used"], "page_size": s["page_size"],
            "pages_cached": s["pages_cached"], "pages_shared": s["pages_shared"],
            "prefix_cache": s["prefix_cache"],
            "page_owner": s["page_owners"],
            "requests": [{"id": r["request_id"], "state": r["state"], "timeline": timeline(r, now)} for r in recent],
            "tokens_generated": s["tokens_generated"], "tokens_per_s": round(s["tokens_per_second"], 1),
            "preemptions": s["preemptions"],
            "speculative": s.get("speculative", {"enabled": False}),
            "ttft_p50_ms": None if p50 is None else round(1e3 * p50, 1),
            "ttft_p99_ms": None if p99 is None else round(1e3 * p99, 1),
        }

    def prometheus(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        with self._lock:
            s = self.stats
        ttft = s["time_to_first_token"]
        lines = []

        def metric(name, kind, help_, value):
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"])

        server = self.state()
        metric("engine_up", "gauge", "1 while the engine answers, 0 while it is down or restarting.",
               int(server["engine"] == "ok"))
        metric("engine_restarts_total", "counter", "Times the server restarted a dead engine process.",
               server["restarts"])
        metric("engine_server_requests", "gauge", "Requests the server holds (queued or running).",
               server["admission"]["requests"])
        metric("engine_server_clients", "gauge", "Clients with requests in the server.", server["admission"]["clients"])
        metric("engine_requests_refused_total", "counter", "Requests refused with 429 (queue or client limit).",
               server["admission"]["refused"])
        metric("engine_requests_running", "gauge", "Requests in the running batch.", s["running"])
        metric("engine_requests_waiting", "gauge", "Requests queued for admission.", s["waiting"])
        metric("engine_kv_pages_used", "gauge", "KV cache pages holding some request's keys and values.",
               s["pages_used"])
        metric("engine_kv_pages_total", "gauge", "KV cache pages in the pool.", s["pages_total"])
        metric("engine_kv_pages_cached", "gauge", "Free KV pages still holding a cached prefix (evicted when taken).",
               s["pages_cached"])
        metric("engine_kv_pages_shared", "gauge", "KV pages in more than one request's page table.", s["pages_shared"])
        prefix = s["prefix_cache"]
        metric("engine_prefix_cache_queries_total", "counter",
               "Prompt tokens of admitted requests looked up in the prefix cache.", prefix["lookup_tokens"])
        metric("engine_prefix_cache_hits_total", "counter",
               "Of those, tokens found in the prefix cache (not computed again).", prefix["hit_tokens"])
        metric("engine_generation_tokens_total", "counter", "Tokens generated since start.", s["tokens_generated"])
        metric("engine_tokens_per_second", "gauge", "Tokens generated per second over the last few seconds.",
               f"{s['tokens_per_second']:.3f}")
        metric("engine_preemptions_total", "counter", "Requests preempted to free KV pages.", s["preemptions"])
        spec = s.get("speculative", {})
        metric("engine_spec_draft_tokens_total", "counter", "Speculative decoding: tokens proposed to verify rows.",
               spec.get("draft_tokens", 0))
        metric("engine_spec_accepted_tokens_total", "counter", "Speculative decoding: proposed tokens accepted.",
               spec.get("accepted_tokens", 0))
        metric("engine_spec_verify_rows_total", "counter", "Speculative decoding: verify rows run.",
               spec.get("verify_rows", 0))
        lines += ["# HELP engine_time_to_first_token_seconds Time from arrival to the first generated token.",
                  "# TYPE engine_time_to_first_token_seconds summary"]
        for q in (0.5, 0.9, 0.99):
            value = quantile(ttft, q)
            lines.append(f'engine_time_to_first_token_seconds{{quantile="{q}"}} '
                         f'{"NaN" if value is None else f"{value:.6f}"}')
        lines += [f"engine_time_to_first_token_seconds_sum {sum(ttft):.6f}",
                  f"engine_time_to_first_token_seconds_count {len(ttft)}"]
        return "\n".join(lines) + "\n"
