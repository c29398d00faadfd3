"""OpenAI response bodies built from what the engine generated: the JSON ``/v1/completions`` or
``/v1/chat/completions`` would answer, wrapped in a Batch output line (``success_record``).

Ids derive from the input line (``batch_io.record_ids``), so two runs of one job answer with the same ids;
choices carry kvbalance's ``token_ids`` extension as the server's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def _completion_logprobs(lps: list, to_text) -> dict:
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for lp in lps:
        s = to_text(lp.token_id)
        tokens.append(s)
        token_lps.append(lp.logprob)
        tops.append({to_text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs)})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(lps: list, to_text) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        s = to_text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    content = []
    for lp in lps:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append(item)
    return {"content": content}


def response_body(req: BatchRequest, gen: Generation, model: str, created: int, to_text) -> dict:
    """The JSON ``/v1/completions`` or ``/v1/chat/completions`` would answer for this generation.

    ``to_text(token_id) -> str`` renders logprob tokens. Choices carry kvbalance's ``token_ids`` extension
    as the server's do.
    """
    h = record_ids(req.index, req.custom_id)
    want_lp = req.body.num_logprobs is not None
    if req.url == CHAT_URL:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": gen.text},
            "logprobs": _chat_logprobs(gen.logprobs, to_text) if want_lp else None,
            "finish_reason": gen.finish_reason,
            "token_ids": list(gen.token_ids),
        }
        rid, obj = f"chatcmpl-{h}", "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": gen.text,
            "logprobs": _completion_logprobs(gen.logprobs, to_text) if want_lp else None,
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


def success_record(req: BatchRequest, gen: Generation, model: str, created: int, to_text) -> dict:
    return output_line(req.index, req.custom_id, 200, response_body(req, gen, model, created, to_text))
