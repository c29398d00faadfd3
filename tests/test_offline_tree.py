"""Resource-aware prefix tree, output-length sampling and conditional node splitting."""

import numpy as np
import pytest

from kvbalance.kvcache.prefix import prefix_block_hashes
from kvbalance.offline.density import DensityConstants, comp_s, job_density_fn, mem_s
from kvbalance.offline.estimate import choose_samples, estimate_output_lens
from kvbalance.offline.planners._common import budget_lens
from kvbalance.offline.split import sort_and_split
from kvbalance.offline.tree import PrefixTree
from kvbalance.request import Request
from kvbalance.workloads.offline import PRESETS, OfflineJobConfig, build_job, tune_job

K = DensityConstants.for_model("llama-3.1-8b", "a100-80gb")
BS = 4


def _req(i, tokens, out=10):
    return Request(f"r{i}", tokens, max_tokens=out)


def _job():
    a = list(range(100, 112))  # 3 blocks shared by r0..r2
    b = list(range(200, 208))  # 2 blocks shared by r3, r4
    return [
        _req(0, a + [1, 2, 3, 4, 5]),
        _req(1, a + [6, 7, 8, 9]),
        _req(2, a + [6, 7, 8, 9, 9, 9, 9, 9]),  # shares a + one more block with r1
        _req(3, b + [1, 1]),
        _req(4, b + [2, 2, 2, 2]),
        _req(5, [7, 7]),  # no full block
    ]


def test_tree_groups_prompts_exactly_where_the_cache_would_share_blocks():
    reqs = _job()
    tree = PrefixTree.from_requests(reqs, BS)
    root = tree.root
    assert sorted(tree.leaf_order()) == list(range(6))
    assert len(root.children) == 3  # group a, group b, r5 alone
    ga = tree.leaves[0].parent
    assert ga.end == 3 and ga.parent is root
    sub = tree.leaves[1].parent
    assert sub is tree.leaves[2].parent and sub.start == 3 and sub.end == 4
    assert tree.leaves[3].parent.end == 2
    assert tree.leaves[5].parent is root and tree.leaves[5].end == 0
    # hashes are the radix cache's: a node's last block hash names the whole prefix
    assert (
        prefix_block_hashes(reqs[1].prompt_token_ids, BS)[:4]
        == prefix_block_hashes(reqs[2].prompt_token_ids, BS)[:4]
    )


def test_annotation_counts_sharing_and_density_by_hand():
    reqs = _job()
    tree = PrefixTree.from_requests(reqs, BS)
    d = budget_lens(reqs)
    tree.annotate(d, K)
    p = np.array([r.num_prompt_tokens for r in reqs])
    total = p.sum()
    # shared: group a's 3 blocks computed once instead of 3 times, r1/r2's 4th block once instead of twice,
    # group b's 2 blocks once instead of twice
    saved = (3 - 1) * 3 * BS + (2 - 1) * 1 * BS + (2 - 1) * 2 * BS
    assert tree.root.n == 6 and tree.root.prompt_tokens == total
    assert tree.root.computed_tokens == total - saved
    assert tree.dfs_sharing == pytest.approx(saved / total)
    comp, mem = comp_s(p, d, K).sum(), mem_s(p, d, K).sum()
    assert tree.root.density == pytest.approx((1 - saved / total) * comp / mem)
    ga = tree.leaves[0].parent
    ga_p = p[:3].sum()
    ga_saved = 2 * 3 * BS + 1 * BS
    assert ga.sharing == pytest.approx(ga_saved / ga_p)


def test_samples_spread_over_subtrees_and_unsampled_use_nearest_relative():
    reqs = _job()
    tree = PrefixTree.from_requests(reqs, BS)
    tree.annotate(np.ones(6), K)
    samples = choose_samples(tree, fraction=0.5, seed=0)
    assert len(samples) >= 3
    groups = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "c"}
    assert {groups[i] for i in samples} == {"a", "b", "c"}
    est = estimate_output_lens(tree, [1, 3], [40, 7])
    assert est.output_lens[1] == 40 and est.output_lens[3] == 7
    assert est.output_lens[2] == 40  # leaf sibling under the same 4-block prefix
    assert est.output_lens[0] == 40  # group a's samples' mean
    assert est.output_lens[4] == 7
    assert est.output_lens[5] == pytest.approx((40 + 7) / 2)  # nothing closer than the root
    est.error_report([10, 40, 20, 7, 14, 10])
    assert est.mean_abs_rel_error == pytest.approx(np.mean([30 / 10, 20 / 20, 7 / 14, 13.5 / 10]))


def test_sampling_is_deterministic_and_about_one_percent():
    reqs = build_job(OfflineJobConfig(num_requests=3000, seed=1))
    tree = PrefixTree.from_requests(reqs, 16)
    tree.annotate(np.ones(len(reqs)), K)
    a, b = choose_samples(tree, 0.01, seed=3), choose_samples(tree, 0.01, seed=3)
    assert a == b and len(set(a)) == len(a)
    assert 30 <= len(a) <= 0.1 * len(reqs)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_splitting_keeps_99_percent_of_sharing_on_the_presets(preset):
    pr = PRESETS[preset]
    cfg = tune_job(
        OfflineJobConfig(num_requests=1500, video_output_mean_tokens=4096),
        job_density_fn(K),
        pr.density,
        pr.sharing,
    )
    reqs = build_job(cfg)
    tree = PrefixTree.from_requests(reqs, 16)
    d = budget_lens(reqs)
    stats = sort_and_split(tree, d, K)
    assert stats.sharing_before > 0
    # at most 1% of the shared tokens lost; a loss of exactly 1% (trace3 since the A100 presets' own bandwidth
    # fraction re-tuned the job) meets 0.99 x before up to rounding
    assert stats.lost_tokens <= stats.threshold_tokens
    assert stats.sharing_after >= 0.99 * stats.sharing_before * (1 - 1e-12)
    assert sorted(tree.leaf_order()) == list(range(len(reqs)))
    tree.annotate(d, K)
    assert tree.root.n == len(reqs)
    assert tree.dfs_sharing == pytest.approx(stats.sharing_after)


def test_splitting_makes_leaf_densities_non_increasing_when_cheap():
    # two groups, each mixing a compute-heavy and a memory-heavy request behind a 1-block prefix: cutting
    # both groups (cheap) lets the root sort all four leaves
    g1, g2 = list(range(10, 14)), list(range(20, 24))
    reqs = [
        _req(0, g1 + [1] * 40, out=1),
        _req(1, g1 + [2] * 4, out=3000),
        _req(2, g2 + [3] * 40, out=2),
        _req(3, g2 + [4] * 4, out=2500),
    ]
    tree = PrefixTree.from_requests(reqs, BS)
    d = budget_lens(reqs)
    stats = sort_and_split(tree, d, K, keep_sharing=0.0)
    rho = tree.leaf_density[tree.leaf_order()]
    assert stats.monotone and stats.num_splits >= 1
    assert all(rho[i] >= rho[i + 1] for i in range(len(rho) - 1))
    # with a 99% keep the same cuts are too expensive: the order stays grouped
    tree2 = PrefixTree.from_requests(reqs, BS)
    stats2 = sort_and_split(tree2, d, K, keep_sharing=0.99)
    assert stats2.num_splits == 0 and not stats2.monotone


def test_leaf_density_amortises_each_shared_edge_over_its_subtree_by_hand():
    reqs = _job()
    tree = PrefixTree.from_requests(reqs, BS)
    d = budget_lens(reqs)
    tree.annotate(d, K)
    p = np.array([r.num_prompt_tokens for r in reqs], dtype=float)
    # r0: group a's 3 blocks split over r0..r2, then its own 5 tokens; r1, r2: a's share, the 4th block
    # split over the two of them, then their own tokens past it; r3, r4: group b's 2 blocks halved; r5: alone
    a, ab, b = 3 * BS / 3, 1 * BS / 2, 2 * BS / 2
    own = [p[0] - 3 * BS, p[1] - 4 * BS, p[2] - 4 * BS, p[3] - 2 * BS, p[4] - 2 * BS, p[5]]
    expect = np.array([a + own[0], a + ab + own[1], a + ab + own[2], b + own[3], b + own[4], own[5]])
    assert tree.amortised_tokens == pytest.approx(expect)
    assert tree.amortised_tokens.sum() == pytest.approx(tree.root.computed_tokens)  # the shares add up
    rho = comp_s(p, d, K) / mem_s(p, d, K)
    assert tree.leaf_density == pytest.approx(expect / p * rho)
    assert tree.leaf_density[0] < rho[0] and tree.leaf_density[5] == pytest.approx(rho[5])
