"""Shared test helpers: a trivial executor and request builders."""

from __future__ import annotations

import importlib.util
import zlib

import pytest

from kvbalance.batch import BatchPlan, StepResult
from kvbalance.request import Request, SamplingParams


class EchoExecutor:
    """Deterministic stand-in executor: fixed step time, token = f(request id, position)."""

    def __init__(self, step_s: float = 0.01, per_token_s: float = 0.0) -> None:
        self.step_s = step_s
        self.per_token_s = per_token_s
        self.plans: list[BatchPlan] = []

    def execute(self, plan: BatchPlan) -> StepResult:
        self.plans.append(plan)
        sampled = {
            s.request.request_id: 1_000_000
            + (zlib.crc32(s.request.request_id.encode()) % 1000) * 10_000
            + s.context_len
            for s in plan.seqs
            if s.sample
        }
        return StepResult(self.step_s + self.per_token_s * plan.num_tokens, sampled)


def make_request(rid: str, prompt, max_tokens: int = 8, arrival_s: float = 0.0) -> Request:
    if isinstance(prompt, int):  # distinct per id, the same in every process (no PYTHONHASHSEED dependence)
        base = 10_000 * (zlib.crc32(rid.encode()) % 1000)
        prompt = list(range(base, base + prompt))
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: thread hand-offs cost more than they save (and the CI box is shared). Modules that use
    torch opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def echo_executor():
    return EchoExecutor()


def pytest_ignore_collect(collection_path, config):
    """Without the torch extra (the light core, e.g. the Python 3.10 check), skip test modules that import
    torch at module level instead of failing to collect them."""
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    if importlib.util.find_spec("torch") is not None:
        return None
    text = collection_path.read_text()
    return True if "\nimport torch\n" in text or "\nfrom torch" in text else None
