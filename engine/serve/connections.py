"""Connections that must send their request head in time (a slowloris cannot hold sockets forever).

uvicorn closes an idle keep-alive connection a few seconds after a response, but a connection that
opens and never finishes its request line and headers (or trickles them a byte at a time, each byte
cancelling the keep-alive timer) stays open for as long as the client likes: a few thousand of them
use up the server's file descriptors. `http_protocol()` gives uvicorn's HTTP protocol with one timer
more: from the moment the connection opens, and again after each response, the next request's head
must be complete within HEAD_TIMEOUT_S, or the connection is closed. The body has its own limit in
the application (server.py, BODY_TIMEOUT_S), and the answer, however long, has none.
"""
from __future__ import annotations

import asyncio
import importlib.util

HEAD_TIMEOUT_S = 15.0


def _with_head_timeout(base: type) -> type:
    class HeadTimeout(base):
        head_timeout = HEAD_TIMEOUT_S
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

        def _head_timed_out(self) -> None:
            """No request head since the timer started: nothing in progress to wait for."""
            cycle = getattr(self, "cycle", None)
            idle = cycle is None or cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

    HeadTimeout.__name__ = HeadTimeout.__qualname__ = f"HeadTimeout{base.__name__}"
    return HeadTimeout


def http_protocol() -> type:
    """uvicorn's HTTP protocol class as "auto" would choose it (httptools when installed, else h11),
    with the request-head timeout."""
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return _with_head_timeout(HttpToolsProtocol)
    from uvicorn.protocols.http.h11_impl import H11Protocol
    return _with_head_timeout(H11Protocol)
