"""Offline jobs (BlendServe section 5): generated mixes of task types with shared prefixes, the four (density,
sharing) presets for them, and a reader for OpenAI Batch API input files. The paper's own traces, built as it
builds them, are ``workloads/blendserve_traces.py``.

Task types:

* ``chat``: BurstGPT-like conversations (log-normal lengths, about 450 prompt (past the system prompt) / 270 output tokens on average;
  the moments approximate BurstGPT's ChatGPT logs, the trace itself is not in ``shared/traces``), each
  application's system prompt shared by its requests;
* ``mmlu``: MMLU-like 5-shot evaluation, one few-shot prefix per subject (57 subjects), a short question and an
  answer of 1-4 tokens: compute-heavy;
* ``video``: video-token generation, a short unique prompt and thousands of output tokens (16K mean in the
  paper), uniform in [0.5, 1.5] x the mean so the longest request stays a bounded serial chain: memory-heavy.

A job is tuned to a target compute density and prefix-sharing ratio by two knobs found by root finding: the share
of video requests (density) and a scale on the shared prefixes' lengths (sharing). The density of a job is
the planner's business (``offline/density.py``): the tuner takes it as a function ``density_of(prompt_lens,
output_lens, sharing) -> rho`` (``offline.density.job_density_fn``), so this module stays below ``offline``.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from scipy import optimize

from kvbalance.request import Request, SamplingParams
from kvbalance.workloads.tokens import SyntheticPrompt

BLOCK = 16  # identity granularity of shared prefixes (the engine's block size)


@dataclass(frozen=True)
class OfflineJobConfig:
    """A generated job. Fractions are of ``num_requests``; ``video_fraction`` None = tuned to the target."""

    num_requests: int = 2000
    mmlu_share: float = 0.35  # of the non-video requests
    video_fraction: float = 0.01
    prefix_scale: float = 1.0  # multiplies system-prompt and few-shot lengths
    num_apps: int = 64
    system_prompt_tokens: int = 500  # mean, before prefix_scale
    num_subjects: int = 57
    fewshot_tokens: int = 700  # mean, before prefix_scale
    video_output_mean_tokens: int = 16384
    max_output_tokens: int = 65536
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests: must be >= 1, got {self.num_requests}")
        for f in ("mmlu_share", "video_fraction"):
            if not 0 <= getattr(self, f) <= 1:
                raise ValueError(f"{f}: must be in [0, 1], got {getattr(self, f)}")
        if self.prefix_scale < 0:
            raise ValueError(f"prefix_scale: must be >= 0, got {self.prefix_scale}")
        if self.video_output_mean_tokens < 16:
            raise ValueError(f"video_output_mean_tokens: must be >= 16, got {self.video_output_mean_tokens}")


@dataclass
class _Draws:
    """Seeded draws behind a job (uniforms and standard normals), fixed while the knobs move."""

    kind_u: np.ndarray
    group_u: np.ndarray
    len_u: np.ndarray
    out_u: np.ndarray
    group_len_u: np.ndarray
    ans_u: np.ndarray


def _draws(cfg: OfflineJobConfig) -> _Draws:
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    return _Draws(
        rng.random(n),
        rng.random(n),
        rng.standard_normal(n),
        rng.standard_normal(n),
        rng.random(256),
        rng.random(n),
    )


def _lognormal(z: np.ndarray, mean: float, sigma: float) -> np.ndarray:
    """Log-normal with the given mean from standard normals ``z``."""
    return np.exp(np.log(mean) - sigma * sigma / 2 + sigma * z)


@dataclass
class JobShape:
    """Per-request lengths and prefix groups of a job (before token ids are made)."""

    kind: np.ndarray  # 0 chat, 1 mmlu, 2 video
    group: np.ndarray  # prefix group id (-1: none)
    prefix_len: np.ndarray  # shared tokens at the front
    prompt_len: np.ndarray
    output_len: np.ndarray


KINDS = ("chat", "mmlu", "video")


def job_shape(cfg: OfflineJobConfig, draws: _Draws | None = None) -> JobShape:
    dr = draws or _draws(cfg)
    kind = np.where(dr.kind_u < cfg.video_fraction, 2, 0)
    non_video_u = (dr.kind_u - cfg.video_fraction) / max(1 - cfg.video_fraction, 1e-12)
    kind = np.where((kind == 0) & (non_video_u < cfg.mmlu_share), 1, kind)
    app = np.minimum((dr.group_u * cfg.num_apps).astype(int), cfg.num_apps - 1)
    subj = np.minimum((dr.group_u * cfg.num_subjects).astype(int), cfg.num_subjects - 1)
    sys_len = np.round(cfg.system_prompt_tokens * (0.5 + dr.group_len_u[: cfg.num_apps]) * cfg.prefix_scale)
    shot_len = np.round(
        cfg.fewshot_tokens * (0.6 + 0.8 * dr.group_len_u[-cfg.num_subjects :]) * cfg.prefix_scale
    )
    group = np.where(kind == 0, app, np.where(kind == 1, cfg.num_apps + subj, -1))
    prefix = np.where(kind == 0, sys_len[app], np.where(kind == 1, shot_len[subj], 0)).astype(np.int64)
    user = np.where(
        kind == 0,
        _lognormal(dr.len_u, 450, 1.0),
        np.where(kind == 1, _lognormal(dr.len_u, 80, 0.5), _lognormal(dr.len_u, 120, 0.5)),
    )
    prompt = prefix + np.maximum(np.round(user), 1).astype(np.int64)
    out = np.where(
        kind == 0,
        _lognormal(dr.out_u, 270, 0.8),
        np.where(
            kind == 1,
            1 + np.floor(dr.ans_u * 4),
            cfg.video_output_mean_tokens * (0.5 + dr.ans_u),
        ),
    )
    out = np.clip(np.round(out), 1, cfg.max_output_tokens).astype(np.int64)
    return JobShape(kind, group, prefix, prompt, out)


def shape_sharing(shape: JobShape, block_size: int = BLOCK) -> float:
    """DFS sharing ratio of a job shape: each group's full prefix blocks computed once."""
    total = float(shape.prompt_len.sum())
    saved = 0.0
    for g in np.unique(shape.group[shape.group >= 0]):
        m = shape.group == g
        blocks = int(shape.prefix_len[m][0]) // block_size
        saved += (int(m.sum()) - 1) * blocks * block_size
    return saved / total if total else 0.0


DensityFn = Callable[[np.ndarray, np.ndarray, float], float]


def shape_density(shape: JobShape, density_of: DensityFn) -> float:
    return density_of(shape.prompt_len, shape.output_len, shape_sharing(shape))


def crossing(f: Callable[[float], float], lo: float, hi: float, target: float, increasing: bool) -> float:
    """Where ``f`` (monotone on ``[lo, hi]``: ``increasing`` or not) crosses ``target``, by SciPy's Brent
    root finder (a step in ``f``, as a share of sampled requests makes, is found to within its ``xtol``);
    the end of the range that comes nearest where ``f`` stays on one side of ``target``."""
    sign = 1.0 if increasing else -1.0
    at_lo, at_hi = sign * (f(lo) - target), sign * (f(hi) - target)
    if at_lo >= 0:
        return lo
    if at_hi < 0:
        return hi
    return float(optimize.brentq(lambda x: f(x) - target, lo, hi))


def tune_job(
    cfg: OfflineJobConfig, density_of: DensityFn, density: float, sharing: float
) -> OfflineJobConfig:
    """The config nearest ``density`` and ``sharing``: solve for the video share (density falls with it) and
    the prefix scale (sharing grows with it), alternating until both settle."""
    dr = _draws(cfg)
    for _ in range(4):
        cfg = replace(
            cfg,
            prefix_scale=crossing(
                lambda x, c=cfg: shape_sharing(job_shape(replace(c, prefix_scale=x), dr)),
                0.0,
                40.0,
                sharing,
                True,
            ),
        )
        cfg = replace(
            cfg,
            video_fraction=crossing(
                lambda x, c=cfg: shape_density(job_shape(replace(c, video_fraction=x), dr), density_of),
                0.0,
                0.5,
                density,
                False,
            ),
        )
    return cfg


@dataclass(frozen=True)
class TracePreset:
    name: str
    density: float
    sharing: float


# The paper's four (density, sharing) targets in its numbering: #1 (1.4, 35%), #2 (0.9, 35%), #3 (1.4, 5%),
# #4 (0.9, 5%). This generator's mix (chat / MMLU / video, many system prompts) is a small synthetic stand-in
# for tests; the paper's own traces (BurstGPT, MMLU, OpenVid at 400k requests) are in ``blendserve_traces``.
PRESETS = {
    "trace1": TracePreset("trace1", 1.4, 0.35),
    "trace2": TracePreset("trace2", 0.9, 0.35),
    "trace3": TracePreset("trace3", 1.4, 0.05),
    "trace4": TracePreset("trace4", 0.9, 0.05),
}


def build_job(cfg: OfflineJobConfig) -> list[Request]:
    """Requests of a job: synthetic prompts whose leading ``prefix_len`` tokens are shared within a group."""
    shape = job_shape(cfg)
    reqs: list[Request] = []
    ids_of: dict[int, np.ndarray] = {}
    next_id = 0
    for i in range(cfg.num_requests):
        g, pre, plen, out = (
            int(shape.group[i]),
            int(shape.prefix_len[i]),
            int(shape.prompt_len[i]),
            int(shape.output_len[i]),
        )
        if g >= 0 and pre > 0:
            ids = ids_of.get(g)
            if ids is None:
                nb = -(-pre // BLOCK)
                ids = ids_of[g] = np.arange(next_id, next_id + nb, dtype=np.int64)
                next_id += nb
            prompt = SyntheticPrompt(plen, i, ids, BLOCK, shared_len=pre)
        else:
            prompt = SyntheticPrompt(plen, i)
        req = Request(f"{KINDS[shape.kind[i]]}-{i}", prompt, SamplingParams(max_tokens=out, ignore_eos=True))
        req.meta["kind"] = KINDS[shape.kind[i]]
        reqs.append(req)
    return reqs


def preset_job(
    name: str, density_of: DensityFn, num_requests: int = 2000, seed: int = 0, **overrides
) -> list[Request]:
    """The job of preset ``name`` (``trace1``..``trace4``), tuned with ``density_of``."""
    if name not in PRESETS:
        raise ValueError(f"trace: unknown {name!r} (known: {', '.join(PRESETS)})")
    p = PRESETS[name]
    cfg = OfflineJobConfig(num_requests=num_requests, seed=seed, **overrides)
    return build_job(tune_job(cfg, density_of, p.density, p.sharing))


# -- OpenAI Batch input ---------------------------------------------------------------------------------
BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
_WORD = re.compile(r"\w+|[^\w\s]")
_HASH_TOKEN_BASE = 1 << 20  # hash-token ids live above every real vocabulary


def hash_tokenize(text: str) -> list[int]:
    """A deterministic stand-in tokenizer for planning and simulation: one id per word or punctuation mark
    (crc32), so equal text prefixes give equal token prefixes. Real runs use the model's tokenizer."""
    return [_HASH_TOKEN_BASE + zlib.crc32(w.encode("utf-8")) for w in _WORD.findall(text)] or [
        _HASH_TOKEN_BASE
    ]


@dataclass
class BatchLine:
    line_no: int  # 1-based
    custom_id: str | None
    request: Request | None = None
    error: str | None = None  # why the line cannot run (names the field)


@dataclass
class BatchInput:
    lines: list[BatchLine] = field(default_factory=list)

    @property
    def requests(self) -> list[Request]:
        return [ln.request for ln in self.lines if ln.request is not None]

    @property
    def errors(self) -> list[BatchLine]:
        return [ln for ln in self.lines if ln.error is not None]


def _body_text(url: str, body: dict) -> str:
    if url == "/v1/chat/completions":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("body.messages: must be a non-empty list")
        parts = []
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise ValueError(f"body.messages[{j}].content: must be a string")
            parts.append(f"<{m.get('role', 'user')}> {m['content']}")
        return "\n".join(parts)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("body.prompt: must be a non-empty string")
    return prompt


def parse_batch_line(
    text: str, line_no: int, default_max_tokens: int = 256, tokenize=hash_tokenize
) -> BatchLine:
    """One Batch API input line -> a request, or an error naming the field (never an exception)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(line_no, None, error=f"line {line_no}: not valid JSON ({e.msg})")
    if not isinstance(obj, dict):
        return BatchLine(line_no, None, error=f"line {line_no}: must be a JSON object")
    cid = obj.get("custom_id")
    try:
        if not isinstance(cid, str) or not cid:
            raise ValueError("custom_id: must be a non-empty string")
        if obj.get("method") != "POST":
            raise ValueError(f"method: must be 'POST', got {obj.get('method')!r}")
        url = obj.get("url")
        if url not in BATCH_URLS:
            raise ValueError(f"url: must be one of {', '.join(BATCH_URLS)}, got {url!r}")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise ValueError("body: must be a JSON object")
        text_in = _body_text(url, body)
        mt = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise ValueError(f"body.max_tokens: must be an integer >= 1, got {mt!r}")
        req = Request(cid, tokenize(text_in), SamplingParams(max_tokens=mt, ignore_eos=True))
        req.meta["line_no"] = line_no
        return BatchLine(line_no, cid, req)
    except ValueError as e:
        return BatchLine(line_no, cid if isinstance(cid, str) else None, error=f"line {line_no}: {e}")


def read_openai_batch(path: str | Path, default_max_tokens: int = 256, tokenize=hash_tokenize) -> BatchInput:
    """Every line of an OpenAI Batch input file, parsed or with its error (blank lines are skipped)."""
    out = BatchInput()
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, start=1):
            if line.strip():
                out.lines.append(parse_batch_line(line, no, default_max_tokens, tokenize))
    return out
