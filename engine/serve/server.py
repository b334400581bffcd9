"""`python -m engine.serve`: the engine behind an OpenAI-compatible HTTP server (chapter 12).

    python -m engine.serve --model DIR --host 0.0.0.0 --port 8000

    GET  /v1/models              the one model this process serves
    POST /v1/chat/completions    messages -> the model's chat template -> tokens; "stream": true for SSE
    POST /v1/completions         a text (or token-id) prompt
    GET  /health                 200 while the server is up
    GET  /metrics                Prometheus text: running, waiting, KV pages, tokens/s, time to first token
    GET  /                       the live dashboard (pages of the KV pool, request timeline, tokens/s)

Every HTTP request becomes one `llm.submit(prompt_ids, params)`: the engine loop (one thread that
owns the model, the KV cache and the scheduler) admits it into the running batch at its next step
and streams tokens back. This module only translates: JSON in, SamplingParams and token ids to the
engine, events out as JSON or server-sent events (`data: {...}` lines, ending with `data: [DONE]`).
A client that disconnects cancels its request, which frees its KV pages at once.

`python -m engine.serve` runs the engine in a process of its own (engine/runtime/engine_process.py), so the
HTTP side's Python work never competes with the engine loop for one interpreter lock; --in-process
keeps both in one process (as ServerThread does for tests and notebooks).

Errors are OpenAI's JSON object {"error": {"message", "type", "param", "code"}}: 400 for invalid
values and prompts that cannot fit, 404 for an unknown model or path, 413 for a body over the limit.

Bounded work per request, before anything costly: the body is read up to `max_body_bytes` (a larger
Content-Length is refused unread); JSON parsing, the chat template and tokenization run in worker
threads, never on the event loop (one 5 MB prompt must not freeze every other stream), and encoding
stops at the context (`encode(..., max_tokens=)`); a token-id prompt and `max_tokens` are checked
against the context here, before the engine (another process) receives them. /metrics serves the
last sample the background sampler took: it never waits for a step.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.backend import BACKENDS
from engine.runtime.sampling_params import SamplingParams
from engine.serve import protocol as api
from engine.serve.metrics import Monitor

ParsedRequest = TypeVar("ParsedRequest", bound=api.SamplingRequest)

DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboard"
DASHBOARD_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
logger = logging.getLogger("engine.serve.server")
SAMPLE_EVERY_S = 0.25     # how often the monitor reads the engine's stats (the dashboard's frame rate)
MAX_BODY_BYTES = 8 * 2**20   # a 131,072-token prompt is ~1 MB as JSON ids, less as text


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> JSONResponse:
        return JSONResponse(api.error_body(self.message, self.type, self.param, self.code), status_code=self.status)


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

    def __init__(self, llm, model_name: str, max_body_bytes: int = MAX_BODY_BYTES, max_tokens: int | None = None):
        """max_tokens: the most tokens one request may ask for (default: the context); a request over it
        is refused rather than holding a seat's worth of KV pages for an answer nobody waits for."""
        for name, value in (("max_body_bytes", max_body_bytes), ("max_tokens", max_tokens)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.llm, self.model_name, self.max_body_bytes = llm, model_name, max_body_bytes
        self.max_tokens = llm.max_context if max_tokens is None else max_tokens
        self.tokenizer = llm.tokenizer
        self.created = int(time.time())
        self.monitor = Monitor(llm, model_name)
        routes = [Route("/v1/models", self.models), Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/health", self.health), Route("/metrics", self.metrics),
                  Route("/", self.dashboard_page), Route("/dashboard/events", self.dashboard_events),
                  Route("/dashboard/{name}", self.dashboard_file)]
        handlers: dict = {ApiError: lambda _, e: e.response(), HTTPException: self.http_error}
        self.app = Starlette(routes=routes, lifespan=self.lifespan, exception_handlers=handlers)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        sampler = asyncio.create_task(self._sample_forever())
        try:
            yield
        finally:
            sampler.cancel()

    async def _sample_forever(self) -> None:
        while True:      # stats() waits for a step boundary: never on the event loop's thread
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
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes")
                chunks.append(chunk)
        except ClientDisconnect:      # gone mid-upload: nobody is left to answer (and nothing to log)
            raise ApiError(400, "the client disconnected before the body was read") from None
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
        data = await asyncio.to_thread(self._json, await self._read_body(request))
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            body = model.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
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

    async def _submit(self, prompt_ids: list[int], params, param: str):
        if len(prompt_ids) >= self.llm.max_context:      # before the ids travel to the engine process
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens: it does not fit the context of "
                                f"{self.llm.max_context} with room for one new token", param)
        try:
            handle = self.llm.submit(prompt_ids, params)
        except ValueError as exc:     # does not fit the context or the KV pool, bad token ids, ...
            raise ApiError(400, str(exc), param) from None
        try:
            await handle.accepted()   # an engine in its own process checks the request there
        except ValueError as exc:
            raise ApiError(400, str(exc), param) from None
        except BaseException:         # the client or the server went away while it waited
            handle.cancel()
            raise
        return handle

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ApiError(400, "this model directory has no tokenizer.json: send token ids to /v1/completions")
        return self.tokenizer

    async def _collect(self, request: Request, handle) -> tuple[str, list[int], str]:
        """Run a request to the end (non-streaming): its text, generated ids, finish reason."""
        watcher = asyncio.create_task(cancel_on_disconnect(request, handle))
        text: list[str] = []
        ids: list[int] = []
        reason = "cancelled"     # until the final event says otherwise
        try:
            async for batch in handle.astream_batches():
                for ev in batch:
                    text.append(ev.text)
                    ids.extend(ev.token_ids)
                    reason = ev.finish_reason if ev.finished else reason
        finally:
            watcher.cancel()
            if not handle.done:
                handle.cancel()
        return "".join(text), ids, reason

    def _stream(self, request: Request, handle, first: list, piece, last, usage_chunk) -> StreamingResponse:
        """SSE: the `first` chunks, one chunk per piece of new text, the finishing chunk, usage, [DONE].

        A piece is everything the engine handed over since this stream last woke: one token while the
        server keeps up, several when it falls behind (then one message carries them all, so a busy
        server sends fewer, larger events instead of falling further behind)."""
        async def events():
            watcher = asyncio.create_task(cancel_on_disconnect(request, handle))
            reason, n_tokens = None, 0
            try:
                for chunk in first:
                    yield sse(chunk)
                try:
                    async for batch in handle.astream_batches():
                        n_tokens += sum(len(ev.token_ids) for ev in batch)
                        text = "".join(ev.text for ev in batch)
                        if text or any(ev.token_ids and not ev.finished for ev in batch):   # tokens, no text yet
                            yield sse(piece(text))
                        if batch[-1].finished:
                            reason = batch[-1].finish_reason
                except Exception as exc:     # the engine failed this request: say so, send no [DONE]
                    logger.warning("request failed in the engine: %s", exc)
                    yield sse(api.error_body(f"the engine failed this request: {exc}"[:500], "server_error"))
                    return
                if reason in ("stop", "length"):
                    yield sse(last(reason))
                    if usage_chunk is not None:
                        yield sse(usage_chunk(n_tokens))
                    yield sse("[DONE]")
            finally:
                watcher.cancel()
                if reason is None:       # the client went away (or the engine failed): free the pages
                    handle.cancel()
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- the OpenAI API ----------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [api.model_card(self.model_name, self.created)]})

    async def chat(self, request: Request) -> Response:
        body, params = await self._parse(request, api.ChatCompletionRequest)
        tok = self._need_tokenizer()
        try:
            messages = body.plain_messages()
        except ValueError as exc:    # a ProtocolError
            raise ApiError(400, str(exc), getattr(exc, "param", "messages")) from None
        prompt_ids = await asyncio.to_thread(
            self._encode, lambda: tok.apply_chat_template(messages, add_generation_prompt=True), "messages")
        handle = await self._submit(prompt_ids, params, "messages")
        rid, created, n_prompt = api.new_id("chatcmpl"), int(time.time()), len(prompt_ids)
        if not body.stream:
            text, ids, reason = await self._collect(request, handle)
            return JSONResponse(api.chat_completion(rid, self.model_name, text, reason,
                                                    api.usage(n_prompt, len(ids))))

        def chunk(delta, reason=None, use=None):
            return api.chat_chunk(rid, self.model_name, created, delta, reason, use)
        return self._stream(request, handle, [chunk({"role": "assistant", "content": ""})],
                            lambda text: chunk({"content": text}), lambda reason: chunk({}, reason),
                            (lambda n: chunk({}, use=api.usage(n_prompt, n))) if body.include_usage else None)

    async def completions(self, request: Request) -> Response:
        body, params = await self._parse(request, api.CompletionRequest)
        try:
            prompt = body.single_prompt()
        except api.ProtocolError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        if isinstance(prompt, str):
            self._need_tokenizer()                     # 400 without a tokenizer.json
            prompt_ids = await asyncio.to_thread(self._encode, lambda: prompt, "prompt", True)
        else:
            prompt_ids = prompt
        handle = await self._submit(prompt_ids, params, "prompt")
        rid, created, n_prompt = api.new_id("cmpl"), int(time.time()), len(prompt_ids)
        if not body.stream:
            text, ids, reason = await self._collect(request, handle)
            return JSONResponse(api.text_completion(rid, self.model_name, created, text, reason,
                                                    api.usage(n_prompt, len(ids))))

        def chunk(text, reason=None):
            return api.text_completion(rid, self.model_name, created, text, reason)

        def usage_chunk(n):
            return api.text_completion(rid, self.model_name, created, "", None, api.usage(n_prompt, n),
                                       with_choice=False)
        return self._stream(request, handle, [], chunk, lambda reason: chunk("", reason),
                            usage_chunk if body.include_usage else None)

    # ---- operations --------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self.monitor.prometheus(), media_type="text/plain; version=0.0.4")

    # ---- the dashboard -----------------------------------------------------------------------
    async def dashboard_page(self, request: Request) -> Response:
        return FileResponse(DASHBOARD_DIR / "index.html", media_type="text/html")

    async def dashboard_file(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in DASHBOARD_FILES:
            raise HTTPException(404, f"no dashboard file {name!r}")
        return FileResponse(DASHBOARD_DIR / name, media_type=DASHBOARD_FILES[name])

    async def dashboard_events(self, request: Request) -> Response:
        """A snapshot every SAMPLE_EVERY_S as SSE, for as long as the page stays open."""
        async def events():
            while True:
                yield sse(self.monitor.snapshot())
                await asyncio.sleep(SAMPLE_EVERY_S)
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(llm, model_name: str, **limits):
    """The ASGI app; limits: OpenAIServer's max_body_bytes and max_tokens."""
    return OpenAIServer(llm, model_name, **limits).app


class ServerThread:
    """uvicorn in a background thread (tests, notebooks, benchmarks). port=0 picks a free port.

        with ServerThread(llm, "tiny") as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, llm, model_name: str, host: str = "127.0.0.1", port: int = 0, **limits):
        import uvicorn
        config = uvicorn.Config(create_app(llm, model_name, **limits), host=host, port=port, log_level="warning",
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
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="the most tokens one request may ask for (default: the context)")
    ap.add_argument("--max-body-mib", type=float, default=MAX_BODY_BYTES / 2**20,
                    help="the largest request body accepted (413 beyond)")
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
    from engine.runtime.engine_process import EngineProcessError, RemoteLLM
    from engine.runtime.llm import LLM
    if (args.max_tokens is not None and args.max_tokens < 1) or not args.max_body_mib > 0:
        print("error: --max-tokens and --max-body-mib must be positive", file=sys.stderr)
        return 2
    try:
        if args.model is None:
            from engine.model.default_model import ensure_default_model
            model_dir = ensure_default_model()
        else:
            model_dir = Path(args.model)
        options = {"kv_cache_mib": args.kv_cache_mib, "max_seqs": args.max_seqs, "max_context": args.max_context}
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
        app = create_app(llm, name, max_tokens=args.max_tokens, max_body_bytes=int(args.max_body_mib * 2**20))
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
