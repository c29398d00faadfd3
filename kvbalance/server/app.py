"""The FastAPI app: routes, the guard in front of them (API key, body size) and error handlers.

``create_app(engine)`` builds the OpenAI-compatible API over an ``LLMEngine`` (wrapped in an
``AsyncEngine``) or an ``AsyncEngine``. Every error is OpenAI-shaped JSON (``errors.py``); a body over
``max_body_bytes`` is a 413 before it is read; with ``api_key`` every path but ``/health`` needs
``Authorization: Bearer <key>`` (401 otherwise); a full queue is a 429 with ``Retry-After``; a client that
disconnects has its requests aborted and their KV blocks freed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvbalance.server.async_engine import AsyncEngine
from kvbalance.server.errors import SafeJSONResponse, describe, error_response, field_of
from kvbalance.server.metrics import CONTENT_TYPE
from kvbalance.server.protocol import ChatRequest, CompletionRequest
from kvbalance.server.routes import OpenAIRoutes

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt that fits a context, far below trouble


class Guard:
    """ASGI middleware: API key check and body-size cap, answering 401 / 413 without touching the app.

    The body is read here (up to the cap) and replayed to the app; later ``receive`` calls go to the
    client again, so the app still sees a disconnect.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"] != "/health":
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                msg = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                auth = {"WWW-Authenticate": "Bearer"}
                await error_response(401, msg, "authorization", headers=auth)(scope, receive, send)
                return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while scope["method"] in ("POST", "PUT", "PATCH"):
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        msg = f"body: larger than this server takes ({self.max_body_bytes} bytes; see --max-body-bytes)"
        await error_response(413, msg, "body")(scope, receive, send)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        field = field_of(first)
        return error_response(400, f"{field}: {describe(first)}", field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        status = exc.status_code
        param = "body" if status == 400 else None
        message = f"body: {exc.detail}" if param else str(exc.detail)
        return error_response(status, message, param, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal server error ({type(exc).__name__})")


def create_app(
    engine,
    model_name: str | None = None,
    max_queue: int = 256,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_prompt_chars: int | None = None,
) -> FastAPI:
    """FastAPI app over ``engine`` (an ``LLMEngine``, wrapped here, or an ``AsyncEngine``)."""
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: must be an int >= 1, got {max_body_bytes!r}")
    if api_key is not None and not api_key:
        raise ValueError("api_key: must not be empty (leave it out to serve without a key)")
    owns = not isinstance(engine, AsyncEngine)
    aengine = AsyncEngine(engine, max_queue=max_queue, max_prompt_chars=max_prompt_chars) if owns else engine
    served_name = model_name or aengine.model_name
    created = int(time.time())
    routes = OpenAIRoutes(aengine, served_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            if owns:
                await asyncio.to_thread(aengine.shutdown)

    app = FastAPI(
        title="kvbalance", version="0.1.0", lifespan=lifespan, default_response_class=SafeJSONResponse
    )
    app.state.engine = aengine
    app.state.model_name = served_name
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not aengine.is_running:
            return error_response(503, "engine loop is not running")
        return SafeJSONResponse({"status": "ok", "in_flight": aengine.num_in_flight})

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": served_name,
            "object": "model",
            "created": created,
            "owned_by": "kvbalance",
            "max_model_len": aengine.max_context,
            "vocab_size": aengine.vocab_size,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(aengine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions", responses={400: {"description": "bad request"}})
    async def completions(body: CompletionRequest, http: Request):
        return await routes.completions(body, http)

    @app.post("/v1/chat/completions", responses={400: {"description": "bad request"}})
    async def chat_completions(body: ChatRequest, http: Request):
        return await routes.chat(body, http)

    return app
