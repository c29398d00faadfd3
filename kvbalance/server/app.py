"""OpenAI-compatible HTTP API over the real engine: completions, chat, SSE streaming, health and metrics.

``create_app(engine)`` builds a FastAPI app over an ``LLMEngine`` (wrapped in an ``AsyncEngine``) or an
``AsyncEngine``; ``serve(model, host, port)`` runs it with uvicorn. Malformed bodies get HTTP 400 with an
OpenAI-style error whose message starts with the field (``max_tokens: must be >= 1``); a full queue gets
429; a client that disconnects mid-request has its request aborted and its KV blocks freed.
Extensions over OpenAI: ``top_k``, ``ignore_eos``, ``stop_token_ids`` in requests; ``token_ids`` (the new
output token ids) in every completion choice, so token-id prompts work for models without a tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvbalance.request import SamplingParams
from kvbalance.server.async_engine import (
    AsyncEngine,
    EngineStopped,
    Overloaded,
    Rejected,
    RequestStream,
    StreamOutput,
)
from kvbalance.server.metrics import CONTENT_TYPE

DISCONNECT_POLL_S = 0.25  # how often a request in flight checks that its client is still there
MAX_LOGPROBS = 20


# -- request bodies ----------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingBody(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 or 0: off
    seed: int | None = None
    stop: Any = Field(None, validate_default=True)
    stop_token_ids: list[int] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _n_is_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"must be 1 (one choice per request), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: Any) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v] if v else []
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return [s for s in v if s]
        raise ValueError("must be a string or a list of strings")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("not supported (must be 0)")
        return v

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            seed=self.seed,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class CompletionRequest(_SamplingBody):
    prompt: Any
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a batch of one
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return v
        if isinstance(v, list):
            if not v:
                raise ValueError("must not be empty")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                return v
        raise ValueError(
            "must be a string or a list of token ids (batches of several prompts are not supported)"
        )

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("not supported")
        return v


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Any = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, str):
            return v
        if isinstance(v, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for p in v:
                if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                    raise ValueError("only text content parts are supported")
                parts.append(p["text"])
            return "".join(parts)
        raise ValueError("must be a string or a list of text parts")


class ChatRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


# -- errors ----------------------------------------------------------------------------------
def error_response(
    status: int, message: str, param: str | None = None, kind: str | None = None
) -> JSONResponse:
    kind = kind or {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "server_error"
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _describe(err: dict) -> str:
    kind, ctx, msg = err.get("type", ""), err.get("ctx") or {}, str(err.get("msg", "invalid"))
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind == "missing":
        return "is required"
    if kind == "json_invalid":
        return f"invalid JSON ({ctx.get('error', msg)})"
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        text = f"must be {bounds[kind]} {limit}"
        return f"{text}, got {err['input']!r}" if "input" in err else text
    if kind == "too_short" and "min_length" in ctx:
        return f"must have at least {ctx['min_length']} item(s)"
    if msg.startswith("Value error, "):
        return msg[len("Value error, ") :]
    return msg[:1].lower() + msg[1:]


def field_of(err: dict) -> str:
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    return ".".join(loc) or "body"


def _param_of(message: str, default: str) -> str:
    head, sep, _ = message.partition(":")
    return (
        head
        if sep and head.replace("_", "").replace(".", "").replace("[", "").replace("]", "").isalnum()
        else default
    )


# -- responses ---------------------------------------------------------------------------------
def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _usage(num_prompt: int, num_output: int) -> dict:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
    }


class _TokenText:
    """Token id -> display string for logprobs (``token_id:N`` when the model has no tokenizer)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def _completion_logprobs(lps: list, to_text: _TokenText, text_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s = to_text(lp.token_id)
        tokens.append(s)
        token_lps.append(lp.logprob)
        tops.append({to_text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs)})
        offsets.append(text_offset)
        text_offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(lps: list, to_text: _TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        s = to_text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    content = []
    for lp in lps:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append(item)
    return {"content": content}


async def _next_output(stream: RequestStream, http: Request, last_check: list[float]) -> StreamOutput | None:
    """The stream's next output, or None once the client has gone away (checked every DISCONNECT_POLL_S)."""
    while True:
        out = await stream.next(timeout=DISCONNECT_POLL_S)
        now = time.monotonic()
        if out is None or now - last_check[0] >= DISCONNECT_POLL_S:
            last_check[0] = now
            if await http.is_disconnected():
                return None
        if out is not None:
            return out


# -- the app -------------------------------------------------------------------------------------


def _sse_response(
    stream,
    http: Request,
    chunk: Callable[[StreamOutput], dict],
    usage_chunk: Callable[[int], dict] | None,
    prelude: Sequence[dict] = (),
) -> StreamingResponse:
    """Server-sent events for one request: ``prelude``, a chunk per output, the usage chunk, ``[DONE]``.

    A client that goes away ends the stream and its request is aborted (KV blocks freed); an engine failure
    mid-stream is reported in-band, since the status line has gone out already.
    """

    async def events() -> AsyncIterator[str]:
        last, n_out = [time.monotonic()], 0
        try:
            for obj in prelude:
                yield _sse(obj)
            while True:
                try:
                    out = await _next_output(stream, http, last)
                except StopAsyncIteration:
                    break
                if out is None:
                    return  # client gone: finally aborts
                n_out = out.num_output_tokens or n_out
                yield _sse(chunk(out))
                if out.finished:
                    break
            if usage_chunk is not None:
                yield _sse(usage_chunk(n_out))
            yield "data: [DONE]\n\n"
        except Exception as exc:
            yield _sse({"error": {"message": str(exc), "type": "server_error", "code": 500}})
        finally:
            stream.abort()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(engine, model_name: str | None = None, max_queue: int = 256) -> FastAPI:
    """FastAPI app over ``engine`` (an ``LLMEngine``, wrapped here, or an ``AsyncEngine``)."""
    owns = not isinstance(engine, AsyncEngine)
    aengine = AsyncEngine(engine, max_queue=max_queue) if owns else engine
    served_name = model_name or aengine.model_name
    created = int(time.time())
    to_text = _TokenText(aengine.tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.start()
        try:
            yield
        finally:
            if owns:
                await asyncio.to_thread(aengine.shutdown)

    app = FastAPI(title="kvbalance", version="0.1.0", lifespan=lifespan)
    app.state.engine = aengine
    app.state.model_name = served_name

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        field = field_of(first)
        return error_response(400, f"{field}: {_describe(first)}", field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    def check_model(name: str | None) -> JSONResponse | None:
        if name is not None and name not in (served_name, aengine.model_name):
            return error_response(404, f"model: {name!r} is not served here (try {served_name!r})", "model")
        return None

    async def start(prompt, params: SamplingParams | None, param: str, *, fill: bool = False):
        """Submit, mapping engine refusals to HTTP errors. Returns (stream, None) or (None, error response)."""
        rid = f"{'chatcmpl' if param == 'messages' else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            return await aengine.submit(prompt, params, rid, fill_max_tokens=fill), None
        except Overloaded as exc:
            return None, error_response(429, str(exc))
        except Rejected as exc:
            return None, error_response(400, f"{param}: {exc.reason}", param)
        except EngineStopped as exc:
            return None, error_response(503, str(exc), kind="server_error")
        except ValueError as exc:
            msg = str(exc)
            return None, error_response(400, msg, _param_of(msg, param))

    # -- routes --------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        if not aengine.is_running:
            return error_response(503, "engine loop is not running", kind="server_error")
        return JSONResponse({"status": "ok", "in_flight": aengine.num_in_flight})

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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        if (bad := check_model(body.model)) is not None:
            return bad
        try:
            params = body.sampling(body.max_tokens, body.logprobs)
        except ValueError as exc:
            return error_response(400, str(exc), _param_of(str(exc), "body"))
        stream, err = await start(body.prompt, params, "prompt")
        if err is not None:
            return err
        rid = stream.request_id
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def choice(text: str, out: StreamOutput, text_offset: int) -> dict:
            lp = (
                _completion_logprobs(out.logprobs, to_text, text_offset)
                if body.logprobs is not None
                else None
            )
            return {
                "index": 0,
                "text": text,
                "logprobs": lp,
                "finish_reason": out.finish_reason if out.finished else None,
                "token_ids": out.new_token_ids,
            }

        def envelope(choices: list, usage: dict | None = None) -> dict:
            obj = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": served_name}
            obj["choices"] = choices
            if usage is not None or include_usage:
                obj["usage"] = usage
            return obj

        if body.stream:
            offset = [0]

            def chunk(out: StreamOutput) -> dict:
                obj = envelope([choice(out.text_delta, out, offset[0])])
                offset[0] += len(out.text_delta)
                return obj

            def usage_chunk(n_out: int) -> dict:
                return envelope([], _usage(len(stream.prompt_token_ids), n_out))

            return _sse_response(stream, http, chunk, usage_chunk if include_usage else None)

        outs = await _collect(stream, http)
        if outs is None:
            return Response(status_code=499)
        merged = _merge(outs)
        res = envelope(
            [choice(merged.text_delta, merged, 0)],
            _usage(len(stream.prompt_token_ids), merged.num_output_tokens),
        )
        return res

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: Request):
        if (bad := check_model(body.model)) is not None:
            return bad
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        try:
            params = body.sampling(max_tokens or 1, logprobs)
        except ValueError as exc:
            return error_response(400, str(exc), _param_of(str(exc), "body"))
        messages = [m.model_dump() for m in body.messages]
        stream, err = await start(messages, params, "messages", fill=max_tokens is None)
        if err is not None:
            return err
        rid = stream.request_id
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def envelope(obj_type: str, choices: list, usage: dict | None = None) -> dict:
            obj = {"id": rid, "object": obj_type, "created": int(time.time()), "model": served_name}
            obj["choices"] = choices
            if usage is not None or (include_usage and obj_type.endswith("chunk")):
                obj["usage"] = usage
            return obj

        if body.stream:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}

            def chunk(out: StreamOutput) -> dict:
                delta = {"content": out.text_delta} if out.text_delta or not out.finished else {}
                c = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": _chat_logprobs(out.logprobs, to_text) if logprobs is not None else None,
                    "finish_reason": out.finish_reason if out.finished else None,
                    "token_ids": out.new_token_ids,
                }
                return envelope("chat.completion.chunk", [c])

            def usage_chunk(n_out: int) -> dict:
                return envelope("chat.completion.chunk", [], _usage(len(stream.prompt_token_ids), n_out))

            prelude = [envelope("chat.completion.chunk", [{**first, "finish_reason": None}])]
            return _sse_response(stream, http, chunk, usage_chunk if include_usage else None, prelude)

        outs = await _collect(stream, http)
        if outs is None:
            return Response(status_code=499)
        merged = _merge(outs)
        c = {
            "index": 0,
            "message": {"role": "assistant", "content": merged.text_delta},
            "logprobs": _chat_logprobs(merged.logprobs, to_text) if logprobs is not None else None,
            "finish_reason": merged.finish_reason,
            "token_ids": merged.new_token_ids,
        }
        return envelope(
            "chat.completion", [c], _usage(len(stream.prompt_token_ids), merged.num_output_tokens)
        )

    return app


async def _collect(stream: RequestStream, http: Request) -> list[StreamOutput] | None:
    """All of a request's outputs (None if the client disconnected first; the request is then aborted)."""
    outs: list[StreamOutput] = []
    last = [time.monotonic()]
    try:
        while True:
            try:
                out = await _next_output(stream, http, last)
            except StopAsyncIteration:
                return outs
            if out is None:
                return None
            outs.append(out)
            if out.finished:
                return outs
    finally:
        stream.abort()


def _merge(outs: list[StreamOutput]) -> StreamOutput:
    last = outs[-1]
    return StreamOutput(
        last.request_id,
        [t for o in outs for t in o.new_token_ids],
        "".join(o.text_delta for o in outs),
        last.finished,
        last.finish_reason,
        last.num_prompt_tokens,
        max(o.num_output_tokens for o in outs),
        [lp for o in outs for lp in o.logprobs],
    )


def serve(
    model: str = "smollm2-135m",
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    max_queue: int = 256,
    served_model_name: str | None = None,
    log_level: str = "info",
    **engine_kwargs,
) -> None:
    """Load ``model`` into an ``LLMEngine`` (``engine_kwargs`` go to it) and serve the API with uvicorn."""
    import uvicorn

    from kvbalance.llm import LLMEngine

    if not 0 <= port <= 65535:
        raise ValueError(f"port: must be in 0..65535, got {port}")
    engine = LLMEngine(model, **engine_kwargs)
    app = create_app(engine, served_model_name or model, max_queue=max_queue)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
