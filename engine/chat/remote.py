"""`python -m engine.chat --server URL`: the chat, talking to an OpenAI-compatible server (chapter 12).

A laptop without a GPU chats with the model that the instructor's machine serves: the conversation
stays here, every turn is one `POST /v1/chat/completions` with `"stream": true`, and the answer
arrives as server-sent events (`data: {json chunk}` lines, ending with `data: [DONE]`). Only the
standard library is used (urllib), so the client needs nothing installed.
"""
from __future__ import annotations

import http.client
import json
import sys
import time
import urllib.error
import urllib.request

from engine.chat.conversation import Conversation, ConversationFrontEnd, TurnCancelled, TurnStats

TIMEOUT_S = 600.0       # a long answer on a busy server may take minutes; a dead one errors sooner


class ServerError(ValueError):
    """The server refused a request or answered something that is not the OpenAI API."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status        # the HTTP status of a refusal

    @property
    def too_long(self) -> bool:
        """A 400 saying that the conversation does not fit the server's context or KV pool."""
        text = str(self).lower()
        return self.status == 400 and any(word in text for word in ("context", "does not fit", "kv pool"))


class StreamCut(ServerError):
    """The answer's stream broke off before `data: [DONE]`: the answer is incomplete and not kept."""

    def __init__(self, message: str):
        super().__init__(message + "; the answer was not kept, the conversation goes on without it")


def _error_message(err: urllib.error.HTTPError) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), or the HTTP reason."""
    try:
        body = json.loads(err.read().decode("utf-8", errors="replace"))
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {err.code} {err.reason}"


class RemoteChat(ConversationFrontEnd):
    """Same interface as engine.chat.local.Chat (answer, reset, system, messages), over HTTP."""

    def __init__(self, url: str, params, system: str | None, model: str | None = None, api_key: str | None = None):
        """api_key: sent as `Authorization: Bearer KEY` (a server started with --api-key needs one)."""
        self.api_key = api_key
        self.base = url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        if not self.base.startswith(("http://", "https://")):
            raise ServerError(f"--server needs an http:// or https:// URL, got {url!r}")
        self.params = params
        self.conversation = Conversation(system)
        self.model = model or self._first_model()
        self.backend_name = f"server {self.base} (model {self.model})"

    # ---- HTTP ----------------------------------------------------------------------------------
    def _open(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base + path, data=data, method="GET" if body is None else "POST",
                                         headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as err:
            raise ServerError(f"{self.base}{path}: {_error_message(err)}", err.code) from None
        except urllib.error.URLError as err:
            raise ServerError(f"cannot reach {self.base}: {err.reason}") from None

    def _first_model(self) -> str:
        with self._open("/v1/models") as response:
            try:
                return json.load(response)["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise ServerError(f"{self.base}/v1/models did not list a model") from None

    def _body(self, messages: list[dict]) -> dict:
        p = self.params
        body = {"model": self.model, "messages": messages, "stream": True, "max_tokens": p.max_new_tokens,
                "temperature": p.temperature, "top_p": p.top_p}
        if p.top_k:
            body["top_k"] = p.top_k
        if p.seed is not None:
            body["seed"] = p.seed
        if p.structured == ("json_object", None):
            body["response_format"] = {"type": "json_object"}
        return body

    def _stream(self, messages: list[dict]):
        """Yield (content piece, finish_reason or None) from the server's event stream. A stream that
        ends without `data: [DONE]` or breaks off (the server or its engine died, the network went)
        raises StreamCut: what arrived is not a whole answer."""
        with self._open("/v1/chat/completions", self._body(messages)) as response:
            try:
                for raw in response:
                    line = raw.decode("utf-8", errors="replace").strip()
                    if not line.startswith("data:"):
                        continue                      # comments, event names, the blank separators
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    try:
                        payload = json.loads(data)
                    except ValueError:
                        continue
                    if isinstance(payload, dict) and payload.get("error"):
                        error = payload["error"]
                        message = error.get("message", error) if isinstance(error, dict) else error
                        raise StreamCut(f"the server reported an error mid-answer: {message}")
                    try:
                        choice = payload["choices"][0]
                    except (KeyError, IndexError, TypeError):
                        continue                      # e.g. a usage-only chunk
                    yield (choice.get("delta") or {}).get("content") or "", choice.get("finish_reason")
            except (OSError, http.client.HTTPException) as exc:   # reset, timeout, incomplete chunk
                raise StreamCut(f"the connection to {self.base} broke mid-answer "
                                f"({type(exc).__name__}{': ' + str(exc) if str(exc) else ''})") from None
        raise StreamCut(f"{self.base} closed the stream before the answer was complete (no [DONE])")

    def answer(self, text: str, out=None, notices=None) -> TurnStats:
        """Stream the reply to `out`. Ctrl-C after the first piece stops the answer (the partial reply
        is kept); before it, it cancels the turn (TurnCancelled). A cut stream raises StreamCut: the
        partial answer is not stored and the conversation is as it was before the turn."""
        out, notices = out or sys.stdout, notices or sys.stderr
        history = list(self.conversation.messages)
        while True:
            messages = self.conversation.render(text, history)
            t0 = time.monotonic()
            first = None
            pieces, reason, chunks = [], None, 0
            try:
                for piece, finish in self._stream(messages):
                    if piece:
                        first = first or time.monotonic()
                        chunks += 1
                        pieces.append(piece)
                        out.write(piece)
                        out.flush()
                    reason = finish or reason
            except KeyboardInterrupt:             # closing the connection cancels the request there
                if not pieces:
                    raise TurnCancelled("cancelled: no answer yet; the conversation is kept") from None
                out.write(" [stopped]")
                reason = "cancelled"
            except StreamCut:
                if pieces:
                    out.write(" [cut off]\n")
                    out.flush()
                raise
            except ServerError as exc:
                if pieces or not history or not exc.too_long:
                    raise
                history = history[2:]             # too long for the server: drop the oldest turn, retry
                notices.write("(context full: dropped the oldest turn)\n")
                continue
            break
        out.write("\n")
        out.flush()
        self.conversation.messages = history
        self.conversation.add(text, "".join(pieces))
        end = time.monotonic()
        first = first or end
        return TurnStats(0, 0, first - t0, max(0, chunks - 1), end - first, reason or "stop")
