"""Who may send requests, and how many each: API keys, a bounded queue, per-client limits (chapter 12).

A server shared by a room must not be one client's. Three rules, checked before any costly work:

- Keys (optional, `--api-key`, one or several): every /v1 request carries `Authorization: Bearer KEY`
  or gets a 401. The dashboard and /metrics take an API key or the read-only `--metrics-key` (which
  cannot generate); a browser passes it as `?key=` in the dashboard's URL. /health stays open, for
  load balancers.
- A bounded queue: the server holds at most `seats + max_queue` requests at once (seats: the engine's
  max_seqs, the requests that can run together). Beyond it, 429 with a Retry-After estimated from how
  fast requests have been finishing.
- Per client (its API key, or its address without keys): at most `seats + max_queue_per_client`
  requests at once, so one client's script cannot fill the queue for everyone; 429 beyond.

Fairness among the requests admitted is the scheduler's (engine/runtime/scheduler.py, "Fair seats"):
each request names its client, and when every seat is taken, seats are shared among the clients
within one seat of each other, preempting the heaviest client's newest requests if it must.
"""
from __future__ import annotations

import hmac
import math
import threading
import time
from collections import deque

__all__ = ["Admission", "Refused", "Unauthorized", "Keys"]

RATE_WINDOW_S = 30.0        # finishes counted for Retry-After
MAX_RETRY_AFTER_S = 60


class Refused(Exception):
    """429: the queue, or this client's share of it, is full."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class Unauthorized(Exception):
    """401: a key is required and the request has none that fits."""


class Keys:
    """API keys and the read-only metrics key; `None` everywhere means an open server."""

    def __init__(self, api_keys=(), metrics_keys=()):
        self.api_keys = [k for k in api_keys if k]
        self.metrics_keys = [k for k in metrics_keys if k]
        for key in self.api_keys + self.metrics_keys:
            if not isinstance(key, str) or len(key) < 8 or any(c.isspace() for c in key):
                raise ValueError("an API key must be a string of at least 8 characters without spaces")

    @property
    def required(self) -> bool:
        return bool(self.api_keys)

    @staticmethod
    def _match(key: str | None, keys: list[str]) -> int | None:
        """The index of the key in keys (compared in constant time), else None."""
        found = None
        for i, candidate in enumerate(keys):      # every key compared: no early exit to time
            if key is not None and hmac.compare_digest(key.encode(), candidate.encode()):
                found = i
        return found

    def client(self, key: str | None, address: str | None) -> str:
        """Who sends a /v1 request: "key#i" (never the key itself) or the address; Unauthorized if a key
        is required and missing or wrong."""
        if not self.required:
            return address or "unknown"
        index = self._match(key, self.api_keys)
        if index is None:
            raise Unauthorized("a valid API key is required (Authorization: Bearer KEY)" if key else
                               "this server requires an API key (Authorization: Bearer KEY)")
        return f"key#{index}"

    def may_watch(self, key: str | None) -> bool:
        """The dashboard and /metrics: open without keys, else an API key or a metrics key."""
        return not self.required or self._match(key, self.api_keys) is not None or \
            self._match(key, self.metrics_keys) is not None


class Admission:
    """Counts the requests the server holds, in all and per client (thread-safe).

        ticket = admission.enter(client)      # Refused (429) when full
        try: ... serve it ...
        finally: admission.leave(ticket)
    """

    def __init__(self, seats: int, max_queue: int, max_queue_per_client: int):
        for name, value in (("seats", seats), ("max_queue", max_queue),
                            ("max_queue_per_client", max_queue_per_client)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.seats, self.max_queue, self.max_queue_per_client = seats, max_queue, max_queue_per_client
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}
        self.total = 0
        self.refused = 0
        self._finished: deque[float] = deque()     # when requests left, over the last RATE_WINDOW_S

    @property
    def limit(self) -> int:
        return self.seats + self.max_queue

    @property
    def limit_per_client(self) -> int:
        return self.seats + self.max_queue_per_client

    def enter(self, client: str) -> str:
        with self._lock:
            held = self._live.get(client, 0)
            if self.total >= self.limit:
                self.refused += 1
                raise Refused(f"the server is full ({self.total} requests for {self.seats} seats and a queue "
                              f"of {self.max_queue}); retry later", self._retry_after(self.total - self.limit + 1))
            if held >= self.limit_per_client:
                self.refused += 1
                raise Refused(f"this client already has {held} requests in the server (at most "
                              f"{self.limit_per_client}); retry when some have finished",
                              self._retry_after(held - self.limit_per_client + 1))
            self._live[client] = held + 1
            self.total += 1
        return client

    def leave(self, client: str) -> None:
        with self._lock:
            held = self._live.get(client, 0) - 1
            if held > 0:
                self._live[client] = held
            else:
                self._live.pop(client, None)
            self.total -= 1
            self._finished.append(time.monotonic())

    def _retry_after(self, excess: int) -> int:
        """Seconds until `excess` requests have likely finished, at the recent finishing rate."""
        now = time.monotonic()
        while self._finished and self._finished[0] < now - RATE_WINDOW_S:
            self._finished.popleft()
        rate = len(self._finished) / RATE_WINDOW_S
        if rate <= 0:
            return 5
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(excess / rate)))

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": self.total, "clients": len(self._live), "refused": self.refused,
                    "limit": self.limit, "limit_per_client": self.limit_per_client,
                    "busiest_client": max(self._live.values(), default=0)}
