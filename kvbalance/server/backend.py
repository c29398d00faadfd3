"""The seam between the front end and what generates: one ``LLMEngine``, or a cluster of instances.

``AsyncEngine``'s engine thread is the only caller. A backend tokenises (``encode``, ``chat_prompt``),
queues and aborts requests by id, and ``step()`` advances it and returns the ``RequestOutput`` of every
request that produced something (a step of one engine; for a cluster, whatever its instances reported
since the last call), or a :class:`RequestFailed` for a request that ended with an error of its own (a
cluster instance died after it had streamed tokens: the client gets that error). ``load()`` is the
``InstanceLoad`` the ``/metrics`` gauges mirror (a cluster sums its instances'). :class:`EngineBackend`
adapts an ``LLMEngine``; ``kvbalance.raycluster.backend`` is the cluster's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvbalance.engine import InstanceLoad
from kvbalance.request import Request, SamplingParams


@dataclass
class RequestFailed:
    """``step()``'s item for one request that cannot go on; the engine thread ends its stream with ``error``."""

    request_id: str
    error: BaseException


@runtime_checkable
class Backend(Protocol):
    model_name: str
    tokenizer: Any
    requests: Mapping[str, Request]  # requests in flight, by id

    @property
    def max_context(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_steps(self) -> int:
        """Steps (or cluster step reports) so far: the engine thread waits a little when it does not move."""
        ...

    def encode(self, prompt: str | Sequence[int]) -> list[int]: ...

    def chat_prompt(self, messages: list[dict]) -> list[int]: ...

    def add_request(self, prompt: Sequence[int], params: SamplingParams, request_id: str) -> Request: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list: ...

    def has_unfinished(self) -> bool: ...

    def load(self) -> InstanceLoad: ...


class EngineBackend:
    """One ``LLMEngine`` as a :class:`Backend`; other attributes read through to the engine."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):
        if name == "engine":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    @property
    def max_context(self) -> int:
        return self.engine.instance.max_context

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.instance.kv_capacity_tokens

    @property
    def block_size(self) -> int:
        return self.engine.executor.block_size

    @property
    def num_steps(self) -> int:
        return self.engine.instance.num_steps

    def load(self) -> InstanceLoad:
        return self.engine.instance.load()


def as_backend(engine) -> Backend:
    """``engine`` itself if it is a :class:`Backend`, else an ``LLMEngine`` wrapped in :class:`EngineBackend`."""
    if isinstance(engine, Backend):
        return engine
    if not hasattr(engine, "instance"):
        raise TypeError(f"engine: needs an LLMEngine or a server Backend, got {type(engine).__name__}")
    return EngineBackend(engine)
