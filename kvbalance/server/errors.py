"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every failure.

4xx carry the client's fault (``invalid_request_error``, ``authentication_error``, ``not_found_error``,
``rate_limit_error``), 5xx are ``server_error``; messages start with the field they are about
(``max_tokens: must be >= 1``) and ``param`` names it. JSON is written ASCII-safe, so no input can turn an
error into a plain-text 500.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from kvbalance.server.protocol import LONE_SURROGATE

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes (``\\uXXXX`` escapes for anything outside ASCII, NaN kept as JSON NaN)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind or error_type(status), "param": param, "code": status}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    kind: str | None = None,
    headers: dict[str, str] | None = None,
) -> SafeJSONResponse:
    return SafeJSONResponse(error_body(status, message, param, kind), status_code=status, headers=headers)


def field_of(err: dict) -> str:
    """The dotted field a pydantic error is about (``messages.0.role``), ``body`` for the whole body."""
    if err.get("type") == LONE_SURROGATE:
        return (err.get("ctx") or {}).get("field") or "body"
    if err.get("type") == "json_invalid":
        return "body"
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    return ".".join(loc) or "body"


def describe(err: dict) -> str:
    """A pydantic error as a short lower-case phrase (``must be >= 1, got 0``)."""
    kind, ctx, msg = err.get("type", ""), err.get("ctx") or {}, str(err.get("msg", "invalid"))
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind == "missing":
        return "is required"
    if kind == "json_invalid":
        where = [p for p in err.get("loc", ()) if isinstance(p, int)]
        at = f" at byte {where[0]}" if where else ""
        return f"invalid JSON{at} ({ctx.get('error', msg)})"
    if kind == "extra_forbidden":
        return "unknown field (not supported by this server)"
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        text = f"must be {bounds[kind]} {limit}"
        return f"{text}, got {err['input']!r}" if "input" in err else text
    if kind == "too_short" and "min_length" in ctx:
        return f"must have at least {ctx['min_length']} item(s)"
    if kind == "too_long" and "max_length" in ctx:
        return f"must have at most {ctx['max_length']} item(s)"
    if kind.endswith("_type") and "input" in err:
        return f"{msg[:1].lower() + msg[1:]}, got {type(err['input']).__name__}"
    if msg.startswith("Value error, "):
        return msg[len("Value error, ") :]
    return msg[:1].lower() + msg[1:]


def param_of(message: str, default: str) -> str:
    """The field a ``field: message`` string names, else ``default``."""
    head, sep, _ = message.partition(":")
    plain = head.replace("_", "").replace(".", "").replace("[", "").replace("]", "")
    return head if sep and plain.isalnum() else default


def in_band_error(exc: BaseException) -> dict:
    """An error event for a stream whose status line has gone out already."""
    from kvbalance.server.streams import EngineStopped

    status = 503 if isinstance(exc, EngineStopped) else 500
    return error_body(status, str(exc) or type(exc).__name__)
