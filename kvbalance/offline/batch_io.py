"""OpenAI Batch API files: read an input file into requests or error records, build the output lines.

An input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` ``/v1/completions`` or
``/v1/chat/completions``. Every non-blank input line becomes exactly one of:

- :class:`BatchRequest`: a valid request, to be generated (its output line carries the same JSON the
  HTTP endpoint would answer, in ``response.body``);
- :class:`BatchRefusal`: a request the API would refuse (unknown url, bad sampling field, prompt too long
  for the model), answered with ``response.status_code`` 400 (404 for a model not served) and an
  OpenAI-shaped error body;
- :class:`BatchLineError`: a line that is not JSON or lacks the envelope fields; its output line has
  ``response: null`` and an ``error`` object.

Unlike vLLM's ``run_batch``, a bad line never stops the job. Blank lines carry no request and are
counted (``BatchInput.num_blank_lines``), not answered.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)
MAX_LOGPROBS = 20


# -- input schema ----------------------------------------------------------------------------------
class BatchEnvelope(BaseModel):
    """One input line's envelope (the OpenAI Batch API's request object)."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: str
    body: dict


class _SamplingBody(BaseModel):
    """Fields shared by completions and chat bodies; an unknown field is refused, never ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 or 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: Literal[1] = 1
    stream: Literal[False] = False  # a batch answers whole responses
    presence_penalty: Literal[0.0] = 0.0
    frequency_penalty: Literal[0.0] = 0.0
    user: str | None = None

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionBody(_SamplingBody):
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a batch of one
        if isinstance(v, list) and any(isinstance(t, bool) or not isinstance(t, int) for t in v):
            raise ValueError("must be a string or a list of token ids (one prompt per request)")
        if not v:
            raise ValueError("must not be empty")
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)


class ChatBody(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _text_only(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        for i, m in enumerate(v):
            try:
                m.text()
            except ValueError as e:
                raise ValueError(f"[{i}].content: {e}") from None
        return v

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# -- parsed lines ---------------------------------------------------------------------------------
def record_ids(index: int, custom_id: str | None) -> str:
    """A stable hex id for input line ``index`` (the same on every run, so outputs compare and resume)."""
    return hashlib.sha256(f"{index}\0{custom_id}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class BatchRequest:
    index: int  # 0-based position among the input's non-blank lines (the output line it fills)
    line_no: int  # 1-based line number in the file, for messages
    custom_id: str
    url: str
    body: CompletionBody | ChatBody


@dataclass(frozen=True)
class BatchRefusal:
    index: int
    line_no: int
    custom_id: str
    status_code: int
    message: str  # starts with the field: ``max_tokens: must be >= 1, got 0``
    param: str | None = None


@dataclass(frozen=True)
class BatchLineError:
    index: int
    line_no: int
    custom_id: str | None
    code: str  # "invalid_json" | "invalid_request" | "duplicate_custom_id"
    message: str


BatchItem = BatchRequest | BatchRefusal | BatchLineError


@dataclass
class BatchInput:
    path: str
    sha256: str
    items: list[BatchItem] = field(default_factory=list)
    num_blank_lines: int = 0

    @property
    def requests(self) -> list[BatchRequest]:
        return [it for it in self.items if isinstance(it, BatchRequest)]


def describe(exc: ValidationError, prefix: str = "") -> tuple[str, str]:
    """(field, message) for a pydantic error: ``("max_tokens", "max_tokens: must be >= 1, got 0")``."""
    err = exc.errors()[0]
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.get("loc", ()))
    name = (prefix + loc).lstrip(".") or "body"
    kind, ctx, msg = err.get("type", ""), err.get("ctx") or {}, str(err.get("msg", "invalid"))
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind == "missing":
        text = "is required"
    elif kind == "extra_forbidden":
        text = "is not a known field"
    elif kind in bounds:
        text = f"must be {bounds[kind]} {next(iter(ctx.values()), '?')}, got {err.get('input')!r}"
    elif kind == "literal_error":
        text = f"must be {ctx.get('expected', '?')}, got {err.get('input')!r}"
    elif msg.startswith("Value error, "):
        text = msg[len("Value error, ") :]
    else:
        text = msg[:1].lower() + msg[1:]
    return name, f"{name}: {text}"


def parse_line(index: int, line_no: int, text: str, served_model: str | None = None) -> BatchItem:
    """One input line -> a request, a refusal (400/404) or a line error; never raises."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLineError(index, line_no, None, "invalid_json", f"line {line_no}: not valid JSON ({e})")
    raw_id = obj.get("custom_id") if isinstance(obj, dict) else None
    custom_id = raw_id if isinstance(raw_id, str) and raw_id else None
    if not isinstance(obj, dict):
        msg = f"line {line_no}: must be a JSON object, got {type(obj).__name__}"
        return BatchLineError(index, line_no, None, "invalid_request", msg)
    try:
        env = BatchEnvelope.model_validate(obj)
    except ValidationError as e:
        return BatchLineError(
            index, line_no, custom_id, "invalid_request", f"line {line_no}: {describe(e)[1]}"
        )
    if env.url not in URLS:
        msg = f"url: must be {' or '.join(URLS)}, got {env.url!r}"
        return BatchRefusal(index, line_no, env.custom_id, 400, msg, "url")
    model_cls = ChatBody if env.url == CHAT_URL else CompletionBody
    try:
        body = model_cls.model_validate(env.body)
    except ValidationError as e:
        param, msg = describe(e)
        return BatchRefusal(index, line_no, env.custom_id, 400, msg, param)
    if served_model is not None and body.model is not None and body.model != served_model:
        msg = f"model: {body.model!r} is not served here (this run serves {served_model!r})"
        return BatchRefusal(index, line_no, env.custom_id, 404, msg, "model")
    return BatchRequest(index, line_no, env.custom_id, env.url, body)


def read_batch_input(path: str | Path, served_model: str | None = None) -> BatchInput:
    """Parse a Batch API input file; a repeated ``custom_id`` makes the later line an error record."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input: {p} is not a file")
    data = p.read_bytes()
    out = BatchInput(str(p), hashlib.sha256(data).hexdigest())
    first_line: dict[str, int] = {}
    for line_no, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not raw.strip():
            out.num_blank_lines += 1
            continue
        item = parse_line(len(out.items), line_no, raw, served_model)
        cid = item.custom_id
        if cid is not None and not isinstance(item, BatchLineError):
            if cid in first_line:
                msg = f"line {line_no}: custom_id: {cid!r} is already used by line {first_line[cid]}"
                item = BatchLineError(item.index, line_no, cid, "duplicate_custom_id", msg)
            else:
                first_line[cid] = line_no
        out.items.append(item)
    return out


# -- output lines -------------------------------------------------------------------------------------
def error_body(status_code: int, message: str, param: str | None) -> dict:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status_code, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}


def output_line(index: int, custom_id: str | None, status_code: int | None, body: dict | None, error=None):
    """A Batch API output object: ``id``, ``custom_id``, ``response`` {status_code, request_id, body}, ``error``."""
    h = record_ids(index, custom_id)
    response = None
    if status_code is not None:
        response = {"status_code": status_code, "request_id": f"req_{h}", "body": body}
    return {"id": f"batch_req_{h}", "custom_id": custom_id, "response": response, "error": error}


def refusal_record(item: BatchRefusal) -> dict:
    body = error_body(item.status_code, item.message, item.param)
    return output_line(item.index, item.custom_id, item.status_code, body)


def line_error_record(item: BatchLineError) -> dict:
    return output_line(item.index, item.custom_id, None, None, {"code": item.code, "message": item.message})
