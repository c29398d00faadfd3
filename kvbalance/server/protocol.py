"""Request bodies of the OpenAI-compatible API, validated strictly, and OpenAI-shaped errors.

Bodies are pydantic models in strict mode with unknown fields forbidden: ``"3"`` is not a number,
``"true"`` not a boolean, ``Infinity`` not a temperature, and a field we do not implement is a 400 that
names it, never silently ignored. A lone surrogate (``"\\ud800"``) anywhere in a body is a 400 naming its
field. Cross-field and model-dependent checks raise :class:`BadField` from ``check`` in the routes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvbalance.request import SamplingParams

MAX_LOGPROBS = 20
MAX_N = 16  # choices per prompt
SAMPLING_EPS = 1e-5  # temperatures below this are greedy, as in vLLM (logits / 1e-40 overflow to NaN)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
MAX_STOP = 64  # stop strings are matched on the engine thread every step
MAX_MESSAGES = 2048  # OpenAI's limit on a chat's messages ("maximum length of 2048 items")
MAX_CONTENT_PARTS = 2048  # text parts of one message (ours: each part costs a model object while parsing)
LONE_SURROGATE = "lone_surrogate"


class BadField(ValueError):
    """A request that is well-formed JSON but asks for something wrong: HTTP 400 naming ``field``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


def _find_lone_surrogate(value: Any, path: str) -> str | None:
    """The dotted path of the first string (or key) that is not valid Unicode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if (bad := _find_lone_surrogate(k, sub)) or (bad := _find_lone_surrogate(v, sub)):
                return bad
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if bad := _find_lone_surrogate(v, f"{path}.{i}" if path else str(i)):
                return bad
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingBody(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=INT32_MAX)  # -1 or 0: off; above the vocabulary: all tokens
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Any = Field(None, json_schema_extra={"anyOf": [{"type": "string"}, {"type": "array"}]})
    stop_token_ids: list[int] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
            return data  # refused by the length check at once: not worth a walk over every message
        if (path := _find_lone_surrogate(data, "")) is not None:
            field = path.encode("utf-8", "backslashreplace").decode("utf-8")  # the path may hold one too
            raise PydanticCustomError(
                LONE_SURROGATE, "contains a lone surrogate (not valid Unicode)", {"field": field}
            )
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(v)}")
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError("must be a string or a list of strings")

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict | None) -> dict | None:
        if v is not None and v != {"type": "text"}:
            raise ValueError("only {'type': 'text'} is supported (no JSON mode or schemas)")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list | None) -> list | None:
        if v:
            raise ValueError("tool calling is not supported")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        if v not in (None, "none"):
            raise ValueError("tool calling is not supported (only 'none')")
        return v

    @property
    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stop if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check(self, vocab_size: int) -> None:
        """Checks that need the model or several fields; raises BadField."""
        if self.stream_options is not None and not self.stream:
            raise BadField("stream_options", "only allowed with stream: true")
        for key in self.logit_bias or {}:
            if int(key) >= vocab_size:
                raise BadField(
                    "logit_bias", f"token id {key} is outside the vocabulary (0..{vocab_size - 1})"
                )
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise BadField(
                    "stop_token_ids", f"token id {t} is outside the vocabulary (0..{vocab_size - 1})"
                )

    def sampling(self, max_tokens: int, logprobs: int | None, choice: int = 0) -> SamplingParams:
        """Engine parameters for choice ``choice`` of ``n`` (seeded choices use ``seed + choice``)."""
        greedy = self.temperature < SAMPLING_EPS
        seed = None if self.seed is None else (self.seed + choice - INT64_MIN) % (1 << 64) + INT64_MIN
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if greedy else self.temperature,
            top_k=0 if greedy else max(self.top_k, 0),
            top_p=1.0 if greedy else self.top_p,
            seed=seed,
            stop=self.stop_strings,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
        )


Prompt = str | list[int]


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


class CompletionRequest(_SamplingBody):
    prompt: Any = Field(json_schema_extra={"anyOf": [{"type": "string"}, {"type": "array"}]})
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        items = v if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]
        for i, p in enumerate(items):
            where = f"prompt {i} " if len(items) > 1 else ""
            if not isinstance(p, (str, list)) or (isinstance(p, list) and not all(_is_id(t) for t in p)):
                raise ValueError(
                    f"{where}must be a string or a list of token ids (or a list of several such prompts)"
                )
            if not p:
                raise ValueError(f"{where}must not be empty")
        return v

    @property
    def prompts(self) -> list[Prompt]:
        """The prompts of the batch (a single prompt is a batch of one)."""
        v = self.prompt
        return list(v) if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]

    def check(self, vocab_size: int) -> None:
        super().check(vocab_size)
        if self.best_of is not None and self.best_of != self.n:
            raise BadField("best_of", f"must equal n ({self.n}): ranking extra samples is not supported")
        if self.suffix:
            raise BadField("suffix", "not supported (no fill-in-the-middle)")
        if self.echo and self.logprobs is not None:
            raise BadField("echo", "with logprobs is not supported (prompt logprobs are not computed)")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Any = Field(None, json_schema_extra={"anyOf": [{"type": "string"}, {"type": "array"}]})
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of text parts")
        if len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts, got {len(v)}")
        parts = []
        for p in v:  # [{"type": "text", "text": ...}, ...]
            if (
                not isinstance(p, dict)
                or set(p) != {"type", "text"}
                or p["type"] != "text"
                or not isinstance(p["text"], str)
            ):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(p["text"])
        return "".join(parts)

    def as_template_input(self) -> dict[str, str]:
        msg = {"role": self.role, "content": self.content}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check(self, vocab_size: int) -> None:
        super().check(vocab_size)
        if self.top_logprobs is not None and not self.logprobs:
            raise BadField("top_logprobs", "requires logprobs: true")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
