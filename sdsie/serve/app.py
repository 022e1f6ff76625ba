"""The ASGI app (FastAPI) and its uvicorn runner.

    POST /v1/completions        POST /v1/chat/completions     (stream: server-sent events, data: [DONE] last)
    GET  /v1/models             GET  /health                  GET /metrics (Prometheus text)

Requests are parsed by sdsie.serve.protocol, queued on the engine (an EngineProcess, whose decode runs in a child
process, or an in-process Engine) and answered as it emits. A
streaming client that disconnects cancels its job (the generation ends at the next cycle); a waiting
non-streaming client is polled for a disconnect every DISCONNECT_POLL_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sdsie.serve import protocol
from sdsie.serve.protocol import APIError, GenerationRequest
from sdsie.serve.worker import Delta, Done, Event, Failed, Front, Job

__all__ = ["create_app", "run_server"]

DISCONNECT_POLL_S = 0.1


class _Channel:
    """Events from the engine's thread into the request's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed (server shutdown): nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def create_app(engine: Front) -> FastAPI:
    """The app over an Engine or EngineProcess; the app's lifespan starts it (unless it runs already) and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if not engine.running:
            engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="sdsie", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, err: APIError) -> JSONResponse:
        if err.status == 400:
            engine.metrics.count("bad_request")
        elif err.status == 401:
            engine.metrics.count("unauthorized")
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        body = APIError(err.status_code, str(err.detail), type="invalid_request_error").body()
        return JSONResponse(body, status_code=err.status_code, headers=getattr(err, "headers", None))

    def authorize(request: Request) -> None:
        key = engine.config.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> JSONResponse:
        failure = engine.failure
        if failure is not None:
            return JSONResponse({"status": "error", "error": failure, "model": engine.limits.model}, status_code=503)
        return JSONResponse({"status": "ok", "model": engine.limits.model, "busy": engine.busy,
                             "queued": engine.queued})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics.render(engine.queued, engine.busy),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        c = engine.config
        served = {"int4": c.int4, "norms_fused": c.int4 is not None and c.fuse_norms, "compile": c.compile,
                  "compile_prefill": c.compile_prefill, "prefill_graphs": c.prefill_graphs, "gear": list(c.gear),
                  "scout": c.scout is not None}
        return {"object": "list", "data": [{"id": engine.limits.model, "object": "model", "created": started,
                                            "owned_by": "sdsie", "max_model_len": engine.limits.context,
                                            "sdsie": served}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        req = protocol.parse_completion(await _json(request), engine.limits, engine.tokenizer)
        return await _answer(engine, request, req)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(request)
        req = protocol.parse_chat(await _json(request), engine.limits, engine.render_chat)
        return await _answer(engine, request, req)

    return app


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None


async def _answer(engine: Front, request: Request, req: GenerationRequest) -> Response:
    channel = _Channel()
    job = Job(req, channel.emit)
    engine.submit(job)  # APIError 503 when the queue is full, before any byte of the answer
    if req.stream:
        return StreamingResponse(_stream(engine, job, channel), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(engine, request, job, channel)


async def _whole(engine: Front, request: Request, job: Job, channel: _Channel) -> Response:
    pieces: list[str] = []
    getter: asyncio.Future[Event] | None = None
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            getter = getter or asyncio.ensure_future(channel.queue.get())
            done, _ = await asyncio.wait({getter}, timeout=max(0.0, check_at - loop.time()))
            if loop.time() >= check_at:  # on a clock, not on a quiet queue: a run emits every cycle
                if await request.is_disconnected():
                    job.cancel()
                    return Response(status_code=499)  # nobody reads it
                check_at = loop.time() + DISCONNECT_POLL_S
            if not done:
                continue
            event, getter = getter.result(), None
            if isinstance(event, Delta):
                pieces.append(event.text)
            elif isinstance(event, Failed):
                return JSONResponse(APIError(500, event.message, type="server_error").body(), status_code=500)
            elif isinstance(event, Done):
                body = protocol.completion_body(job.request, engine.limits.model, "".join(pieces) + event.text,
                                                event.finish_reason, event.usage, event.token_ids)
                return JSONResponse(body)
    finally:
        if getter is not None:
            getter.cancel()


async def _stream(engine: Front, job: Job, channel: _Channel) -> AsyncIterator[str]:
    req, model = job.request, engine.limits.model
    finished = False
    try:
        if req.chat:
            yield _sse(protocol.chunk_body(req, model, "", first=True))
        pending: Event | None = None
        while True:
            event, pending = pending or await channel.queue.get(), None
            if isinstance(event, Delta):
                # the deltas already waiting go out as one chunk: when the client or the loop falls behind the
                # engine, the loop's work per cycle (and its hold on the GIL the engine's thread needs) stays bounded
                text = event.text
                while pending is None and not channel.queue.empty():
                    nxt = channel.queue.get_nowait()
                    if isinstance(nxt, Delta):
                        text += nxt.text
                    else:
                        pending = nxt
                if text:
                    yield _sse(protocol.chunk_body(req, model, text))
            elif isinstance(event, Failed):
                finished = True
                yield _sse(APIError(500, event.message, type="server_error").body())
                yield "data: [DONE]\n\n"
                return
            elif isinstance(event, Done):
                finished = True
                if event.text:
                    yield _sse(protocol.chunk_body(req, model, event.text))
                yield _sse(protocol.chunk_body(req, model, None if req.chat else "", event.finish_reason))
                if req.include_usage:
                    yield _sse(protocol.usage_chunk(req, model, event.usage))
                yield "data: [DONE]\n\n"
                return
    finally:
        if not finished:  # the client went away (the response task was cancelled): stop at the next cycle
            job.cancel()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def run_server(engine: Front, sock: socket.socket | None = None, log_level: str = "info") -> None:
    """Serve until interrupted, on engine.config's host and port (or on an already bound `sock`)."""
    import uvicorn

    config = uvicorn.Config(create_app(engine), host=engine.config.host, port=engine.config.port,
                            log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run(sockets=[sock] if sock is not None else None)
