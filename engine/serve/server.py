"""`python -m engine.serve`: the engine behind an OpenAI-compatible HTTP server (chapter 12).

    python -m engine.serve --model DIR --host 0.0.0.0 --port 8000

    GET  /v1/models              the one model this process serves (/v1/models/{id}: its card)
    POST /v1/chat/completions    messages -> the model's chat template -> tokens; "stream": true for SSE
    POST /v1/completions         a text (or token-id) prompt
    GET  /health                 200 while the engine answers, 503 while it is down or restarting
    GET  /metrics                Prometheus text: running, waiting, KV pages, tokens/s, time to first token
    GET  /                       the live dashboard (pages of the KV pool, request timeline, tokens/s)

Every HTTP request becomes one `llm.submit(prompt_ids, params)` per choice (n > 1: choice i with
seed + i; the choices share the prompt's pages through the prefix cache): the engine loop (one thread that
owns the model, the KV cache and the scheduler) admits it into the running batch at its next step
and streams tokens back. This module only translates: JSON in, SamplingParams and token ids to the
engine, events out as JSON or server-sent events (`data: {...}` lines, ending with `data: [DONE]`).
A client that disconnects cancels its request, which frees its KV pages at once.

`python -m engine.serve` runs the engine in a process of its own (engine/runtime/engine_process.py), so the
HTTP side's Python work never competes with the engine loop for one interpreter lock; --in-process
keeps both in one process (as ServerThread does for tests and notebooks).

Errors are OpenAI's JSON object {"error": {"message", "type", "param", "code"}}: 400 for invalid
values and prompts that cannot fit, 401 without a valid API key (when the server has keys), 404 for
an unknown model or path, 408 for a body that does not arrive in time, 413 for a body over the
limit, 415 for a form or text body (what a web page may send here cross-origin), 429 (with
Retry-After) when the queue or the client's share of it is full, 503 while the engine restarts.

Who may ask, and how much: engine/serve/admission.py (API keys, the bounded queue, per-client
limits); each request names its client to the engine, whose scheduler shares seats fairly among
clients. The engine process is supervised: when it dies, its requests end at once (an error event
in a stream, a 503 otherwise), /health and the dashboard say so, and the server starts a new one
(at most MAX_RESTARTS in RESTART_WINDOW_S, waiting longer after each), then serves again.

Bounded work per request, before anything costly: a connection must send its request head within
HEAD_TIMEOUT_S (engine/serve/connections.py: a slowloris cannot hold sockets open) and its body
within BODY_TIMEOUT_S; the body is read up to `max_body_bytes` (a larger Content-Length is refused
unread); JSON parsing, the chat template and tokenization run in worker threads, never on the event
loop (one 5 MB prompt must not freeze every other stream), and encoding stops at the context
(`encode(..., max_tokens=)`); a token-id prompt and `max_tokens` are checked against the context
here, before the engine (another process) receives them. /metrics serves the
last sample the background sampler took: it never waits for a step.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.backend import BACKENDS
from engine.runtime.engine_process import EngineProcessError
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.structured_outputs import StructuredOutputs
from engine.serve import protocol as api
from engine.serve import tools
from engine.serve.admission import Admission, Keys, Refused, Unauthorized
from engine.serve.connections import http_protocol
from engine.serve.metrics import Monitor

ParsedRequest = TypeVar("ParsedRequest", bound=api.SamplingRequest)

DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboard"
DASHBOARD_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
logger = logging.getLogger("engine.serve.server")
SAMPLE_EVERY_S = 0.25     # how often the monitor reads the engine's stats (the dashboard's frame rate)
MAX_BODY_BYTES = 8 * 2**20   # a 131,072-token prompt is ~1 MB as JSON ids, less as text
# the Content-Types a page on any site may POST here without a CORS preflight: never JSON requests
BROWSER_FORM_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
BODY_TIMEOUT_S = 30.0        # a client trickling its body a byte at a time holds a request slot
SUPERVISE_EVERY_S = 0.2      # how often the server checks that the engine process lives
MAX_RESTARTS, RESTART_WINDOW_S = 5, 600.0    # more deaths than that in the window: give up (stay down)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(api.error_body(self.message, self.type, self.param, self.code), status_code=self.status,
                            headers=self.headers)


def bearer(request: Request) -> str | None:
    """The key of `Authorization: Bearer KEY`, or of ?key= (the dashboard in a browser)."""
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip() or None
    return request.query_params.get("key") or None


class Ticket:
    """A request's place in the server's admission count, given back exactly once."""

    def __init__(self, admission: Admission, client: str):
        self.admission, self.client = admission, admission.enter(client)
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.leave(self.client)


def sse(data) -> str:
    """One server-sent event: a `data:` line and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def cancel_on_disconnect(request: Request, handle) -> None:
    """Wait for the client to go away, then cancel its request (its KV pages are freed at once).

    The body has been read already, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handle.cancel()


class OpenAIServer:
    """The routes, bound to one LLM. `app` is the ASGI application."""

    def __init__(self, llm, model_name: str, max_body_bytes: int = MAX_BODY_BYTES, max_tokens: int | None = None,
                 max_queue: int | None = None, max_queue_per_client: int | None = None,
                 api_keys=(), metrics_keys=(), body_timeout: float = BODY_TIMEOUT_S):
        """max_tokens: the most tokens one request may ask for (default: the context); a request over it
        is refused rather than holding a seat's worth of KV pages for an answer nobody waits for.
        max_queue: requests held beyond the engine's seats, all clients together (default 4x the seats,
        at least 256); max_queue_per_client: one client's share of it (default a quarter).
        api_keys: required on /v1 when given; metrics_keys: read-only keys for the dashboard and /metrics."""
        for name, value in (("max_body_bytes", max_body_bytes), ("max_tokens", max_tokens)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.llm, self.model_name, self.max_body_bytes = llm, model_name, max_body_bytes
        self.max_tokens = llm.max_context if max_tokens is None else max_tokens
        self.body_timeout = body_timeout
        self.tokenizer = llm.tokenizer
        # structured outputs are compiled here first (a bad schema is a 400 before the engine sees it)
        config = getattr(llm, "config", None)                   # (an LLM; a RemoteLLM has vocab_size)
        vocab_size: int = config.vocab_size if config is not None else getattr(llm, "vocab_size", 0)
        if not vocab_size and self.tokenizer is not None:        # (a stand-in engine of the tests)
            vocab_size = self.tokenizer.vocab_size
        self._structured = StructuredOutputs(self.tokenizer, vocab_size or 1,
                                             self.tokenizer.eos_token_ids if self.tokenizer else set())
        self.created = int(time.time())
        queue = max(256, 4 * llm.max_seqs) if max_queue is None else max_queue
        self.admission = Admission(llm.max_seqs, queue, queue // 4 if max_queue_per_client is None
                                   else max_queue_per_client)
        self.keys = Keys(api_keys, metrics_keys)
        self.engine_state = "ok"        # ok | down | restarting | failed (an engine in its own process)
        self.monitor = Monitor(llm, model_name, self.state)
        routes = [Route("/v1/models", self.models), Route("/v1/models/{name:path}", self.model),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/health", self.health), Route("/metrics", self.metrics),
                  Route("/", self.dashboard_page), Route("/dashboard/events", self.dashboard_events),
                  Route("/dashboard/{name}", self.dashboard_file)]
        handlers: dict = {ApiError: lambda _, e: e.response(), HTTPException: self.http_error}
        self.app = Starlette(routes=routes, lifespan=self.lifespan, exception_handlers=handlers)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        tasks = [asyncio.create_task(self._sample_forever())]
        if hasattr(self.llm, "restart"):          # an engine in a process of its own: watch it
            tasks.append(asyncio.create_task(self._supervise()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()

    def state(self) -> dict:
        """The server's side of the dashboard and /metrics."""
        return {"engine": self.engine_state, "restarts": getattr(self.llm, "restarts", 0),
                "admission": self.admission.snapshot()}

    async def _supervise(self) -> None:
        """Restart a dead engine process, waiting 0.5 s, 1 s, 2 s, ... (at most 30 s) before each try; after
        MAX_RESTARTS deaths in RESTART_WINDOW_S, stay down (a model that crashes at once would loop)."""
        deaths: list[float] = []
        while True:
            await asyncio.sleep(SUPERVISE_EVERY_S)
            if self.llm.alive:
                continue
            self.engine_state = "down"
            now = time.monotonic()
            deaths = [t for t in deaths if t > now - RESTART_WINDOW_S] + [now]
            logger.error("the engine process ended (%s); %d death(s) in the last %d s",
                         self.llm.exit_reason, len(deaths), RESTART_WINDOW_S)
            if len(deaths) > MAX_RESTARTS:
                self.engine_state = "failed"
                logger.error("not restarting the engine again: restart the server once the cause is fixed")
                return
            await asyncio.sleep(min(30.0, 0.5 * 2 ** (len(deaths) - 1)))
            self.engine_state = "restarting"
            try:
                await asyncio.to_thread(self.llm.restart)
            except Exception as exc:           # counted as one more death at the next check
                logger.error("the engine did not restart: %s", exc)
                continue
            self.engine_state = "ok"
            logger.warning("the engine process was restarted (%d restart(s) so far)", self.llm.restarts)

    async def _sample_forever(self) -> None:
        while True:      # stats() waits for a step boundary: never on the event loop's thread
            if self.engine_state != "ok":       # the dashboard keeps its last picture, says "down"
                await asyncio.sleep(SAMPLE_EVERY_S)
                continue
            try:
                await asyncio.to_thread(self.monitor.sample)
            except Exception as exc:     # a slow first step (kernels compiling), an engine restarting:
                logger.warning("engine stats unavailable (%s); the dashboard keeps its last picture", exc)
                await asyncio.sleep(1.0)  # the dashboard must not stop for good
            await asyncio.sleep(SAMPLE_EVERY_S)

    # ---- plumbing ----------------------------------------------------------------------------
    @staticmethod
    async def http_error(request: Request, exc: HTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(api.error_body(str(exc.detail), type_), status_code=exc.status_code)

    async def _read_body(self, request: Request) -> bytes:
        """The body, at most max_body_bytes of it (413 beyond, a declared larger length refused unread)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body ({int(declared):,} bytes) is larger than this server's limit "
                                f"of {limit:,} bytes")
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes")
                chunks.append(chunk)
        try:
            await asyncio.wait_for(read(), self.body_timeout)
        except ClientDisconnect:      # gone mid-upload: nobody is left to answer (and nothing to log)
            raise ApiError(400, "the client disconnected before the body was read") from None
        except TimeoutError:
            raise ApiError(408, f"the request body was not received within {self.body_timeout:g} s") from None
        return b"".join(chunks)

    @staticmethod
    def _json(raw: bytes):
        """json.loads with every way a hostile body can fail it as one 400: not UTF-8, not JSON, nested
        past the parser's recursion limit, an integer literal past Python's digit limit."""
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:     # JSONDecodeError and UnicodeDecodeError are ValueErrors
            what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
            raise ApiError(400, f"the request body is not valid JSON: {what}") from None

    async def _parse(self, request: Request, model: type[ParsedRequest]) -> tuple[ParsedRequest, SamplingParams]:
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind in BROWSER_FORM_TYPES:   # what a web page may POST cross-origin without asking: refused
            raise ApiError(415, f"the request body must be JSON: send Content-Type: application/json, not {kind}")
        data = await asyncio.to_thread(self._json, await self._read_body(request))
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            body = model.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = api.param_name(err["loc"])
            raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param) from None
        if body.model != self.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "model_not_found", "not_found_error")
        try:
            body.check_supported()
            params = body.sampling_params()
        except api.ProtocolError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        if body.max_tokens is None and params.max_new_tokens > self.max_tokens:   # the default, not asked
            params = dataclasses.replace(params, max_new_tokens=self.max_tokens)
        if params.max_new_tokens > self.max_tokens:
            raise ApiError(400, f"max_tokens is {params.max_new_tokens}; this server allows at most "
                                f"{self.max_tokens}", "max_tokens")
        return body, params

    def _encode(self, render, param: str, add_special_tokens: bool = False) -> list[int]:
        """Tokenize (in a worker thread), stopping at the context: `render()` gives the text."""
        try:
            return self.tokenizer.encode(render(), add_special_tokens=add_special_tokens,
                                         max_tokens=self.llm.max_context)
        except ValueError as exc:    # past the context, a lone surrogate, the template refusing the messages
            message = str(exc)[:500]
            if message.startswith("text needs more than"):   # encode's max_tokens: say it as the engine does
                message = f"the prompt does not fit the context of {self.llm.max_context} tokens ({message})"
            raise ApiError(400, message, getattr(exc, "param", None) or param) from None

    def _unavailable(self, why: str) -> ApiError:
        return ApiError(503, f"the engine is {self.engine_state} ({why}); retry shortly", type_="server_error",
                        code="engine_unavailable", headers={"Retry-After": "2"})

    def _check_engine(self) -> None:
        if self.engine_state != "ok" or not getattr(self.llm, "alive", True):
            raise self._unavailable(getattr(self.llm, "exit_reason", None) or "not answering")

    async def _submit(self, prompt_ids: list[int], params, param: str, client: str):
        if len(prompt_ids) >= self.llm.max_context:      # before the ids travel to the engine process
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens: it does not fit the context of "
                                f"{self.llm.max_context} with room for one new token", param)
        self._check_engine()
        try:
            handle = self.llm.submit(prompt_ids, params, client=client)
        except ValueError as exc:     # does not fit the context or the KV pool, bad token ids, ...
            raise ApiError(400, str(exc), param) from None
        except (EngineProcessError, RuntimeError) as exc:     # died (or closed) just now
            raise self._unavailable(str(exc)) from None
        try:
            await handle.accepted()   # an engine in its own process checks the request there
        except ValueError as exc:
            raise ApiError(400, str(exc), param) from None
        except EngineProcessError as exc:
            raise self._unavailable(str(exc)) from None
        except BaseException:         # the client or the server went away while it waited
            handle.cancel()
            raise
        return handle

    async def _submit_choices(self, prompt_ids: list[int], choices: list, param: str, client: str) -> list:
        """One engine request per choice (n > 1). They share the prompt's full pages through the prefix
        cache: the first choice's pages are registered when its row is scheduled, and the others,
        admitted in that step or a later one, reuse them instead of computing the prompt again."""
        handles: list = []
        try:
            for params in choices:
                handles.append(await self._submit(prompt_ids, params, param, client))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ApiError(400, "this model directory has no tokenizer.json: send token ids to /v1/completions")
        return self.tokenizer

    async def _collect(self, request: Request, handle) -> tuple[str, list[int], str, list | None]:
        """Run a request to the end (non-streaming): its text, generated ids, finish reason, logprobs."""
        watcher = asyncio.create_task(cancel_on_disconnect(request, handle))
        text: list[str] = []
        ids: list[int] = []
        logprobs: list | None = None
        reason = "cancelled"     # until the final event says otherwise
        try:
            async for batch in handle.astream_batches():
                for ev in batch:
                    text.append(ev.text)
                    ids.extend(ev.token_ids)
                    if ev.logprobs is not None:
                        logprobs = (logprobs or []) + ev.logprobs
                    reason = ev.finish_reason if ev.finished else reason
        except EngineProcessError as exc:      # the engine died under it
            raise self._unavailable(str(exc)) from None
        finally:
            watcher.cancel()
            if not handle.done:
                handle.cancel()
        return "".join(text), ids, reason, logprobs

    async def _collect_all(self, request: Request, handles: list) -> list[tuple[str, list[int], str, list | None]]:
        """Every choice run to its end, together (n > 1: n requests of the engine)."""
        try:
            return list(await asyncio.gather(*(self._collect(request, h) for h in handles)))
        finally:
            for h in handles:
                if not h.done:
                    h.cancel()

    def _stream(self, request: Request, handles: list, first: list, piece, last, usage_chunk,
                ticket: Ticket) -> StreamingResponse:
        """SSE: the `first` chunks, one chunk per piece of new text of a choice (piece(text, index, events)), each
        choice's finishing chunk (last(reason, index)), usage, [DONE].

        A piece is everything the engine handed over since this stream last woke: one token while the
        server keeps up, several when it falls behind (then one message carries them all, so a busy
        server sends fewer, larger events instead of falling further behind). With n > 1 the choices'
        pieces interleave as they come, each naming its index."""
        async def pump(index: int, handle, queue: asyncio.Queue) -> None:
            try:
                async for batch in handle.astream_batches():
                    await queue.put((index, batch, None))
            except Exception as exc:          # the engine failed this request
                await queue.put((index, None, exc))
            else:
                await queue.put((index, None, None))

        async def events():
            watchers = [asyncio.create_task(cancel_on_disconnect(request, h)) for h in handles]
            queue: asyncio.Queue = asyncio.Queue()
            pumps: list[asyncio.Task] = []
            reasons: dict[int, str | None] = {}
            n_tokens = 0
            try:
                for chunk in first:
                    yield sse(chunk)
                pumps = [asyncio.create_task(pump(i, h, queue)) for i, h in enumerate(handles)]
                ended = 0
                while ended < len(handles):
                    index, batch, exc = await queue.get()
                    if exc is not None:       # the engine failed this request: say so, send no [DONE]
                        logger.warning("request failed in the engine: %s", exc)
                        yield sse(api.error_body(f"the engine failed this request: {exc}"[:500], "server_error"))
                        return
                    if batch is None:
                        ended += 1
                        continue
                    n_tokens += sum(len(ev.token_ids) for ev in batch)
                    text = "".join(ev.text for ev in batch)
                    if text or any(ev.token_ids and not ev.finished for ev in batch):   # tokens, no text yet
                        yield sse(piece(text, index, batch))
                    if batch[-1].finished:
                        reasons[index] = batch[-1].finish_reason
                if all(reasons.get(i) in ("stop", "length") for i in range(len(handles))):
                    for i in range(len(handles)):
                        yield sse(last(reasons[i], i))
                    if usage_chunk is not None:
                        yield sse(usage_chunk(n_tokens))
                    yield sse("[DONE]")
            finally:
                for task in watchers + pumps:
                    task.cancel()
                ticket.release()
                for h in handles:        # the client went away (or the engine failed): free the pages
                    if not h.done:
                        h.cancel()
        # (the background task gives the ticket back if the stream never started: the client left first)
        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(ticket.release),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- the OpenAI API ----------------------------------------------------------------------
    def _client(self, request: Request) -> str:
        """Who asks (401 when the server has keys and this request has none that fits)."""
        try:
            return self.keys.client(bearer(request), request.client.host if request.client else None)
        except Unauthorized as exc:
            raise ApiError(401, str(exc), code="invalid_api_key", type_="authentication_error") from None

    def _watcher(self, request: Request) -> None:
        if not self.keys.may_watch(bearer(request)):
            raise ApiError(401, "the dashboard and /metrics need an API key or the metrics key "
                                "(Authorization: Bearer KEY, or ?key=KEY)", code="invalid_api_key",
                           type_="authentication_error")

    async def _admitted(self, request: Request, serve) -> Response:
        """Keys, engine, queue limits (401, 503, 429) before any work; then serve(request, client, ticket),
        the ticket given back when the response ends (a stream gives it back itself)."""
        client = self._client(request)
        self._check_engine()
        try:
            ticket = Ticket(self.admission, client)
        except Refused as exc:
            raise ApiError(429, str(exc), code="rate_limit_exceeded", type_="rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        try:
            response = await serve(request, client, ticket)
        except BaseException:
            ticket.release()
            raise
        if not isinstance(response, StreamingResponse):
            ticket.release()
        return response

    async def models(self, request: Request) -> Response:
        self._client(request)
        return JSONResponse({"object": "list", "data": [api.model_card(self.model_name, self.created)]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model's card, or 404 naming the one served."""
        self._client(request)
        name = request.path_params["name"]
        if name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found", "not_found_error")
        return JSONResponse(api.model_card(self.model_name, self.created))

    async def chat(self, request: Request) -> Response:
        return await self._admitted(request, self._chat)

    async def completions(self, request: Request) -> Response:
        return await self._admitted(request, self._completions)

    async def _chat(self, request: Request, client: str, ticket: Ticket) -> Response:
        body, params = await self._parse(request, api.ChatCompletionRequest)
        tok = self._need_tokenizer()
        try:
            messages = tools.template_messages(body.plain_messages())
            plan = tools.plan_tools(body.tools, body.tool_choice)
            if plan.constraint is not None:
                if params.structured is not None:
                    raise api.ProtocolError("a forced tool_choice is a structured output of its own: drop "
                                            "response_format / guided_*", "tool_choice")
                params = dataclasses.replace(params, structured=plan.constraint)
        except ValueError as exc:    # a ProtocolError
            raise ApiError(400, str(exc), getattr(exc, "param", "messages")) from None
        await self._check_structured(params, "tool_choice" if plan.constraint is not None else "response_format")

        def render():
            shown = plan.template_tools()
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=shown)
            if shown and text == tok.apply_chat_template(messages, add_generation_prompt=True):
                # the template ignores tools: describe them in a system message of its own
                text = tok.apply_chat_template([{"role": "system", "content": tools.describe_tools(shown)}, *messages],
                                               add_generation_prompt=True)
            return text
        prompt_ids = await asyncio.to_thread(self._encode, render, "messages")
        handles = await self._submit_choices(prompt_ids, body.choice_params(params), "messages", client)
        rid, created, n_prompt = api.new_id("chatcmpl"), int(time.time()), len(prompt_ids)

        def message(text: str, reason: str) -> tuple[dict, str]:
            """The assistant message of an answer, and its finish reason ("tool_calls" for calls)."""
            calls = plan.calls(text) if reason == "stop" or plan.mode != "auto" else None
            if calls is None:
                return {"role": "assistant", "content": text}, reason
            return {"role": "assistant", "content": None, "tool_calls": tools.tool_call_objects(calls)}, \
                "tool_calls" if reason == "stop" else reason
        if not body.stream or plan.mode in ("auto", "required"):   # (calls are known once the answer is)
            answers = await self._collect_all(request, handles)
            usage = api.usage(n_prompt, sum(len(ids) for _, ids, _, _ in answers))
            done = [(*message(text, reason), api.chat_logprobs(tok, ids, lps)) for text, ids, reason, lps in answers]
            if not body.stream:
                return JSONResponse(api.chat_completion(rid, self.model_name, done, usage))
            ticket.release()
            return self._replay(rid, created, done, usage if body.include_usage else None)

        def chunk(delta, reason=None, use=None, index=0, logprobs=None):
            return api.chat_chunk(rid, self.model_name, created, delta, reason, use, index, logprobs)

        first = [chunk({"role": "assistant", "content": ""}, index=i) for i in range(len(handles))]
        if plan.mode == "named":     # the arguments stream as they come
            first = [chunk({"role": "assistant", "content": None, "tool_calls": [
                {"index": 0, **tools.tool_call_objects([{"name": plan.named, "arguments": ""}])[0]}]}, index=i)
                for i in range(len(handles))]

        def piece(text, i, events):
            lps = api.chat_logprobs(tok, *_event_logprobs(events))
            if plan.mode == "named":
                return chunk({"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, index=i, logprobs=lps)
            return chunk({"content": text}, index=i, logprobs=lps)

        def last(reason, i):
            return chunk({}, "tool_calls" if plan.mode == "named" and reason == "stop" else reason, index=i)
        return self._stream(request, handles, first, piece, last,
                            (lambda n: chunk({}, use=api.usage(n_prompt, n))) if body.include_usage else None,
                            ticket)

    def _replay(self, rid: str, created: int, done: list, usage: dict | None) -> StreamingResponse:
        """A stream of answers already complete (tool calls are known once the whole answer is): for
        each choice its message as one delta, its finish reason; then usage and [DONE]."""
        def events():
            for i, (message, reason, logprobs) in enumerate(done):
                delta = {k: v for k, v in message.items() if v is not None or k == "content"}
                if "tool_calls" in delta:
                    delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(delta["tool_calls"])]
                yield sse(api.chat_chunk(rid, self.model_name, created, delta, None, None, i, logprobs))
                yield sse(api.chat_chunk(rid, self.model_name, created, {}, reason, None, i))
            if usage is not None:
                yield sse(api.chat_chunk(rid, self.model_name, created, {}, use=usage))
            yield sse("[DONE]")
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _check_structured(self, params, param: str) -> None:
        """Compile a structured output's automaton off the event loop (cached by engine/structured):
        a bad schema or pattern is a 400 before the request reaches the engine."""
        if params.structured is None:
            return
        try:
            await asyncio.to_thread(self._structured.compile, params.structured)
        except ValueError as exc:
            raise ApiError(400, str(exc), param) from None

    async def _completions(self, request: Request, client: str, ticket: Ticket) -> Response:
        body, params = await self._parse(request, api.CompletionRequest)
        await self._check_structured(params, "response_format")
        try:
            prompt = body.single_prompt()
        except api.ProtocolError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        if isinstance(prompt, str):
            self._need_tokenizer()                     # 400 without a tokenizer.json
            prompt_ids = await asyncio.to_thread(self._encode, lambda: prompt, "prompt", True)
        else:
            prompt_ids = prompt
        handles = await self._submit_choices(prompt_ids, body.choice_params(params), "prompt", client)
        rid, created, n_prompt = api.new_id("cmpl"), int(time.time()), len(prompt_ids)
        tok = self.tokenizer
        if not body.stream:
            answers = await self._collect_all(request, handles)
            return JSONResponse(api.text_completion(
                rid, self.model_name, created,
                [(text, reason, api.completion_logprobs(tok, ids, lps)) for text, ids, reason, lps in answers],
                api.usage(n_prompt, sum(len(ids) for _, ids, _, _ in answers))))

        def chunk(text, reason, index, logprobs=None):
            return api.text_completion(rid, self.model_name, created, [(text, reason, logprobs)], first_index=index)

        def usage_chunk(n):
            return api.text_completion(rid, self.model_name, created, [], api.usage(n_prompt, n))
        offsets = [0] * len(handles)      # each choice's text so far: where its next token's text starts

        def piece(text, i, events):
            logprobs = api.completion_logprobs(tok, *_event_logprobs(events), offset=offsets[i])
            offsets[i] += len(text)
            return chunk(text, None, i, logprobs)
        return self._stream(request, handles, [], piece,
                            lambda reason, i: chunk("", reason, i),
                            usage_chunk if body.include_usage else None, ticket)

    # ---- operations --------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """200 while the engine answers; 503 naming the state (down, restarting, failed) otherwise."""
        up = self.engine_state == "ok" and getattr(self.llm, "alive", True)
        body: dict = {"status": "ok" if up else self.engine_state if self.engine_state != "ok" else "down",
                "model": self.model_name}
        if not up:
            body["reason"] = getattr(self.llm, "exit_reason", None)
        return JSONResponse(body, status_code=200 if up else 503)

    async def metrics(self, request: Request) -> Response:
        self._watcher(request)
        return PlainTextResponse(self.monitor.prometheus(), media_type="text/plain; version=0.0.4")

    # ---- the dashboard -----------------------------------------------------------------------
    async def dashboard_page(self, request: Request) -> Response:
        self._watcher(request)
        return FileResponse(DASHBOARD_DIR / "index.html", media_type="text/html")

    async def dashboard_file(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in DASHBOARD_FILES:
            raise HTTPException(404, f"no dashboard file {name!r}")
        return FileResponse(DASHBOARD_DIR / name, media_type=DASHBOARD_FILES[name])

    async def dashboard_events(self, request: Request) -> Response:
        """A snapshot every SAMPLE_EVERY_S as SSE, for as long as the page stays open."""
        self._watcher(request)

        async def events():
            while True:
                yield sse(self.monitor.snapshot())
                await asyncio.sleep(SAMPLE_EVERY_S)
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _event_logprobs(events) -> tuple[list[int], list | None]:
    """(token ids, their logprobs or None) of a batch of stream events."""
    if all(ev.logprobs is None for ev in events):
        return [], None
    return [t for ev in events for t in ev.token_ids], [e for ev in events for e in (ev.logprobs or [])]


def create_app(llm, model_name: str, **limits):
    """The ASGI app; limits: OpenAIServer's keyword arguments (max_body_bytes, max_tokens, max_queue,
    max_queue_per_client, api_keys, metrics_keys, body_timeout)."""
    return OpenAIServer(llm, model_name, **limits).app


class ServerThread:
    """uvicorn in a background thread (tests, notebooks, benchmarks). port=0 picks a free port.

        with ServerThread(llm, "tiny") as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, llm, model_name: str, host: str = "127.0.0.1", port: int = 0, **limits):
        import uvicorn
        self.openai = OpenAIServer(llm, model_name, **limits)
        config = uvicorn.Config(self.openai.app, host=host, port=port, log_level="warning", http=http_protocol(),
                                lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="engine-serve", daemon=True)
        self.host, self.port = host, port

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine.serve", description="Serve a model over the OpenAI HTTP API.")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the directory's)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve a whole room")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--kv-cache-mib", type=float, default=None, help="KV pool size (default: what fits)")
    ap.add_argument("--max-seqs", type=int, default=None, help="most sequences in one batch")
    ap.add_argument("--max-context", type=int, default=None, help="tokens one sequence may hold")
    ap.add_argument("--speculative", default=None, metavar="SPEC",
                    help="speculative decoding: 'ngram', 'ngram:K' or 'draft:DIR' (a smaller model of the same "
                         "tokenizer; chapter 16); steps aside in large batches")
    ap.add_argument("--quantization", default=None, choices=("int8", "int4"),
                    help="weight-only quantization on load: int8 or int4 (group-wise, 128 inputs per scale or the "
                         "largest group below that the model takes; chapter 18); an AWQ checkpoint runs its own "
                         "4-bit weights")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="the most tokens one request may ask for (default: the context)")
    ap.add_argument("--max-body-mib", type=float, default=MAX_BODY_BYTES / 2**20,
                    help="the largest request body accepted (413 beyond)")
    ap.add_argument("--max-queue", type=int, default=None,
                    help="requests held beyond the engine's seats, all clients together (429 beyond; "
                         "default 4x --max-seqs, at least 256)")
    ap.add_argument("--max-queue-per-client", type=int, default=None,
                    help="one client's share of the queue (default a quarter of it); a client is its API "
                         "key, or its address without keys")
    ap.add_argument("--api-key", action="append", default=[],
                    help="require this key (Authorization: Bearer KEY) on /v1; repeat for several; also read "
                         "from ENGINE_API_KEYS (comma-separated), which keeps keys out of the process list")
    ap.add_argument("--metrics-key", action="append", default=[],
                    help="a read-only key for the dashboard (?key=KEY) and /metrics (API keys open them too)")
    ap.add_argument("--in-process", action="store_true",
                    help="run the engine in the server's own process (default: a process of its own, so "
                         "HTTP and JSON work never holds the engine's interpreter lock)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="uvicorn's log (info prints one line per request)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import uvicorn

    from engine.backend import BackendError
    from engine.runtime.engine_process import RemoteLLM
    from engine.runtime.llm import LLM
    if (args.max_tokens is not None and args.max_tokens < 1) or not args.max_body_mib > 0:
        print("error: --max-tokens and --max-body-mib must be positive", file=sys.stderr)
        return 2
    if any(v is not None and v < 0 for v in (args.max_queue, args.max_queue_per_client)):
        print("error: --max-queue and --max-queue-per-client must be >= 0", file=sys.stderr)
        return 2
    api_keys = args.api_key + [k.strip() for k in os.environ.get("ENGINE_API_KEYS", "").split(",") if k.strip()]
    try:
        Keys(api_keys, args.metrics_key)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.model is None:
            from engine.model.default_model import ensure_default_model
            model_dir = ensure_default_model()
        else:
            model_dir = Path(args.model)
        from engine.runtime.speculative import SpeculativeConfig
        options = {"kv_cache_mib": args.kv_cache_mib, "max_seqs": args.max_seqs, "max_context": args.max_context,
                   "speculative": SpeculativeConfig.from_cli(args.speculative), "quantization": args.quantization}
        llm: LLM | RemoteLLM
        if args.in_process:
            llm = LLM(model_dir, args.backend, **options)
            where = llm.backend.describe()
        else:
            remote = llm = RemoteLLM(model_dir, args.backend, **options)
            where = remote.description + " (engine process)"
    except (ValueError, BackendError, OSError, EngineProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or Path(model_dir).resolve().name
    shown = "localhost" if args.host in ("0.0.0.0", "::") else args.host
    print(f"serving {name!r} on {where.rstrip('.')}\n"
          f"  OpenAI API: http://{shown}:{args.port}/v1   dashboard: http://{shown}:{args.port}/", flush=True)
    try:
        app = create_app(llm, name, max_tokens=args.max_tokens, max_body_bytes=int(args.max_body_mib * 2**20),
                         max_queue=args.max_queue, max_queue_per_client=args.max_queue_per_client,
                         api_keys=api_keys, metrics_keys=args.metrics_key)
        if api_keys:
            print(f"  {len(api_keys)} API key(s) required on /v1; the dashboard takes ?key=KEY", flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=http_protocol())
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
