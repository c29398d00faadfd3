"""/v1/completions and /v1/chat/completions: bodies -> engine requests -> OpenAI responses.

A completion request is ``len(prompts) x n`` engine requests (choice ``index = prompt * n + j``; seeded
choices use ``seed + j``), submitted together and aborted together. Extensions over OpenAI: ``top_k``,
``ignore_eos``, ``stop_token_ids`` in requests; ``token_ids`` (the new output token ids) in every choice,
so token-id prompts work for models without a tokenizer.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from kvbalance.request import SamplingParams
from kvbalance.server.async_engine import AsyncEngine
from kvbalance.server.errors import error_response, param_of
from kvbalance.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from kvbalance.server.protocol import BadField, ChatRequest, CompletionRequest, Prompt
from kvbalance.server.streaming import Choices, merge, sse_response
from kvbalance.server.streams import EngineStopped, Overloaded, Rejected, StreamOutput

RETRY_AFTER_S = 1  # what a 429 asks the client to wait


def usage(num_prompt: int, num_output: int) -> dict:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
    }


class OpenAIRoutes:
    """The two generation endpoints over one ``AsyncEngine``, answering as ``served_name``."""

    def __init__(self, aengine: AsyncEngine, served_name: str) -> None:
        self.aengine = aengine
        self.served_name = served_name
        self.to_text = TokenText(aengine.tokenizer)

    # -- shared -----------------------------------------------------------------------------
    def _precheck(self, body: CompletionRequest | ChatRequest) -> Response | None:
        if body.model is not None and body.model != self.served_name:
            msg = f"model: {body.model!r} is not served here (try {self.served_name!r})"
            return error_response(404, msg, "model")
        try:
            body.check(self.aengine.vocab_size)
        except BadField as exc:
            return error_response(400, exc.message, exc.field)
        return None

    async def _start(
        self, prompts: list, params: list[list[SamplingParams]], param: str, http: Request, fill: bool = False
    ) -> tuple[Choices | None, Response | None, list[int], str]:
        """Submit every choice; on any refusal abort those already in and answer the error instead."""
        total = sum(len(p) for p in params)
        if total > self.aengine.max_queue:
            msg = f"n: {len(prompts)} prompt(s) x n = {total} choices, more than max_queue ({self.aengine.max_queue})"
            return None, error_response(400, msg, "n"), [], ""
        base = f"{'chatcmpl' if param == 'messages' else 'cmpl'}-{uuid.uuid4().hex}"
        streams, prompt_lens = [], []
        try:
            for p, (prompt, choice_params) in enumerate(zip(prompts, params)):
                for j, sp in enumerate(choice_params):
                    rid = base if total == 1 else f"{base}-{p}-{j}"
                    stream = await self.aengine.submit(prompt, sp, rid, fill_max_tokens=fill)
                    streams.append(stream)
                    if j == 0:  # the other choices reuse the tokens: tokenise once per prompt
                        prompt = stream.prompt_token_ids
                        prompt_lens.append(len(prompt))
        except (Overloaded, Rejected, EngineStopped, ValueError) as exc:
            for s in streams:
                s.abort()
            return None, self._refusal(exc, param), [], ""
        return Choices(streams, http), None, prompt_lens, base

    @staticmethod
    def _refusal(exc: Exception, param: str) -> Response:
        if isinstance(exc, Overloaded):
            return error_response(429, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})
        if isinstance(exc, Rejected):
            return error_response(400, f"{param}: {exc.reason}", param)
        if isinstance(exc, EngineStopped):
            return error_response(503, str(exc))
        msg = str(exc)
        return error_response(400, msg, param_of(msg, param))

    def _envelope(self, rid: str, obj_type: str, choices: list, use: dict | None, with_usage: bool) -> dict:
        obj = {"id": rid, "object": obj_type, "created": int(time.time()), "model": self.served_name}
        obj["choices"] = choices
        if use is not None or with_usage:
            obj["usage"] = use
        return obj

    # -- /v1/completions ----------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: Request) -> Response | dict:
        if (bad := self._precheck(body)) is not None:
            return bad
        prompts: list[Prompt] = body.prompts
        params = [[body.sampling(body.max_tokens, body.logprobs, j) for j in range(body.n)] for _ in prompts]
        choices, err, prompt_lens, rid = await self._start(prompts, params, "prompt", http)
        if err is not None:
            return err
        echo = [
            self._echo_text(p, s) if body.echo else "" for p, s in zip(prompts, choices.streams[:: body.n])
        ]
        offsets = [0] * len(choices.streams)
        counts = [0] * len(choices.streams)  # output tokens per choice, for the closing usage chunk

        def choice(i: int, out: StreamOutput, text: str) -> dict:
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(out.logprobs, self.to_text, offsets[i])
            offsets[i] += len(text)
            return {
                "index": i,
                "text": text,
                "logprobs": lp,
                "finish_reason": out.finish_reason if out.finished else None,
                "token_ids": out.new_token_ids,
            }

        if body.stream:
            echoed: set[int] = set()

            def chunk(i: int, out: StreamOutput) -> dict:
                counts[i] += len(out.new_token_ids)
                text = out.text_delta
                if i not in echoed:
                    echoed.add(i)
                    text = echo[i // body.n] + text
                return self._envelope(rid, "text_completion", [choice(i, out, text)], None, False)

            def closing() -> list[dict]:
                if not body.include_usage:
                    return []
                return [
                    self._envelope(rid, "text_completion", [], usage(sum(prompt_lens), sum(counts)), True)
                ]

            return sse_response(choices, chunk, closing)

        outs = await _collect(choices)
        if isinstance(outs, Response):
            return outs
        merged = {i: merge(o) for i, o in outs.items()}
        listed = [choice(i, m, echo[i // body.n] + m.text_delta) for i, m in sorted(merged.items())]
        n_out = sum(m.num_output_tokens for m in merged.values())
        return self._envelope(rid, "text_completion", listed, usage(sum(prompt_lens), n_out), False)

    def _echo_text(self, prompt: Prompt, stream) -> str:
        if isinstance(prompt, str):
            return prompt
        tok = self.aengine.tokenizer
        return tok.decode(stream.prompt_token_ids) if tok is not None else ""

    # -- /v1/chat/completions -------------------------------------------------------------------
    async def chat(self, body: ChatRequest, http: Request) -> Response | dict:
        if (bad := self._precheck(body)) is not None:
            return bad
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = [[body.sampling(max_tokens or 1, body.num_logprobs, j) for j in range(body.n)]]
        messages = [m.as_template_input() for m in body.messages]
        choices, err, prompt_lens, rid = await self._start(
            [messages], params, "messages", http, max_tokens is None
        )
        if err is not None:
            return err
        counts = [0] * len(choices.streams)
        want_lp = body.num_logprobs is not None

        if body.stream:
            kind = "chat.completion.chunk"

            def chunk(i: int, out: StreamOutput) -> dict:
                counts[i] += len(out.new_token_ids)
                delta = {"content": out.text_delta} if out.text_delta or not out.finished else {}
                c = {
                    "index": i,
                    "delta": delta,
                    "logprobs": chat_logprobs(out.logprobs, self.to_text) if want_lp else None,
                    "finish_reason": out.finish_reason if out.finished else None,
                    "token_ids": out.new_token_ids,
                }
                return self._envelope(rid, kind, [c], None, body.include_usage)

            def closing() -> list[dict]:
                if not body.include_usage:
                    return []
                return [self._envelope(rid, kind, [], usage(prompt_lens[0], sum(counts)), True)]

            first = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(body.n)
            ]
            prelude = [self._envelope(rid, kind, [c], None, body.include_usage) for c in first]
            return sse_response(choices, chunk, closing, prelude)

        outs = await _collect(choices)
        if isinstance(outs, Response):
            return outs
        listed = []
        for i, o in sorted(outs.items()):
            m = merge(o)
            listed.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": m.text_delta},
                    "logprobs": chat_logprobs(m.logprobs, self.to_text) if want_lp else None,
                    "finish_reason": m.finish_reason,
                    "token_ids": m.new_token_ids,
                }
            )
        n_out = sum(merge(o).num_output_tokens for o in outs.values())
        return self._envelope(rid, "chat.completion", listed, usage(prompt_lens[0], n_out), False)


async def _collect(choices: Choices) -> dict[int, list[StreamOutput]] | Response:
    """Every choice's outputs, or the response to give instead (client gone, shutdown, engine failure)."""
    try:
        outs = await choices.collect()
    except EngineStopped as exc:
        return error_response(503, str(exc))
    except Exception as exc:
        return error_response(500, str(exc) or type(exc).__name__)
    return Response(status_code=499) if outs is None else outs
