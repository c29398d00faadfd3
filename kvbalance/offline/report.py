"""Reports of the BlendServe reproduction: tables beside the paper's figures (README.md), the density x sharing
heatmap of blendserve over nanoflow-dfs, and compute / memory utilisation over steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PAPER = {
    "vs_dfs_sequential": "up to 1.44x over vLLM / SGLang in DFS order",
    "vs_nanoflow_dfs_8b": "+20.8% on average (19.3-22.7%) over NanoFlow-DFS, Llama-3.1-8B",
    "vs_nanoflow_dfs_70b": "+18.6% over NanoFlow-DFS, Llama-3.1-70B",
    "optimal": "86.6% of the practical optimum (90.8% on 70B TP 8); DFS about 72%",
    "sharing": "at least 97% of DFS's prefix sharing",
    "dp": "DP 4: 3.78-3.88x",
}


NOTES = [
    "## Why these numbers differ from the paper's",
    "",
    "- Job size. The paper plans 400k requests; these jobs have 10^3-10^4 (the simulator runs about 10^5 "
    "tokens per wall second). A memory-heavy request needs thousands of output tokens (density < 1 needs "
    "d > ~2.7K on llama-3.1-8b / A100), and its decode is a serial chain of d steps that no order shortens "
    "(`chain_bound_s`). In a small job that chain is a large part of the makespan, so every planner ends near "
    "it and the ratios between planners shrink toward 1; `optimal_fraction` (against T_opt, which ignores "
    "the chain and the weight reads of every step) is far below 86.6%.",
    "- Prefix cache vs prefixes. The shared prefixes (system prompts, 5-shot prefixes: hundreds of tokens) are "
    "small next to the KV pool (~460k tokens on 8B / A100-80GB), so LRU keeps them and input-order planners "
    "lose little sharing; DFS order's sharing advantage is small here.",
    "- One engine for all. `vllm-dfs` and `sglang-dfs` share the scheduler and cost model, so their rows are "
    "equal; every planner's engine has the SGLang-style in-batch prefix check (a group's requests do not "
    "prefill one uncached prefix together). `sglang-lpm` is FCFS until 128 requests remain (SGLang's "
    "fallback), so on an offline job it is close to `fcfs`.",
    "- Overlap mode uses an unfitted interference factor of 1.10 (`perf/overlap.py`); the NanoFlow-vs-vLLM "
    "gap scales with it.",
    "",
]


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) < 1e5 else f"{x:.3g}"
    return str(x)


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return out


def _ratio(rows: list[dict], trace: str, a: str, b: str, experiment: str = "main") -> float | None:
    by = {r["planner"]: r for r in rows if r.get("experiment") == experiment and r["trace"] == trace}
    if a in by and b in by:
        return by[a]["throughput_tokens_per_s"] / by[b]["throughput_tokens_per_s"]
    return None


def write_readme(path: Path, rows: list[dict], scale, quick: bool) -> None:
    main = [r for r in rows if r["experiment"] == "main"]
    cols = [
        "trace",
        "planner",
        "mode",
        "throughput_tokens_per_s",
        "makespan_s",
        "sharing_ratio",
        "optimal_fraction",
        "chain_bound_s",
        "bound_fraction",
    ]
    lines = [
        f"# BlendServe reproduction ({'quick' if quick else 'full'})",
        "",
        f"Simulated (cost model) llama-3.1-8b on one a100-80gb, {scale.num_requests} requests per trace "
        f"(video outputs {scale.video_output_mean_tokens} tokens on average; the paper: 400k requests, 16K). "
        "Throughput = (input + output tokens) / makespan; optimal_fraction = T_opt / makespan with "
        "T_opt = max((1 - s_opt) T_comp, T_mem); chain_bound_s = the longest request's own serial decode "
        "(no order beats it); bound_fraction = max(T_opt, chain bound) / makespan.",
        "",
        "## Main result",
        "",
        *_table(main, cols),
        "",
        "## Ratios beside the paper",
        "",
        "| trace | blendserve / nanoflow-dfs | blendserve / vllm-dfs | blendserve / sglang-lpm | "
        "blendserve sharing / DFS sharing | paper |",
        "|---|---|---|---|---|---|",
    ]
    for trace in sorted({r["trace"] for r in main}):
        by = {r["planner"]: r for r in main if r["trace"] == trace}
        share = by["blendserve"]["sharing_ratio"] / max(by["vllm-dfs"]["sharing_ratio"], 1e-12)
        lines.append(
            f"| {trace} | {_fmt(_ratio(rows, trace, 'blendserve', 'nanoflow-dfs'))} | "
            f"{_fmt(_ratio(rows, trace, 'blendserve', 'vllm-dfs'))} | "
            f"{_fmt(_ratio(rows, trace, 'blendserve', 'sglang-lpm'))} | {_fmt(share)} | "
            f"{PAPER['vs_nanoflow_dfs_8b']}; {PAPER['vs_dfs_sequential']}; {PAPER['sharing']} |"
        )
    r70 = [r for r in rows if r["experiment"] == "70b-tp8"]
    dp = [r for r in rows if r["experiment"] == "data-parallel"]
    grid = [r for r in rows if r["experiment"] == "grid"]
    lines += [
        "",
        f"Paper: {PAPER['optimal']}.",
        "",
        "## llama-3.1-70b, TP 8 on 8 x a100-80gb",
        "",
        *_table(r70, cols),
        "",
        f"Paper: {PAPER['vs_nanoflow_dfs_70b']}; {PAPER['optimal']}.",
        "",
        "## Data parallelism (blendserve, trace1; balanced subtrees, one per replica)",
        "",
        *_table(
            dp, ["data_parallel", "throughput_tokens_per_s", "makespan_s", "speedup", "optimal_fraction"]
        ),
        "",
        f"Paper: {PAPER['dp']}.",
        "",
        "## Density x sharing grid (blendserve vs nanoflow-dfs)",
        "",
        *_table(
            grid,
            ["target_density", "target_sharing", "planner", "throughput_tokens_per_s", "optimal_fraction"],
        ),
        "",
        "![grid](grid_heatmap.png)",
        "",
        "![utilisation](utilisation.png)",
        "",
        *NOTES,
    ]
    path.write_text("\n".join(lines))


def write_grid_heatmap(path: Path, rows: list[dict]) -> None:
    """Heatmap of blendserve / nanoflow-dfs throughput over the density x sharing grid."""
    from kvbalance.metrics.report import _new_figure

    grid = [r for r in rows if r["experiment"] == "grid"]
    dens = sorted({r["target_density"] for r in grid})
    shares = sorted({r["target_sharing"] for r in grid})
    mat = np.full((len(dens), len(shares)), np.nan)
    for i, d in enumerate(dens):
        for j, s in enumerate(shares):
            by = {
                r["planner"]: r["throughput_tokens_per_s"]
                for r in grid
                if r["target_density"] == d and r["target_sharing"] == s
            }
            if "blendserve" in by and "nanoflow-dfs" in by:
                mat[i, j] = by["blendserve"] / by["nanoflow-dfs"]
    fig = _new_figure(6, 4.5)
    ax = fig.subplots()
    im = ax.imshow(mat, origin="lower", cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(shares)), [f"{s:.2f}" for s in shares])
    ax.set_yticks(range(len(dens)), [f"{d:.2f}" for d in dens])
    for i in range(len(dens)):
        for j in range(len(shares)):
            if np.isfinite(mat[i, j]):
                ax.text(j, i, f"{mat[i, j]:.2f}", ha="center", va="center", color="w")
    ax.set_xlabel("prefix sharing ratio")
    ax.set_ylabel("compute density")
    ax.set_title("throughput: blendserve / nanoflow-dfs")
    fig.colorbar(im, ax=ax)
    fig.savefig(path, dpi=100)


def write_utilisation_plot(path: Path, results: dict) -> None:
    """Compute (FLOPs / peak) and memory (bytes / bandwidth) utilisation per step, smoothed, per planner."""
    from kvbalance.metrics.report import _new_figure

    fig = _new_figure(8, 5)
    axes = fig.subplots(2, 1, sharex=True)
    for name, res in results.items():
        if res.compute_util is None or not len(res.compute_util):
            continue
        w = max(1, len(res.compute_util) // 200)
        kernel = np.ones(w) / w
        x = res.step_end_s[: len(res.compute_util) - w + 1]
        axes[0].plot(x, np.convolve(res.compute_util, kernel, mode="valid"), label=name)
        axes[1].plot(x, np.convolve(res.memory_util, kernel, mode="valid"), label=name)
    axes[0].set_ylabel("compute utilisation")
    axes[1].set_ylabel("memory-bandwidth utilisation")
    axes[1].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_title("trace1, llama-3.1-8b / a100-80gb")
    fig.savefig(path, dpi=100)
