"""Workloads: arrival processes, length distributions, synthetic prompts with real prefix sharing, trace files.

``build_requests(workload, num_requests, rate, seed, max_context, ...)`` turns a workload string into
``Request``s; ``describe_workload`` exposes the length distributions behind it.
"""

from kvbalance.workloads.arrivals import all_at_zero, arrival_times, constant, gamma, poisson
from kvbalance.workloads.lengths import (
    Empirical,
    Fixed,
    JointLengths,
    LengthDistribution,
    LogNormal,
    PairedLengths,
    Uniform,
)
from kvbalance.workloads.presets import (
    build_requests,
    default_traces_dir,
    describe_workload,
    length_model,
    parse_workload,
)
from kvbalance.workloads.tokens import (
    SHARED_BASE,
    UNIQUE_BASE,
    SyntheticPrompt,
    random_token_prompt,
    shared_prefix_prompt,
    unique_prompt,
)
from kvbalance.workloads.traces import (
    TraceRecord,
    load_azure,
    load_generic,
    load_mooncake,
    load_sharegpt_lengths,
    load_trace,
)

__all__ = [
    "SHARED_BASE",
    "UNIQUE_BASE",
    "Empirical",
    "Fixed",
    "JointLengths",
    "LengthDistribution",
    "LogNormal",
    "PairedLengths",
    "SyntheticPrompt",
    "TraceRecord",
    "Uniform",
    "all_at_zero",
    "arrival_times",
    "build_requests",
    "constant",
    "default_traces_dir",
    "describe_workload",
    "gamma",
    "length_model",
    "load_azure",
    "load_generic",
    "load_mooncake",
    "load_sharegpt_lengths",
    "load_trace",
    "parse_workload",
    "poisson",
    "random_token_prompt",
    "shared_prefix_prompt",
    "unique_prompt",
]
