"""Workloads: arrival statistics, length presets, synthetic prompt sharing, trace parsing and its errors."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from kvbalance.request import Request
from kvbalance.workloads import (
    SHARED_BASE,
    UNIQUE_BASE,
    Empirical,
    Fixed,
    JointLengths,
    LogNormal,
    SyntheticPrompt,
    Uniform,
    build_requests,
    describe_workload,
    gamma,
    load_azure,
    load_mooncake,
    load_trace,
    poisson,
    random_token_prompt,
    shared_prefix_prompt,
    unique_prompt,
)
from kvbalance.workloads.arrivals import arrival_times

TRACES = Path(
    os.environ.get("KVBALANCE_TRACES") or Path(__file__).resolve().parents[1].parent / "shared" / "traces"
)
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl"
SHAREGPT_CSV = TRACES / "sharegpt_opt_lengths_filtered2048.csv"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"Mooncake trace not found at {MOONCAKE}")
needs_sharegpt = pytest.mark.skipif(
    not SHAREGPT_CSV.is_file(), reason=f"ShareGPT lengths not found at {SHAREGPT_CSV}"
)


# -- arrivals ----------------------------------------------------------------------------------------------
def test_poisson_mean_gap_is_one_over_rate():
    t = poisson(4.0, 20_001, np.random.default_rng(1))
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_gap_cv_matches(cv):
    gaps = np.diff(gamma(10.0, cv, 50_001, np.random.default_rng(2)))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_infinite_rate_puts_everyone_at_zero():
    assert np.all(arrival_times("gamma", math.inf, 5, 0, cv=3.0) == 0.0)
    assert np.all(poisson(math.inf, 5) == 0.0)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan")])
def test_bad_rate_is_rejected_naming_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        poisson(rate, 10)
    with pytest.raises(ValueError, match="rate"):
        build_requests("fixed:10:10", 10, rate, 0, 2048)


def test_bad_cv_and_arrival_kind_are_named():
    with pytest.raises(ValueError, match="cv"):
        gamma(1.0, 0.0, 10)
    with pytest.raises(ValueError, match="arrival"):
        arrival_times("bursty", 1.0, 10)


# -- length distributions ----------------------------------------------------------------------------------
def test_uniform_stays_in_bounds_and_hits_both_ends():
    x = Uniform(3, 7).sample(np.random.default_rng(0), 5000)
    assert x.min() == 3 and x.max() == 7 and x.dtype == np.int64
    assert Uniform(3, 7).mean() == 5.0 and Uniform(3, 7).probs.sum() == pytest.approx(1.0)


def test_length_validation_names_the_field():
    with pytest.raises(ValueError, match="hi"):
        Uniform(5, 4)
    with pytest.raises(ValueError, match="value"):
        Fixed(0)
    with pytest.raises(ValueError, match="mean"):
        LogNormal.from_mean_median(10, 20)
    with pytest.raises(ValueError, match="values"):
        Empirical([])


def test_lognormal_pmf_matches_samples():
    d = LogNormal.from_mean_median(100.0, 60.0, 5, 400)
    x = d.sample(np.random.default_rng(3), 20_000)
    assert x.min() >= 5 and x.max() <= 400
    assert x.mean() == pytest.approx(d.mean(), rel=0.03)
    assert d.probs.sum() == pytest.approx(1.0)
    assert d.median() == 60


def test_empirical_resamples_observed_values():
    d = Empirical([1, 1, 2, 10])
    assert d.mean() == pytest.approx(3.5)
    assert set(d.sample(np.random.default_rng(0), 100).tolist()) <= {1, 2, 10}


def test_joint_expectation_is_exact_under_the_cap():
    j = JointLengths(Uniform(1, 3), Uniform(1, 3), max_total_tokens=4)
    # pairs (s, min(o, 4 - s)) over 9 equally likely (s, o)
    pairs = [(s, min(o, 4 - s)) for s in (1, 2, 3) for o in (1, 2, 3)]
    assert j.expect(lambda s, o: s * o) == pytest.approx(np.mean([s * o for s, o in pairs]))


# -- presets -----------------------------------------------------------------------------------------------
def _lengths(reqs: list[Request]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([r.num_prompt_tokens for r in reqs]), np.array([r.max_tokens for r in reqs])


def test_sharegpt_preset_matches_paper_moments():
    reqs = build_requests("sharegpt", 20_000, 10.0, 0, 4096)
    s, o = _lengths(reqs)
    assert s.mean() == pytest.approx(161, rel=0.1) and np.median(s) == pytest.approx(35, rel=0.1)
    assert o.mean() == pytest.approx(338, rel=0.1) and np.median(o) == pytest.approx(271, rel=0.1)
    assert s.min() >= 1 and o.min() >= 1 and (s + o).max() <= 2048
    desc = describe_workload("sharegpt", 4096)
    assert desc["lengths"].mean_input() == pytest.approx(s.mean(), rel=0.03)


def test_sharegpt_respects_a_smaller_context():
    s, o = _lengths(build_requests("sharegpt", 5000, 10.0, 1, 1024))
    assert (s + o).max() <= 1024


def test_alpaca_and_longbench_presets():
    s, o = _lengths(build_requests("alpaca", 20_000, 10.0, 0, 2048))
    assert s.mean() == pytest.approx(19.3, rel=0.1) and o.mean() == pytest.approx(58.5, rel=0.1)
    s, o = _lengths(build_requests("longbench", 2000, 10.0, 0, 32768))
    assert s.min() >= 1000 and (s + o).max() <= 32768 and 32 <= o.min() and o.max() <= 512
    assert np.median(s) == pytest.approx(7000, rel=0.1)
    s, o = _lengths(build_requests("longbench", 500, 10.0, 0, 4096))
    assert (s + o).max() <= 4096


def test_uniform_and_fixed_presets_and_ids():
    reqs = build_requests("uniform:10-20:5-8", 2000, 5.0, 7, 2048)
    s, o = _lengths(reqs)
    assert s.min() == 10 and s.max() == 20 and o.min() == 5 and o.max() == 8
    assert [r.request_id for r in reqs[:2]] == ["r000000", "r000001"]
    assert all(r.sampling.ignore_eos for r in reqs)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    reqs = build_requests("fixed:100:10", 3, math.inf, 0, 2048)
    assert [(r.num_prompt_tokens, r.max_tokens, r.arrival_s) for r in reqs] == [(100, 10, 0.0)] * 3


def test_too_long_requests_are_kept_for_the_engine_to_reject():
    reqs = build_requests("fixed:3000:100", 2, 1.0, 0, 2048)
    assert len(reqs) == 2 and reqs[0].num_prompt_tokens == 3000


def test_same_seed_same_requests_and_other_seed_differs():
    def key(reqs):
        return [(r.request_id, r.arrival_s, r.max_tokens, r.prompt_token_ids[:].tolist()) for r in reqs]

    a = build_requests("sharegpt", 200, 3.0, 42, 2048, arrival="gamma", cv=2.0)
    b = build_requests("sharegpt", 200, 3.0, 42, 2048, arrival="gamma", cv=2.0)
    c = build_requests("sharegpt", 200, 3.0, 43, 2048, arrival="gamma", cv=2.0)
    assert key(a) == key(b) and key(a) != key(c)


@pytest.mark.parametrize(
    "workload", ["nope", "uniform:5-1:1-2", "fixed:1:2:3", "uniform:a-b:1-2", "sharegpt:3", "azure:"]
)
def test_bad_workload_strings_name_workload(workload):
    with pytest.raises(ValueError, match="workload"):
        build_requests(workload, 10, 1.0, 0, 2048)


def test_synthetic_workload_needs_a_count():
    with pytest.raises(ValueError, match="num_requests"):
        build_requests("alpaca", None, 1.0, 0, 2048)


def test_prefix_preset_shares_system_prompt_within_a_group():
    reqs = build_requests("prefix:3:1000:10-20:5-9", 60, 1.0, 0, 4096)
    by_first = {}
    for r in reqs:
        by_first.setdefault(int(r.prompt_token_ids[0]), []).append(r)
    assert 1 < len(by_first) <= 3
    for group in by_first.values():
        a, b = group[0].prompt_token_ids, group[-1].prompt_token_ids
        assert np.array_equal(a[:1000], b[:1000])
        if a is not b:
            assert not np.intersect1d(a[1000:], b[1000:]).size


# -- synthetic tokens --------------------------------------------------------------------------------------
def test_synthetic_prompt_slices_equal_materialised_array():
    p = SyntheticPrompt(1300, uid=5, hash_ids=[7, 3], block_tokens=512)
    full = np.array([p[i] for i in range(len(p))], dtype=np.int64)
    assert p.shared_len == 1024
    assert np.array_equal(p[:], full)
    for sl in (slice(100, 900), slice(1000, 1300), slice(-50, None), slice(3, 1200, 7), slice(1290, 5000)):
        assert p[sl].dtype == np.int64 and np.array_equal(p[sl], full[sl])
    assert p[-1] == full[-1] and p[0] == SHARED_BASE + 7 * 512
    assert p[1024] == UNIQUE_BASE + 5 * 2**20 + 1024
    with pytest.raises(IndexError):
        p[1300]


def test_mooncake_style_prompts_share_exactly_the_common_blocks():
    a = SyntheticPrompt(3 * 512 + 100, 0, [1, 2, 3, 9])
    b = SyntheticPrompt(4 * 512, 1, [1, 2, 4, 5])
    k = 2
    assert np.array_equal(a[: 512 * k], b[: 512 * k])
    diff = a[512 * k : 512 * 3] != b[512 * k : 512 * 3]
    assert diff.all()
    # the same partial last block gives the same tokens
    c = SyntheticPrompt(3 * 512 + 100, 2, [1, 2, 3, 9])
    assert np.array_equal(a[:], c[:])


def test_unique_tails_never_collide():
    prompts = [unique_prompt(u, 3000) for u in range(20)] + [SyntheticPrompt(1000, 99, [0, 1])]
    seen = np.concatenate([p[:] for p in prompts])
    assert len(np.unique(seen)) == len(seen)


def test_shared_prefix_prompt_groups():
    a = shared_prefix_prompt(0, 700, 50, uid=1)
    b = shared_prefix_prompt(0, 700, 80, uid=2)
    c = shared_prefix_prompt(1, 700, 50, uid=3)
    assert np.array_equal(a[:700], b[:700]) and a[700] != b[700]
    assert not np.intersect1d(a[:], c[:]).size


def test_random_token_prompt_for_real_models():
    toks = random_token_prompt(np.random.default_rng(0), 64, 1000, low=3)
    assert len(toks) == 64 and isinstance(toks[0], int) and min(toks) >= 3 and max(toks) < 1000


# -- traces ------------------------------------------------------------------------------------------------
def test_malformed_mooncake_line_names_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [0]}
    lines = [json.dumps(good), json.dumps({**good, "input_length": "ten"})]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: input_length"):
        load_mooncake(path)
    path.write_text(json.dumps(good) + "\n\n{oops\n")
    with pytest.raises(ValueError, match=rf"^{path}:3: not valid JSON"):
        load_mooncake(path)
    path.write_text(json.dumps({**good, "hash_ids": "zero"}) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:1: hash_ids"):
        load_mooncake(path)


def test_mooncake_line_without_hash_ids_shares_nothing(tmp_path):
    path = tmp_path / "nohash.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 600, "output_length": 3} for i in range(2)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    records = load_mooncake(path)
    assert [r.hash_ids for r in records] == [None, None]
    assert [r.arrival_s for r in records] == [0.0, 1.0]
    reqs = build_requests(f"mooncake:{path}", None, 1.0, 0, 4096)
    assert len(reqs) == 2
    a, b = (list(r.prompt_token_ids[:600]) for r in reqs)
    assert not set(a) & set(b)  # no shared tokens, so no prefix hit


def test_malformed_csv_line_names_file_line_and_field(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,input_len,output_len\n0.0,10,5\n0.5,-3,5\n")
    with pytest.raises(ValueError, match=rf"^{path}:3: input_len"):
        load_trace(path)
    path.write_text("arrival_s,input_len,output_len\n0.0,10\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: expected 3 fields"):
        load_trace(path)
    path.write_text("arrival_s,input_len\n0.0,10\n")
    with pytest.raises(ValueError, match=rf"^{path}:1: output_len: missing column"):
        load_trace(path)


def test_azure_csv_arrivals_are_seconds_since_first_row(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-17 00:00:00.0000000,879,0\n"
    )
    recs = load_azure(path)
    assert [(r.input_len, r.output_len) for r in recs] == [(374, 44), (396, 109), (879, 0)]
    assert recs[0].arrival_s == 0.0
    assert recs[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert recs[2].arrival_s == pytest.approx(5 * 3600 + 44 * 60 + 13.31941, abs=1e-6)
    reqs = build_requests(f"azure:{path}", None, 1.0, 0, 4096, time_scale=0.5)
    assert [r.arrival_s for r in reqs][1] == pytest.approx(4.314579 / 2, abs=1e-6)
    assert reqs[2].max_tokens == 1 and reqs[2].meta["trace_output_len"] == 0
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46.68,374,44\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: TIMESTAMP"):
        load_azure(path)


def test_trace_replay_sorts_truncates_and_keeps_everything(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"arrival_s": 2.0, "input_len": 600, "output_len": 5, "hash_ids": [4, 5]},
        {"arrival_s": 1.0, "input_len": 9000, "output_len": 5},
        {"arrival_s": 3.0, "input_len": 700, "output_len": 5, "hash_ids": [4, 6]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = build_requests(f"trace:{path}", None, 1.0, 0, 2048)
    assert [r.arrival_s for r in reqs] == [1.0, 2.0, 3.0]
    assert reqs[0].num_prompt_tokens == 9000  # over the context: kept, the engine rejects it
    assert np.array_equal(reqs[1].prompt_token_ids[:512], reqs[2].prompt_token_ids[:512])
    assert reqs[1].prompt_token_ids[512] != reqs[2].prompt_token_ids[512]
    assert len(build_requests(f"trace:{path}", 2, 1.0, 0, 2048)) == 2


def test_trace_without_times_uses_the_rate(tmp_path):
    path = tmp_path / "lens.csv"
    path.write_text("input_len,output_len\n" + "".join(f"{i + 1},{i + 2}\n" for i in range(2000)))
    reqs = build_requests(f"trace:{path}", 1500, 20.0, 0, 4096)
    assert len(reqs) == 1500 and reqs[0].num_prompt_tokens == 1
    assert np.diff([r.arrival_s for r in reqs]).mean() == pytest.approx(0.05, rel=0.1)


@needs_mooncake
def test_mooncake_trace_prompts_share_their_common_hash_prefix():
    reqs = build_requests(f"mooncake:{MOONCAKE}", 200, 1.0, 0, 131072)
    with open(MOONCAKE) as f:
        first = [json.loads(next(f)) for _ in range(200)]
    assert [r.num_prompt_tokens for r in reqs] == [row["input_length"] for row in first]
    a, b = reqs[0].prompt_token_ids, reqs[1].prompt_token_ids  # hash_ids [0, 1, ...] and [0, 14, ...]
    assert np.array_equal(a[:512], b[:512]) and (a[512:1024] != b[512:1024]).all()


@needs_sharegpt
def test_sharegpt_trace_preset_matches_the_csv():
    s, o = _lengths(build_requests("sharegpt-trace", 5000, 10.0, 0, 2048))
    assert s.mean() == pytest.approx(161.2, rel=0.08) and o.mean() == pytest.approx(338.0, rel=0.08)
    assert describe_workload("sharegpt-trace")["lengths"].mean_input() == pytest.approx(161.2, abs=0.1)
