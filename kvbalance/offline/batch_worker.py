"""One engine replica for Batch jobs: checks requests against its model and generates them in a given order.

:class:`BatchWorker` wraps a real :class:`~kvbalance.llm.LLMEngine`: ``prepare`` tokenises each request and
refuses what the API would (prompt past the context, bad sampling values) with a 400 record; ``generate``
queues the requests in the order given, so the scheduler's FCFS admission follows the plan, and yields each
step's finished output lines. :class:`LocalBackend` runs one worker in-process; the Ray backend
(``ray_runner.py``) runs one per actor. Both speak the :class:`Backend` protocol the runner drives.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from kvbalance.llm.logprobs import TokenText
from kvbalance.offline.batch_io import (
    BatchRefusal,
    BatchRequest,
    ChatBody,
    error_body,
    output_line,
    refusal_record,
)
from kvbalance.offline.batch_responses import Generation, success_record
from kvbalance.request import Request, RequestState, SamplingParams

Records = list[tuple[int, dict]]  # (input index, output line) pairs


@dataclass(frozen=True)
class EngineSpec:
    """How to build one engine replica (picklable: Ray actors build their engine from it)."""

    model: str = "smollm2-135m"
    kv_cache_tokens: int = 65_536
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    num_threads: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None

    def build(self):
        from kvbalance.llm import LLMEngine

        kw = dataclasses.asdict(self)
        return LLMEngine(kw.pop("model"), **kw)


@dataclass(frozen=True)
class PreparedRequest:
    """A request checked against the engine: its prompt as token ids and its sampling parameters."""

    item: BatchRequest
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True)
class ReplicaInfo:
    model: str
    max_context: int
    block_size: int
    kv_capacity_tokens: int
    max_num_batched_tokens: int


def _param_of(message: str, default: str) -> str:
    head, sep, _ = message.partition(":")
    return head if sep and head.replace("_", "").replace(".", "").isalnum() else default


class BatchWorker:
    """One engine replica: checks Batch requests against its model and generates them in the order given."""

    def __init__(self, engine, served_model: str | None = None) -> None:
        self.engine = engine.build() if isinstance(engine, EngineSpec) else engine
        self.model = served_model or self.engine.model_name
        self._to_text = TokenText(self.engine.tokenizer)  # logprob tokens as the server renders them

    def info(self) -> ReplicaInfo:
        inst = self.engine.instance
        return ReplicaInfo(
            self.model,
            inst.max_context,
            inst.pool.block_size,
            inst.kv_capacity_tokens,
            inst.config.max_num_batched_tokens,
        )

    def prepare(self, items: list[BatchRequest]) -> list[PreparedRequest | BatchRefusal]:
        return [self._prepare(it) for it in items]

    def _prepare(self, item: BatchRequest) -> PreparedRequest | BatchRefusal:
        eng, body = self.engine, item.body
        chat = isinstance(body, ChatBody)
        param = "messages" if chat else "prompt"

        def refuse(msg: str, default: str = param) -> BatchRefusal:
            return BatchRefusal(item.index, item.line_no, item.custom_id, 400, msg, _param_of(msg, default))

        try:
            ids = eng.chat_prompt(body.message_dicts()) if chat else eng.encode(body.prompt)
        except ValueError as e:
            return refuse(str(e))
        if not ids:
            return refuse(f"{param}: empty after tokenisation")
        max_tokens = body.requested_max_tokens if chat else body.max_tokens
        if max_tokens is None:  # chat without a budget: all the room the context and the KV cache leave
            inst = eng.instance
            max_tokens = min(inst.max_context - len(ids), inst.kv_capacity_tokens - len(ids) + 1)
            if max_tokens < 1:
                return refuse(f"{param}: the prompt ({len(ids)} tokens) leaves no room for output")
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_k=max(body.top_k, 0),
                top_p=body.top_p,
                seed=body.seed,
                stop=body.stop_strings,
                stop_token_ids=list(body.stop_token_ids),
                ignore_eos=body.ignore_eos,
                logprobs=body.num_logprobs,
            )
        except ValueError as e:
            return refuse(str(e), "body")
        reason = eng.instance.rejection_reason(Request("check", ids, sampling))
        if reason is not None:
            return refuse(f"{param}: {reason}")
        return PreparedRequest(item, ids, sampling)

    def generate(self, prepared: list[PreparedRequest]) -> Iterator[Records]:
        """Queue ``prepared`` in order (FCFS admission follows it) and yield each step's finished records."""
        eng = self.engine
        pending: dict[str, PreparedRequest] = {}
        reqs: dict[str, Request] = {}
        for p in prepared:
            rid = f"batch-{p.item.index}"
            req = eng.add_request(p.prompt_token_ids, p.sampling, rid)
            if req.state is RequestState.REJECTED:  # checked in prepare; kept so nothing is ever dropped
                msg = f"prompt: {req.reject_reason}"
                yield [(p.item.index, refusal_record(self._refusal(p, msg)))]
                continue
            pending[rid], reqs[rid] = p, req
        while pending:
            if (
                not eng.has_unfinished()
            ):  # never reached with the engine as it is; nothing is dropped if it is
                yield [(p.item.index, self._failed(reqs[rid], p)) for rid, p in pending.items()]
                return
            done: Records = []
            for out in eng.step():
                p = pending.pop(out.request_id, None) if out.finished else None
                if p is None:
                    continue
                req = reqs.pop(out.request_id)
                if req.state is not RequestState.FINISHED:
                    done.append((p.item.index, self._failed(req, p)))
                    continue
                gen = Generation(
                    out.text,
                    list(req.output_token_ids),
                    req.finish_reason,
                    req.num_prompt_tokens,
                    list(req.output_logprobs),
                )
                done.append(
                    (p.item.index, success_record(p.item, gen, self.model, int(time.time()), self._to_text))
                )
            if done:
                yield done

    @staticmethod
    def _failed(req: Request, p: PreparedRequest) -> dict:
        """A request the engine dropped or rejected mid-run: a 500 line with the engine's reason."""
        reason = req.reject_reason or req.finish_reason or f"ended {req.state.value} without output"
        body = error_body(500, f"engine: {reason}", None)
        return output_line(p.item.index, p.item.custom_id, 500, body)

    @staticmethod
    def _refusal(p: PreparedRequest, msg: str) -> BatchRefusal:
        return BatchRefusal(p.item.index, p.item.line_no, p.item.custom_id, 400, msg, "prompt")


class Backend(Protocol):
    """Where a job's requests are generated: one replica in-process, or N Ray actors."""

    num_replicas: int

    def info(self) -> ReplicaInfo: ...

    def prepare(self, items: list[BatchRequest]) -> list[PreparedRequest | BatchRefusal]: ...

    def generate(self, shards: list[list[PreparedRequest]]) -> Iterator[Records]: ...

    def close(self) -> None: ...


class LocalBackend:
    """One in-process replica. With ``num_replicas=k`` it stands in for k replicas: the plan is cut into k
    ranks as for a data-parallel run and the ranks run one after another (what a test of the sharding
    needs without Ray)."""

    def __init__(self, engine, served_model: str | None = None, *, num_replicas: int = 1) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas: must be a positive integer, got {num_replicas!r}")
        self.worker = engine if isinstance(engine, BatchWorker) else BatchWorker(engine, served_model)
        self.num_replicas = num_replicas

    def info(self) -> ReplicaInfo:
        return self.worker.info()

    def prepare(self, items: list[BatchRequest]) -> list[PreparedRequest | BatchRefusal]:
        return self.worker.prepare(items)

    def generate(self, shards: list[list[PreparedRequest]]) -> Iterator[Records]:
        for shard in shards:
            yield from self.worker.generate(shard)

    def close(self) -> None:
        pass
