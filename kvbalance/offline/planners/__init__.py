"""Offline planners, one class per module, each registered in :data:`kvbalance.offline.plan.PLANNERS`."""

from kvbalance.offline.planners import (  # noqa: F401
    blendserve,
    density_balance,
    fcfs,
    nanoflow_balance,
    nanoflow_dfs,
    sglang_dfs,
    sglang_lpm,
    vllm_dfs,
)
