"""Deferred detokenisation (LLMEngine without stop strings): text read late, out of order or never is
the text the engine computed eagerly, step by step, before (kvbalance/llm/engine.py, llm/text.py)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("torch")

from kvbalance.llm import Detokenizer, LLMEngine  # noqa: E402
from kvbalance.request import SamplingParams  # noqa: E402

TEXT = "aé€😀 ok ü"  # multi-byte characters arrive split across one-byte tokens


class ByteTokenizer:
    """Token t <-> the byte t (ids of the tiny model's 256-token vocabulary); an incomplete UTF-8 tail
    decodes to U+FFFD, which the detokeniser holds back until the character completes."""

    eos_token_id = None
    chat_template = None

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return bytes(ids).decode("utf-8", errors="replace")


def _engine() -> LLMEngine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = LLMEngine("tiny-llama", kv_cache_tokens=2048, max_num_batched_tokens=64)
    eng.tokenizer = CharTokenizer()
    return eng


class CharTokenizer(ByteTokenizer):
    """Token t -> the character chr(65 + t % 58) (never an incomplete character)."""

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return "".join(chr(65 + t % 58) for t in ids)


def _run(read_each_step: bool):  # seeded sampling: varied bytes (the random tiny model's argmax repeats)
    eng = _engine()
    for i in range(3):
        eng.add_request(
            [1 + i, 2, 3, 4 + i],
            SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True, temperature=1.0, seed=i),
        )
    outs, seen = [], []
    while eng.has_unfinished():
        for out in eng.step():
            outs.append(out)
            if read_each_step:
                seen.append((out.request_id, out.text_delta, out.text))
    return eng, outs, seen


def test_deferred_text_read_late_and_backwards_equals_text_read_at_each_step():
    _, _, eager = _run(read_each_step=True)
    eng, outs, _ = _run(read_each_step=False)
    assert eng.tokenizer.calls == 0  # nobody read text: nothing was decoded
    late = [(o.request_id, o.text_delta, o.text) for o in reversed(outs)][::-1]
    assert late == eager
    full = {}
    for rid, delta, _ in eager:
        full[rid] = full.get(rid, "") + delta
    for o in outs:
        if o.finished:  # the deltas add up to the whole output, and a held-back character came out whole
            assert full[o.request_id] == o.text == CharTokenizer().decode(o.request.output_token_ids)


def test_text_of_a_running_request_runs_its_deferred_steps():
    eng = _engine()
    req = eng.add_request(
        [3, 1, 4, 1, 5], SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=7)
    )
    for _ in range(6):
        eng.step()
    n = len(req.output_token_ids)
    assert n >= 5 and eng.text_of(req.request_id) == CharTokenizer().decode(req.output_token_ids)


def test_deferred_steps_hold_back_split_characters_as_the_eager_steps_do():
    ids, tok = list(TEXT.encode()), ByteTokenizer()
    eager, lazy, deltas = Detokenizer(), Detokenizer(), []
    for n in range(1, len(ids) + 1):
        deltas.append(eager.step(tok, ids[:n]))
        lazy.defer(n)
    assert "".join(deltas) == eager.text == TEXT and "" in deltas  # held back, then whole
    ends = [lazy.upto(tok, ids, n) for n in (len(ids), 3, 0)]  # late, then backwards: nothing reruns
    assert lazy.text == TEXT and ends == [len(TEXT), len("".join(deltas[:3])), 0]
