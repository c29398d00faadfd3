"""Named workloads -> lists of ``Request``: synthetic length presets and trace replays, seeded and reproducible.

``build_requests`` is the entry point; ``describe_workload`` exposes the length distributions behind a preset
(the queueing-theory module needs them for E[g(s, o)]). Workload strings:

- ``sharegpt``: lognormal fits to the vLLM paper's filtered ShareGPT (input mean 161 / median 35, output mean
  338 / median 271), clipped so input + output <= min(max_context, 2048).
- ``sharegpt-trace``: (input, output) pairs drawn with replacement from the vLLM artifact's lengths CSV.
- ``alpaca``: lognormal, input mean 19.3 / median 17, output mean 58.5 / median 40 (the medians are our guess;
  the means are Alpaca's), clipped to max_context.
- ``longbench``: input lognormal mean 9000 / median 7000 clipped to [1000, max_context - output], output
  uniform 32..512; inputs give way so that input + output <= max_context (truncation by design).
- ``uniform:A-B:C-D``, ``fixed:S:O``: inputs and outputs exactly as asked (too long ones are the engine's to
  reject, never dropped here).
- ``prefix:G:K:A-B:C-D``: G groups each sharing a K-token system prompt (group drawn uniformly), a unique
  question of A..B tokens, output C..D.
- ``docqa:...``, ``chat:...`` (shared documents, multi-turn conversations: ``workloads/reuse.py``) and
  ``phases:...``, ``bursts:...`` (mix or rate changing over time: ``workloads/phases.py``), and their named
  presets (``docqa-zipf``, ``chat``, ``phases-15``, ...).
- ``mooncake:PATH`` (or ``mooncake`` for the shared trace), ``azure:PATH``, ``trace:PATH`` (CSV/JSONL; a
  ShareGPT lengths CSV works too): the trace's own arrival times times ``time_scale`` (``rate`` is used only
  when the trace has no times), in arrival order, the first ``num_requests`` (None = all).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvbalance.request import Request, SamplingParams
from kvbalance.workloads import phases, reuse
from kvbalance.workloads.arrivals import arrival_times
from kvbalance.workloads.lengths import (
    Fixed,
    JointLengths,
    LogNormal,
    PairedLengths,
    Uniform,
)
from kvbalance.workloads.tokens import (
    MOONCAKE_BLOCK_TOKENS,
    SyntheticPrompt,
    shared_prefix_prompt,
    unique_prompt,
)
from kvbalance.workloads.traces import TraceRecord, load_trace

SHAREGPT_FILTER_TOKENS = 2048  # the vLLM paper kept ShareGPT pairs with input + output < 2048
SHAREGPT_LENGTHS_CSV = "sharegpt_opt_lengths_filtered2048.csv"
MOONCAKE_TRACE = "mooncake_conversation_trace.jsonl"
NATURAL_MAX_CONTEXT = {"sharegpt": 2048, "alpaca": 2048, "longbench": 32768}
SYNTHETIC = ("sharegpt", "sharegpt-trace", "alpaca", "longbench", "uniform", "fixed", "prefix")
TRACES = ("mooncake", "azure", "trace")
# workload families in their own modules: kind or preset name -> module with parse / lengths / build
FAMILIES = {name: mod for mod in (reuse, phases) for name in (*mod.KINDS, *mod.PRESETS)}


def default_traces_dir() -> Path:
    """``$KVBALANCE_TRACES``, else ``shared/traces`` beside the repository."""
    env = os.environ.get("KVBALANCE_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces"


@dataclass(frozen=True)
class WorkloadSpec:
    """A parsed workload string: ``kind`` plus its integer parameters or trace path."""

    kind: str
    params: tuple[int, ...] = ()
    path: Path | None = None
    options: object = None  # a FAMILIES workload's parsed options
    text: str = ""  # the workload string (FAMILIES workloads, for their error messages)


def _range(workload: str, text: str, what: str) -> tuple[int, int]:
    parts = text.split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise ValueError(f"workload: {what} in {workload!r} must be N or A-B with 1 <= A <= B, got {text!r}")
    return lo, hi


def parse_workload(workload: str) -> WorkloadSpec:
    """Parse a workload string (see the module docstring) or raise ValueError naming ``workload``."""
    if not isinstance(workload, str) or not workload:
        raise ValueError(f"workload: expected a non-empty string, got {workload!r}")
    kind, _, rest = workload.partition(":")
    if kind in FAMILIES:
        return WorkloadSpec(kind, options=FAMILIES[kind].parse(workload), text=workload)
    if kind in ("sharegpt", "sharegpt-trace", "alpaca", "longbench"):
        if rest:
            raise ValueError(f"workload: {kind!r} takes no parameters, got {workload!r}")
        return WorkloadSpec(kind)
    if kind == "uniform":
        parts = rest.split(":")
        if len(parts) != 2:
            raise ValueError(f"workload: expected 'uniform:A-B:C-D', got {workload!r}")
        return WorkloadSpec(kind, _range(workload, parts[0], "input") + _range(workload, parts[1], "output"))
    if kind == "fixed":
        parts = rest.split(":")
        if len(parts) != 2 or "-" in rest:
            raise ValueError(f"workload: expected 'fixed:S:O', got {workload!r}")
        return WorkloadSpec(
            kind, (_range(workload, parts[0], "input")[0], _range(workload, parts[1], "output")[0])
        )
    if kind == "prefix":
        parts = rest.split(":")
        if len(parts) != 4:
            raise ValueError(f"workload: expected 'prefix:G:K:A-B:C-D', got {workload!r}")
        groups = _range(workload, parts[0], "groups")[0]
        try:
            system = int(parts[1])
        except ValueError:
            system = -1
        if system < 0:
            raise ValueError(
                f"workload: system prompt tokens in {workload!r} must be an int >= 0, got {parts[1]!r}"
            )
        q = _range(workload, parts[2], "question")
        o = _range(workload, parts[3], "output")
        return WorkloadSpec(kind, (groups, system) + q + o)
    if kind in TRACES:
        if not rest:
            if kind == "mooncake":
                return WorkloadSpec(kind, path=default_traces_dir() / MOONCAKE_TRACE)
            raise ValueError(f"workload: expected '{kind}:PATH', got {workload!r}")
        return WorkloadSpec(kind, path=Path(rest))
    raise ValueError(
        f"workload: unknown workload {workload!r}; expected sharegpt, sharegpt-trace, alpaca, longbench, "
        "uniform:A-B:C-D, fixed:S:O, prefix:G:K:A-B:C-D, docqa:..., chat:..., phases:..., bursts:... (or a preset: "
        f"{', '.join(n for n in FAMILIES if n not in ('docqa', 'chat', 'phases', 'bursts'))}), mooncake:PATH, "
        "azure:PATH or trace:PATH"
    )


def _check_max_context(max_context: int) -> int:
    if isinstance(max_context, bool) or not isinstance(max_context, (int, np.integer)) or max_context < 2:
        raise ValueError(f"max_context: must be an int >= 2 tokens, got {max_context!r}")
    return int(max_context)


def _sharegpt_trace_path() -> Path:
    path = default_traces_dir() / SHAREGPT_LENGTHS_CSV
    if not path.is_file():
        raise ValueError(f"workload: sharegpt-trace needs {path} (set KVBALANCE_TRACES to its folder)")
    return path


def _load_records(spec: WorkloadSpec) -> list[TraceRecord]:
    fmt = {"mooncake": "mooncake", "azure": "azure", "trace": "auto"}[spec.kind]
    assert spec.path is not None
    return _load_cached(spec.path, fmt)


def _load_cached(path: Path, fmt: str) -> list[TraceRecord]:
    """load_trace, memoised on (path, size, mtime) so repeated runs over one trace parse it once."""
    try:
        st = path.stat()
    except OSError:
        return load_trace(path, fmt)  # reports the missing file
    return list(_load_keyed(str(path.resolve()), fmt, st.st_size, st.st_mtime_ns))


@lru_cache(maxsize=8)
def _load_keyed(path: str, fmt: str, size: int, mtime_ns: int) -> tuple[TraceRecord, ...]:
    return tuple(load_trace(path, fmt))


@lru_cache(maxsize=1)
def _sharegpt_fits() -> tuple[LogNormal, LogNormal]:
    top = SHAREGPT_FILTER_TOKENS - 1
    return LogNormal.fit_clipped(161.0, 35.0, 1, top), LogNormal.fit_clipped(338.0, 271.0, 1, top)


def length_model(spec: WorkloadSpec, max_context: int | None = None) -> JointLengths | PairedLengths:
    """The (input, output) length model of a parsed workload; ``build_requests`` samples from exactly this."""
    kind = spec.kind
    if max_context is None:
        max_context = NATURAL_MAX_CONTEXT.get(kind, 1 << 20)
    cap = _check_max_context(max_context)
    if spec.options is not None:
        return FAMILIES[kind].lengths(spec.options, cap)
    if kind == "sharegpt":
        # fitted at the paper's 2048 filter so the clipped means are 161 / 338; medians are unaffected
        top = SHAREGPT_FILTER_TOKENS - 1
        fin, fout = _sharegpt_fits()
        total = min(cap, SHAREGPT_FILTER_TOKENS)
        inp = LogNormal(fin.mu, fin.sigma, 1, min(top, total - 1))
        out = LogNormal(fout.mu, fout.sigma, 1, min(top, total - 1))
        return JointLengths(inp, out, total, truncate="output")
    if kind == "alpaca":
        inp = LogNormal.from_mean_median(19.3, 17.0, 1, cap - 1)
        out = LogNormal.from_mean_median(58.5, 40.0, 1, cap - 1)
        return JointLengths(inp, out, cap, truncate="output")
    if kind == "longbench":
        out_hi = min(512, cap // 2)
        out = Uniform(min(32, out_hi), out_hi)
        inp = LogNormal.from_mean_median(9000.0, 7000.0, min(1000, cap - out_hi), cap - out.lo)
        return JointLengths(inp, out, cap, truncate="input")
    if kind == "uniform":
        a, b, c, d = spec.params
        return JointLengths(Uniform(a, b), Uniform(c, d))
    if kind == "fixed":
        return JointLengths(Fixed(spec.params[0]), Fixed(spec.params[1]))
    if kind == "prefix":
        _, system, a, b, c, d = spec.params
        return JointLengths(Uniform(system + a, system + b), Uniform(c, d))
    if kind == "sharegpt-trace":
        records = _load_cached(_sharegpt_trace_path(), "sharegpt")
    else:
        records = _load_records(spec)
    if not records:
        raise ValueError(f"workload: trace {spec.path} has no records")
    return PairedLengths([r.input_len for r in records], [r.output_len for r in records])


def describe_workload(workload: str, max_context: int | None = None) -> dict:
    """The length distributions of a workload, as objects with exact pmfs.

    Returns ``{"input": dist, "output": dist, "lengths": model, "max_total_tokens": cap or None}`` where
    ``model.expect(g)`` is the exact E[g(s, o)] of the pairs ``build_requests`` draws (caps applied). Pass the
    ``max_context`` you give ``build_requests``; None means the preset's natural one (sharegpt and alpaca
    2048, longbench 32768). Trace workloads are described by their observed pairs.
    """
    model = length_model(parse_workload(workload), max_context)
    return {
        "input": model.input,
        "output": model.output,
        "lengths": model,
        "max_total_tokens": model.max_total_tokens,
    }


def _check_args(num_requests: int | None, rate: float, time_scale: float) -> None:
    if num_requests is not None and (
        isinstance(num_requests, bool) or not isinstance(num_requests, (int, np.integer)) or num_requests < 0
    ):
        raise ValueError(f"num_requests: must be an int >= 0 or None, got {num_requests!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or math.isnan(rate) or rate <= 0:
        raise ValueError(f"rate: must be > 0 requests/s (inf = all at time 0), got {rate!r}")
    if not isinstance(time_scale, (int, float)) or not math.isfinite(time_scale) or time_scale <= 0:
        raise ValueError(f"time_scale: must be a finite number > 0, got {time_scale!r}")


def _request(index: int, prompt: SyntheticPrompt, output_len: int, arrival_s: float) -> Request:
    req = Request(
        f"r{index:06d}",
        prompt,
        SamplingParams(max_tokens=max(int(output_len), 1), ignore_eos=True),
        arrival_s=float(arrival_s),
    )
    if output_len < 1:  # a trace's zero-token output: the prefill still samples one token
        req.meta["trace_output_len"] = int(output_len)
    return req


def build_requests(
    workload: str,
    num_requests: int | None,
    rate: float,
    seed: int,
    max_context: int,
    arrival: str = "poisson",
    cv: float = 1.0,
    time_scale: float = 1.0,
    *,
    uid_offset: int = 0,
) -> list[Request]:
    """Requests of ``workload`` sorted by arrival, ids ``r000000``, ``r000001``, ...

    Prompts are ``SyntheticPrompt``s (uid = ``uid_offset`` + index; give disjoint offsets to streams merged
    into one cluster). ``rate`` (requests/s, inf = all at 0) with ``arrival`` (poisson, gamma with ``cv``,
    constant) times synthetic workloads and traces without times. Same arguments -> identical requests.
    """
    spec = parse_workload(workload)
    _check_args(num_requests, rate, time_scale)
    cap = _check_max_context(max_context)
    if spec.options is not None:
        if num_requests is None:
            raise ValueError(f"num_requests: the synthetic workload {workload!r} needs a count, got None")
        return FAMILIES[spec.kind].build(
            spec.options, workload, num_requests, rate, seed, cap, arrival, cv, uid_offset=uid_offset
        )
    len_seq, arr_seq, prompt_seq = np.random.SeedSequence(seed).spawn(3)
    len_rng, arr_rng, prompt_rng = (np.random.default_rng(s) for s in (len_seq, arr_seq, prompt_seq))

    if spec.kind in TRACES:
        records = _load_records(spec)
        if records and records[0].arrival_s is not None:
            order = sorted(range(len(records)), key=lambda i: records[i].arrival_s)  # stable
            records = [records[i] for i in order]
            if num_requests is not None:
                records = records[:num_requests]
            times = np.array([r.arrival_s for r in records], dtype=np.float64) * time_scale
        else:
            if num_requests is not None:
                records = records[:num_requests]
            times = arrival_times(arrival, rate, len(records), arr_rng, cv)
        out = []
        for i, (r, t) in enumerate(zip(records, times)):
            uid = uid_offset + i
            if r.hash_ids:
                prompt = SyntheticPrompt(r.input_len, uid, r.hash_ids, MOONCAKE_BLOCK_TOKENS)
            else:
                prompt = unique_prompt(uid, r.input_len)
            out.append(_request(i, prompt, r.output_len, t))
        return out

    if num_requests is None:
        raise ValueError(f"num_requests: the synthetic workload {workload!r} needs a count, got None")
    model = length_model(spec, cap)
    inputs, outputs = model.sample(len_rng, num_requests)
    times = arrival_times(arrival, rate, num_requests, arr_rng, cv)
    if spec.kind == "prefix":
        groups, system = spec.params[:2]
        group_ids = prompt_rng.integers(0, groups, size=num_requests)
        prompts = [
            shared_prefix_prompt(int(g), system, int(s) - system, uid_offset + i)
            for i, (g, s) in enumerate(zip(group_ids, inputs))
        ]
    else:
        prompts = [unique_prompt(uid_offset + i, int(s)) for i, s in enumerate(inputs)]
    return [_request(i, p, int(o), t) for i, (p, o, t) in enumerate(zip(prompts, outputs, times))]
