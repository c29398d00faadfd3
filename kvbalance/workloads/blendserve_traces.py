"""The BlendServe paper's four offline traces (Zhao et al., arXiv 2411.16102, section 6.1), built as the paper
builds them: three datasets mixed to a target compute density and prefix-sharing ratio, 400,000 requests.

Datasets (one system prompt per dataset, as in the paper; lengths in tokens):

* ``burstgpt`` (chat): BurstGPT (Wang et al., arXiv 2401.17644; HPMLL/BurstGPT ``BurstGPT_1.csv``). Prompt
  lengths log-normal with the BurstGPT rows' log-moments (38 non-failed ChatGPT conversation rows at the head
  of the release: mean 755, log-sd 1.47; responses mean 354, log-sd 0.89). The response-length shape is
  BurstGPT's; its scale is set so the dataset's density is the paper's 17.8 (below).
* ``mmlu`` (compute-heavy): MMLU (Hendrycks et al., arXiv 2009.03300), 57 subjects, each a 5-shot prefix of
  its 5 dev examples (here 700 tokens on average, 0.6-1.4x by subject: an assumption, the paper gives none)
  and a short question (log-normal, mean 80). Answers log-normal (log-sd 0.5), scaled to the paper's 54.9.
* ``openvid`` (memory-heavy): OpenVid-1M captions (Nan et al., arXiv 2407.02371) as prompts (log-normal,
  mean 120: an assumption) and video-token outputs scaled to a 16K mean as the paper does, uniform in
  [0.5, 1.5] x 16K so the longest request (a serial chain of decode steps no order shortens) stays at 24K.

BurstGPT's and MMLU's output scales are set so each dataset's density (BlendServe's rho = sum Comp / sum Mem,
no sharing credited) is the paper's figure, 17.8 and 54.9: those decide how much memory time the compute-heavy
side carries, hence how much is left to blend. Under the cost model's Llama-3.1-8B / A100 constants BurstGPT's
own response lengths give rho 3.2 and 1-4-token MMLU answers about 320, so the paper's densities imply
shorter chat responses (mean ~48) and longer answers (~15); the report prints the calibrated means. OpenVid's
16K mean gives rho 0.086 here against the paper's 0.05 (its F / B constants differ from this cost model's by
about that ratio); a long-output request is memory time almost only either way, so its length, not its
density, is kept. The density formulas belong to ``offline/density.py``: this module takes them as a function
``density_of(prompt_lens, output_lens, sharing)`` and calibrates once on a fixed 20,000-draw sample
(``calibrate_datasets``), so a dataset's lengths do not change with the job size.

Traces, paper numbering: #1 (density 1.4, sharing 35%), #2 (0.9, 35%), #3 (1.4, 5%), #4 (0.9, 5%). A trace is
tuned by two knobs found by bisection: the share of OpenVid requests (density falls with it) and a scale on
the shared prefixes, every dataset's system prompt and MMLU's 5-shot prefixes (sharing grows with it). Every
request carries its dataset's system prompt, as in the paper, so the prefix tree has one subtree per dataset
(and one per MMLU subject under MMLU's): output-length sampling estimates a request from its own dataset. At
5% sharing the scale shrinks the 5-shot prefixes to a few dozen tokens (the paper does not say how it lowers
sharing); the datasets' densities then move a little (``trace_summary`` prints them per trace). Requests appear
in a seeded random order of the three datasets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from kvbalance.request import Request, SamplingParams
from kvbalance.workloads.tokens import SyntheticPrompt

PAPER_NUM_REQUESTS = 400_000  # "at least 400,000 requests" per trace (section 6.1)
BLOCK = 16  # the engine's block size: shared prefixes are named per block
CALIBRATION_DRAWS = 20_000
CALIBRATION_SEED = 12345

DensityFn = Callable[[np.ndarray, np.ndarray, float], float]


@dataclass(frozen=True)
class Dataset:
    """One dataset's length model. ``prompt_*``: log-normal (mean, log-sd) of the request's own prompt
    tokens (past the system prompt). Outputs log-normal with ``output_sigma`` and their mean calibrated to
    ``paper_density``, or, with ``output_mean_tokens`` fixed, uniform in [0.5, 1.5] x that mean."""

    name: str
    kind: str  # the request's kind tag
    source: str
    prompt_mean_tokens: float
    prompt_sigma: float
    output_sigma: float
    paper_density: float
    system_prompt_tokens: int  # before the trace's prefix scale
    output_mean_tokens: float | None = None


DATASETS: dict[str, Dataset] = {
    "burstgpt": Dataset(
        "burstgpt",
        "chat",
        "BurstGPT (arXiv 2401.17644), BurstGPT_1.csv head rows: request log-mean 5.98 log-sd 1.47",
        755.0,
        1.47,
        0.89,
        17.8,
        512,
    ),
    "mmlu": Dataset(
        "mmlu",
        "mmlu",
        "MMLU (arXiv 2009.03300): 57 subjects, 5-shot dev prefixes",
        80.0,
        0.5,
        0.5,
        54.9,
        128,
    ),
    "openvid": Dataset(
        "openvid",
        "video",
        "OpenVid-1M (arXiv 2407.02371) captions; video outputs scaled to a 16K mean as in BlendServe",
        120.0,
        0.5,
        0.0,
        0.05,
        128,
        output_mean_tokens=16384.0,
    ),
}
DATASET_ORDER = ("burstgpt", "mmlu", "openvid")
NUM_SUBJECTS = 57
FEWSHOT_MEAN_TOKENS = 700
MAX_PROMPT_TOKENS = 16384
MAX_OUTPUT_TOKENS = 65536


@dataclass(frozen=True)
class PaperTrace:
    name: str
    number: int
    density: float
    sharing: float


TRACES: dict[str, PaperTrace] = {
    "trace1": PaperTrace("trace1", 1, 1.4, 0.35),
    "trace2": PaperTrace("trace2", 2, 0.9, 0.35),
    "trace3": PaperTrace("trace3", 3, 1.4, 0.05),
    "trace4": PaperTrace("trace4", 4, 0.9, 0.05),
}


@dataclass(frozen=True)
class Calibration:
    """Per-dataset output means (tokens; calibrated for BurstGPT and MMLU, 16K for OpenVid) and the
    densities they give."""

    output_mean_tokens: dict[str, float]
    density: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TraceConfig:
    """A generated trace. ``video_fraction``: share of OpenVid requests; ``mmlu_share``: of the rest."""

    num_requests: int = PAPER_NUM_REQUESTS
    video_fraction: float = 0.02
    mmlu_share: float = 0.35
    prefix_scale: float = 1.0  # multiplies the system prompts and the 5-shot prefixes
    seed: int = 0
    calibration: Calibration | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.num_requests, bool)
            or not isinstance(self.num_requests, int)
            or self.num_requests < 1
        ):
            raise ValueError(f"num_requests: must be an int >= 1, got {self.num_requests!r}")
        for f in ("video_fraction", "mmlu_share"):
            if not 0 <= getattr(self, f) <= 1:
                raise ValueError(f"{f}: must be in [0, 1], got {getattr(self, f)}")
        if not self.prefix_scale >= 0:
            raise ValueError(f"prefix_scale: must be >= 0, got {self.prefix_scale}")


def _lognormal(z: np.ndarray, mean: float, sigma: float) -> np.ndarray:
    return np.exp(np.log(mean) - sigma * sigma / 2 + sigma * z)


@dataclass
class _Draws:
    kind_u: np.ndarray
    subject_u: np.ndarray
    prompt_z: np.ndarray
    output_z: np.ndarray
    output_u: np.ndarray
    shot_u: np.ndarray  # per subject


def _draws(n: int, seed: int) -> _Draws:
    rng = np.random.default_rng(seed)
    return _Draws(
        rng.random(n),
        rng.random(n),
        rng.standard_normal(n),
        rng.standard_normal(n),
        rng.random(n),
        rng.random(NUM_SUBJECTS),
    )


def _own_prompt(ds: Dataset, z: np.ndarray) -> np.ndarray:
    return np.clip(np.round(_lognormal(z, ds.prompt_mean_tokens, ds.prompt_sigma)), 1, MAX_PROMPT_TOKENS)


def _outputs(ds: Dataset, z: np.ndarray, u: np.ndarray, mean: float) -> np.ndarray:
    raw = mean * (0.5 + u) if ds.output_mean_tokens is not None else _lognormal(z, mean, ds.output_sigma)
    return np.clip(np.round(raw), 1, MAX_OUTPUT_TOKENS)


def _fewshot_lens(shot_u: np.ndarray, prefix_scale: float = 1.0) -> np.ndarray:
    return np.round(FEWSHOT_MEAN_TOKENS * (0.6 + 0.8 * shot_u) * prefix_scale).astype(np.int64)


def _bisect(f, lo: float, hi: float, target: float, increasing: bool, iters: int = 50) -> float:
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def calibrate_datasets(density_of: DensityFn) -> Calibration:
    """Each dataset's output scale so its density (``density_of``, no sharing) is the paper's figure."""
    dr = _draws(CALIBRATION_DRAWS, CALIBRATION_SEED)
    means: dict[str, float] = {}
    dens: dict[str, float] = {}
    for name in DATASET_ORDER:
        ds = DATASETS[name]
        p = _own_prompt(ds, dr.prompt_z)
        if name == "mmlu":
            subj = np.minimum((dr.subject_u * NUM_SUBJECTS).astype(int), NUM_SUBJECTS - 1)
            p = p + _fewshot_lens(dr.shot_u)[subj]
        if ds.output_mean_tokens is None:
            means[name] = _bisect(
                lambda x, ds=ds, p=p: density_of(p, _outputs(ds, dr.output_z, dr.output_u, x), 0.0),
                1.0,
                float(MAX_OUTPUT_TOKENS),
                ds.paper_density,
                False,
            )
        else:
            means[name] = ds.output_mean_tokens
        dens[name] = density_of(p, _outputs(ds, dr.output_z, dr.output_u, means[name]), 0.0)
    return Calibration(means, dens)


@dataclass
class TraceShape:
    """Per-request lengths of a trace before token ids are made."""

    dataset: np.ndarray  # index into DATASET_ORDER
    subject: np.ndarray  # MMLU subject (-1: none)
    system_len: np.ndarray  # per dataset (multiples of BLOCK)
    fewshot_len: np.ndarray  # per subject
    prompt_len: np.ndarray
    output_len: np.ndarray


def _system_lens(prefix_scale: float) -> np.ndarray:
    """Each dataset's system prompt: a whole number of blocks (so MMLU's subjects branch on a block edge), at
    least one, so every request sits in its dataset's subtree."""
    base = np.array([DATASETS[n].system_prompt_tokens for n in DATASET_ORDER], dtype=np.float64)
    return (np.maximum(np.round(base * prefix_scale / BLOCK), 1) * BLOCK).astype(np.int64)


def trace_shape(cfg: TraceConfig, draws: _Draws | None = None) -> TraceShape:
    if cfg.calibration is None:
        raise ValueError("calibration: a TraceConfig needs calibrate_datasets(...) before it is built")
    dr = draws or _draws(cfg.num_requests, cfg.seed)
    cal = cfg.calibration
    ds_idx = np.where(dr.kind_u < cfg.video_fraction, 2, 0)
    rest_u = (dr.kind_u - cfg.video_fraction) / max(1 - cfg.video_fraction, 1e-12)
    ds_idx = np.where((ds_idx == 0) & (rest_u < cfg.mmlu_share), 1, ds_idx)
    subject = np.where(
        ds_idx == 1, np.minimum((dr.subject_u * NUM_SUBJECTS).astype(int), NUM_SUBJECTS - 1), -1
    )
    sys_len = _system_lens(cfg.prefix_scale)
    shot = _fewshot_lens(dr.shot_u, cfg.prefix_scale)
    prompt = np.zeros(cfg.num_requests, dtype=np.int64)
    out = np.zeros(cfg.num_requests, dtype=np.int64)
    for k, name in enumerate(DATASET_ORDER):
        m = ds_idx == k
        ds = DATASETS[name]
        own = _own_prompt(ds, dr.prompt_z[m]).astype(np.int64)
        if name == "mmlu":
            own = own + shot[subject[m]]
        prompt[m] = sys_len[k] + own
        out[m] = _outputs(ds, dr.output_z[m], dr.output_u[m], cal.output_mean_tokens[name])
    return TraceShape(ds_idx, subject, sys_len, shot, prompt, out)


def shape_sharing(shape: TraceShape) -> float:
    """DFS sharing of a shape: each dataset's system prompt and each subject's 5-shot blocks computed once."""
    total = float(shape.prompt_len.sum())
    if total == 0:
        return 0.0
    saved = 0.0
    for k in range(len(DATASET_ORDER)):
        n = int((shape.dataset == k).sum())
        if n > 1:
            saved += (n - 1) * int(shape.system_len[k])
    sys_mmlu = int(shape.system_len[1])
    counts = np.bincount(shape.subject[shape.subject >= 0], minlength=NUM_SUBJECTS)
    extra = (sys_mmlu + shape.fewshot_len) // BLOCK * BLOCK - sys_mmlu  # full blocks past the system prompt
    saved += float(np.sum(np.maximum(counts - 1, 0) * extra))
    return saved / total


def shape_density(shape: TraceShape, density_of: DensityFn) -> float:
    return density_of(shape.prompt_len, shape.output_len, shape_sharing(shape))


def tune_trace(cfg: TraceConfig, density_of: DensityFn, density: float, sharing: float) -> TraceConfig:
    """The config nearest ``density`` and ``sharing``: bisect the OpenVid share and the prefix scale in turn."""
    dr = _draws(cfg.num_requests, cfg.seed)
    for _ in range(4):
        cfg = replace(
            cfg,
            prefix_scale=_bisect(
                lambda x, c=cfg: shape_sharing(trace_shape(replace(c, prefix_scale=x), dr)),
                0.0,
                8.0,
                sharing,
                True,
                iters=40,
            ),
        )
        cfg = replace(
            cfg,
            video_fraction=_bisect(
                lambda x, c=cfg: shape_density(trace_shape(replace(c, video_fraction=x), dr), density_of),
                0.0,
                0.5,
                density,
                False,
                iters=40,
            ),
        )
    return cfg


def build_trace(cfg: TraceConfig) -> list[Request]:
    """Requests of a trace: each dataset's system prompt shared by its requests, each MMLU subject's 5-shot
    prefix by the subject's; every other token unique to its request."""
    shape = trace_shape(cfg)
    sys_blocks = [int(s) // BLOCK for s in shape.system_len]
    sys_ids = []
    next_id = 0
    for nb in sys_blocks:
        sys_ids.append(np.arange(next_id, next_id + nb, dtype=np.int64))
        next_id += nb
    shot_ids = []
    for s in range(NUM_SUBJECTS):
        nb = -(-int(shape.fewshot_len[s]) // BLOCK)
        shot_ids.append(np.concatenate([sys_ids[1], np.arange(next_id, next_id + nb, dtype=np.int64)]))
        next_id += nb
    reqs: list[Request] = []
    for i in range(cfg.num_requests):
        k = int(shape.dataset[i])
        plen, out = int(shape.prompt_len[i]), int(shape.output_len[i])
        if k == 1:
            subj = int(shape.subject[i])
            shared = int(shape.system_len[1] + shape.fewshot_len[subj])
            prompt = SyntheticPrompt(plen, i, shot_ids[subj], BLOCK, shared_len=shared)
        elif sys_blocks[k]:
            prompt = SyntheticPrompt(plen, i, sys_ids[k], BLOCK, shared_len=int(shape.system_len[k]))
        else:
            prompt = SyntheticPrompt(plen, i)
        kind = DATASETS[DATASET_ORDER[k]].kind
        req = Request(f"{kind}-{i}", prompt, SamplingParams(max_tokens=out, ignore_eos=True))
        req.meta["kind"] = kind
        req.meta["dataset"] = DATASET_ORDER[k]
        reqs.append(req)
    return reqs


def paper_trace_config(
    name: str,
    density_of: DensityFn,
    num_requests: int = PAPER_NUM_REQUESTS,
    seed: int = 0,
    calibration: Calibration | None = None,
) -> TraceConfig:
    """The tuned config of trace ``name`` (``trace1``..``trace4``, the paper's numbering)."""
    if name not in TRACES:
        raise ValueError(f"trace: unknown {name!r} (known: {', '.join(TRACES)})")
    t = TRACES[name]
    cal = calibration or calibrate_datasets(density_of)
    cfg = TraceConfig(num_requests=num_requests, seed=seed, calibration=cal)
    return tune_trace(cfg, density_of, t.density, t.sharing)


def trace_summary(cfg: TraceConfig, density_of: DensityFn) -> dict:
    """What a trace is made of: per dataset its share of requests, mean lengths and density; the job's."""
    shape = trace_shape(cfg)
    out: dict = {
        "num_requests": cfg.num_requests,
        "video_fraction": cfg.video_fraction,
        "mmlu_share": cfg.mmlu_share,
        "prefix_scale": cfg.prefix_scale,
        "system_prompt_tokens": dict(zip(DATASET_ORDER, shape.system_len.tolist())),
        "dfs_sharing": shape_sharing(shape),
        "density": shape_density(shape, density_of),
        "datasets": {},
    }
    for k, name in enumerate(DATASET_ORDER):
        m = shape.dataset == k
        if not m.any():
            continue
        p, d = shape.prompt_len[m], shape.output_len[m]
        out["datasets"][name] = {
            "requests": int(m.sum()),
            "prompt_mean_tokens": float(p.mean()),
            "output_mean_tokens": float(d.mean()),
            "output_max_tokens": int(d.max()),
            "density_no_sharing": density_of(p, d, 0.0),
            "paper_density": DATASETS[name].paper_density,
        }
    return out
