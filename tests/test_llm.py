"""The real engine's text path: incremental detokenisation, stop strings (never leaked), offline API."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from kvbalance.llm import LLM, LLMEngine  # noqa: E402
from kvbalance.request import SamplingParams  # noqa: E402


class CharTokenizer:
    """Token id t <-> the character chr(65 + t % 58); enough to exercise the text path."""

    eos_token_id = None
    chat_template = None

    def encode(self, text):
        return [(ord(c) - 65) % 58 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + t % 58) for t in ids)


def _engine():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = LLMEngine("tiny-llama", kv_cache_tokens=2048, max_num_batched_tokens=64)
    eng.tokenizer = CharTokenizer()
    return eng


def _stream(eng, prompt, params):
    req = eng.add_request(prompt, params)
    deltas, final = [], None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == req.request_id:
                deltas.append(out.text_delta)
                if out.finished:
                    final = out
    return "".join(deltas), final


def test_streamed_deltas_add_up_to_the_text():
    eng = _engine()
    text, final = _stream(eng, [1, 2, 3, 4], SamplingParams(max_tokens=12))
    assert final.finished and final.finish_reason == "length"
    assert text == final.text == CharTokenizer().decode(final.request.output_token_ids)
    assert not eng._detok  # finished requests leave no state behind


@pytest.mark.parametrize("stop_len", [1, 2, 3])
def test_multi_token_stop_string_never_leaks(stop_len):
    full, _ = _stream(_engine(), [5, 6, 7, 8, 9], SamplingParams(max_tokens=16))
    stop = full[6 : 6 + stop_len]
    text, final = _stream(_engine(), [5, 6, 7, 8, 9], SamplingParams(max_tokens=16, stop=[stop]))
    cut = full.index(stop)
    assert final.finish_reason == "stop"
    assert text == final.text == full[:cut]


def test_offline_generate_matches_engine_and_rejects_impossible_prompts():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM("tiny-llama", kv_cache_tokens=1024)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=5))
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert outs[0].prompt_token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="context_length|kv_capacity"):
        llm.generate([[1] * 600], SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[10**9]])
