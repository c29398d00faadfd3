"""Requests and their lifecycle: prompt, output budget, sampling parameters, state and timestamps.

The scheduler advances ``num_computed_tokens`` toward ``num_tokens`` (prompt + output so far);
prefill and decode are the same operation at different sizes, which is what makes chunked
prefill, prefix hits and recompute after preemption one code path (vLLM v1's view).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, never scheduled or preempted and queued again
    WAITING_FOR_KV = "waiting_for_kv"  # holds KV blocks whose contents still arrive from outside (connector)
    RUNNING = "running"  # holds KV blocks and is being computed
    FINISHED = "finished"  # produced its output (length or stop)
    REJECTED = "rejected"  # can never be served (reason in ``reject_reason``)
    ABORTED = "aborted"  # cancelled by the client


@dataclass
class SamplingParams:
    """How to pick output tokens. ``temperature == 0`` is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token, None = off
    # OpenAI's penalties over the output so far: logit[j] -= frequency * count[j] + presence * (count[j] > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs: must be >= 0, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be finite, got {getattr(self, name)}")
        for token, bias in (self.logit_bias or {}).items():
            if not (isinstance(token, int) and token >= 0 and math.isfinite(bias)):
                raise ValueError(
                    f"logit_bias: needs token ids >= 0 and finite biases, got {token!r}: {bias!r}"
                )


class Request:
    """One generation request and everything that happens to it.

    ``prompt_token_ids`` may be a list or a numpy int array (synthetic ids in simulation).
    Timestamps are seconds on the owning clock (simulated or wall).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling",
        "arrival_s",
        "output_token_ids",
        "output_logprobs",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_ids",
        "state",
        "first_scheduled_s",
        "first_token_s",
        "token_times_s",
        "finish_s",
        "finish_reason",
        "reject_reason",
        "num_preemptions",
        "eos_token_id",
        "prefix_hit_tokens",
        "meta",
        "_num_prompt",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        sampling: SamplingParams | None = None,
        arrival_s: float = 0.0,
        max_tokens: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        if len(prompt_token_ids) < 1:
            raise ValueError(f"prompt_token_ids: request {request_id} has an empty prompt")
        if arrival_s < 0:
            raise ValueError(f"arrival_s: must be >= 0, got {arrival_s} for request {request_id}")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._num_prompt = len(prompt_token_ids)
        if sampling is None:
            sampling = SamplingParams(max_tokens=max_tokens or 16, ignore_eos=True)
        elif max_tokens is not None:
            raise ValueError("max_tokens: give it in SamplingParams or as an argument, not both")
        self.sampling = sampling
        self.arrival_s = float(arrival_s)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # tokens served by the prefix cache on the latest admission
        self.prefix_hit_tokens = 0  # total over all admissions (for hit-rate accounting)
        self.block_ids: list[int] = []
        self.state = RequestState.WAITING
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.token_times_s: list[float] = []
        self.finish_s: float | None = None
        self.finish_reason: str | None = None
        self.reject_reason: str | None = None
        self.num_preemptions = 0
        self.eos_token_id = eos_token_id
        self.meta: dict = {}

    # -- sizes -----------------------------------------------------------------
    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output so far: the length whose KV a running request needs."""
        return self._num_prompt + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Longest the sequence can get (KV tokens when the last token is sampled; its own KV is never written)."""
        return self._num_prompt + self.sampling.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.REJECTED, RequestState.ABORTED)

    def token_id(self, pos: int) -> int:
        n = self._num_prompt
        return int(self.prompt_token_ids[pos]) if pos < n else self.output_token_ids[pos - n]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) over prompt + output."""
        n = self._num_prompt
        out: list[int] = []
        if start < n:
            p = self.prompt_token_ids[start : min(end, n)]
            out.extend(p.tolist() if isinstance(p, np.ndarray) else p)
        if end > n:
            out.extend(self.output_token_ids[max(start - n, 0) : end - n])
        return out

    def all_token_ids(self) -> list[int]:
        return self.token_ids(0, self.num_tokens)

    # -- latency ----------------------------------------------------------------
    @property
    def queue_delay_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish_s is None or self.first_token_s is None or len(self.token_times_s) < 2:
            return None
        return (self.token_times_s[-1] - self.first_token_s) / (len(self.token_times_s) - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}/"
            f"{self.max_tokens}, computed={self.num_computed_tokens}, {self.state.value})"
        )
