"""The cluster experiments' workloads: shared documents, conversations, phases and bursts (workloads/reuse.py,
workloads/phases.py) through ``build_requests``."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvbalance.workloads.presets import build_requests, describe_workload
from kvbalance.workloads.reuse import parse, turns_per_session


def _shared(a, b) -> int:
    x, y = np.asarray(a), np.asarray(b)
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if len(diff) else n


def test_docqa_requests_share_exactly_their_document():
    reqs = build_requests("docqa:4:200:5-9:3-4", 60, 10.0, 1, 2048)
    by_doc: dict[int, list] = {}
    for r in reqs:
        by_doc.setdefault(r.meta["doc"], []).append(r)
        assert 205 <= r.num_prompt_tokens <= 209 and 3 <= r.max_tokens <= 4
    assert len(by_doc) == 4
    a, b = by_doc[0][:2]
    assert _shared(a.prompt_token_ids, b.prompt_token_ids) == 200  # the document, not one token more
    other = by_doc[1][0]
    assert _shared(a.prompt_token_ids, other.prompt_token_ids) == 0


def test_docqa_zipf_makes_the_first_documents_hot_and_zero_is_uniform():
    hot = Counter(r.meta["doc"] for r in build_requests("docqa:16:64:1-2:1-2:1.2", 4000, 10.0, 0, 2048))
    flat = Counter(r.meta["doc"] for r in build_requests("docqa:16:64:1-2:1-2:0", 4000, 10.0, 0, 2048))
    p = parse("docqa:16:64:1-2:1-2:1.2").popularity()
    assert hot[0] / 4000 == pytest.approx(p[0], abs=0.03) and p[0] > 0.3
    assert hot[0] > 5 * hot[15]
    assert max(flat.values()) < 2 * min(flat.values())


def test_chat_turns_extend_the_previous_prompt_of_their_session():
    reqs = build_requests("chat:4:32-64:16-32:48:5", 400, 20.0, 2, 2048)
    sessions: dict[int, list] = {}
    for r in reqs:
        sessions.setdefault(r.meta["session"], []).append(r)
    multi = [turns for turns in sessions.values() if len(turns) > 2]
    assert multi
    for turns in multi:
        turns.sort(key=lambda r: r.meta["turn"])
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.arrival_s >= prev.arrival_s
            if nxt.meta["turn"] == prev.meta["turn"] + 1:  # the earlier prompt is the next one's prefix
                assert _shared(prev.prompt_token_ids, nxt.prompt_token_ids) == prev.num_prompt_tokens
    first = [t[0] for t in sessions.values()]
    # every session shares the 48-token system prompt, and nothing past it
    assert _shared(first[0].prompt_token_ids, first[1].prompt_token_ids) == 48


def test_chat_rate_is_requests_per_second_in_steady_state():
    reqs = build_requests("chat", 3000, 12.0, 0, 2048)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert len(reqs) / span == pytest.approx(12.0, rel=0.1)
    assert all(r.num_prompt_tokens + r.max_tokens <= 2048 for r in reqs)
    assert 1.0 < turns_per_session(parse("chat"), 2048) < 4


def test_phases_alternate_lengths_and_keep_the_mean_rate():
    reqs = build_requests("phases:10:900-1000:4-8:10-20:300-400:3", 3000, 20.0, 0, 2048)
    for r in reqs:
        in_second = (r.arrival_s // 10) % 2 == 1
        assert r.meta["phase"] == int(in_second)
        if in_second:
            assert 10 <= r.num_prompt_tokens <= 20 and r.max_tokens >= 300
        else:
            assert r.num_prompt_tokens >= 900 and r.max_tokens <= 8
    n1 = sum(r.meta["phase"] for r in reqs)
    assert n1 / (len(reqs) - n1) == pytest.approx(3.0, rel=0.1)  # the second phase's rate is 3x the first's
    span = reqs[-1].arrival_s
    assert len(reqs) / span == pytest.approx(20.0, rel=0.08)


def test_bursts_put_the_burst_share_of_requests_in_the_burst():
    reqs = build_requests("bursts:10:2:4:16-32:16-32", 4000, 20.0, 0, 2048)
    in_burst = sum(1 for r in reqs if r.arrival_s % 10 < 2)
    assert in_burst / len(reqs) == pytest.approx(0.8, abs=0.03)  # 4 x 2 s of a 10 s period's mean rate
    assert all(r.meta["phase"] == int(r.arrival_s % 10 >= 2) for r in reqs)


def test_same_seed_same_requests_and_presets_resolve():
    for w in ("docqa-zipf", "chat", "phases-15", "bursts"):
        a, b = build_requests(w, 50, 8.0, 7, 2048), build_requests(w, 50, 8.0, 7, 2048)
        assert [(r.arrival_s, r.num_prompt_tokens, r.max_tokens) for r in a] == [
            (r.arrival_s, r.num_prompt_tokens, r.max_tokens) for r in b
        ]
        assert a[0].prompt_token_ids == b[0].prompt_token_ids
        assert describe_workload(w, 2048)["lengths"].mean_input() > 0


@pytest.mark.parametrize(
    "workload, field",
    [
        ("docqa:0:100:1-2:1-2", "documents"),
        ("docqa:4:100:5-2:1-2", "question"),
        ("docqa:4:100:1-2:1-2:-1", "Zipf exponent"),
        ("docqa:4:3000:1-2:1-2", "context"),
        ("chat:4:1-2:1-2:16", "chat:T"),
        ("chat:4:1-2:1-2:16:0", "seconds between turns"),
        ("phases:0:1-2:1-2:1-2:1-2", "phase length"),
        ("bursts:10:4:3:1-2:1-2", "multiplier x burst length"),
    ],
)
def test_bad_parameters_name_the_field(workload, field):
    with pytest.raises(ValueError, match=field):
        build_requests(workload, 10, 1.0, 0, 2048)
