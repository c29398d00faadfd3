"""OpenAI response bodies built from what the engine generated: the JSON ``/v1/completions`` or
``/v1/chat/completions`` would answer, wrapped in a Batch output line (``success_record``).

Ids derive from the input line (``batch_io.record_ids``), so two runs of one job answer with the same ids;
choices carry kvbalance's ``token_ids`` extension as the server's do, and logprobs come from the server's
builder (``llm/logprobs.py``: each token's true bytes, every ``top_logprobs`` alternative kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbalance.llm.logprobs import TokenText, chat_logprobs, completion_logprobs
from kvbalance.offline.batch_io import CHAT_URL, BatchRequest, output_line, record_ids


def usage(num_prompt: int, num_output: int) -> dict:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
    }


@dataclass(frozen=True)
class Generation:
    """What the engine produced for one request, everything a response body needs."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    logprobs: list = field(default_factory=list)  # kvbalance.model.sampling token logprob records


def response_body(req: BatchRequest, gen: Generation, model: str, created: int, to_text: TokenText) -> dict:
    """The JSON ``/v1/completions`` or ``/v1/chat/completions`` would answer for this generation.

    ``to_text`` (the engine tokenizer's ``TokenText``) renders logprob tokens. Choices carry kvbalance's
    ``token_ids`` extension as the server's do.
    """
    h = record_ids(req.index, req.custom_id)
    want_lp = req.body.num_logprobs is not None
    if req.url == CHAT_URL:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": gen.text},
            "logprobs": chat_logprobs(gen.logprobs, to_text) if want_lp else None,
            "finish_reason": gen.finish_reason,
            "token_ids": list(gen.token_ids),
        }
        rid, obj = f"chatcmpl-{h}", "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": gen.text,
            "logprobs": completion_logprobs(gen.logprobs, to_text, 0) if want_lp else None,
            "finish_reason": gen.finish_reason,
            "token_ids": list(gen.token_ids),
        }
        rid, obj = f"cmpl-{h}", "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(gen.num_prompt_tokens, len(gen.token_ids)),
    }


def success_record(req: BatchRequest, gen: Generation, model: str, created: int, to_text: TokenText) -> dict:
    return output_line(req.index, req.custom_id, 200, response_body(req, gen, model, created, to_text))
