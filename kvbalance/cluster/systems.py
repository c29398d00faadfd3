"""Serving systems as cluster configs for one GPU budget, and the SLO-rate search that sizes them.

* ``vllm``: today's vLLM: colocated data-parallel instances with prefix caching and chunked prefill (the
  ``sarathi`` policy, vLLM v1's default), one per GPU (TP 1), behind a router; reported under the best of its
  routers for the workload (``VLLM_ROUTERS``), never a weak one; ``vllm-round-robin`` and
  ``vllm-cache-aware`` name the router.
* ``vllm-v0``: vLLM as BanaServe's paper ran it (2024): no chunked prefill (the ``vllm`` policy: whole
  prompts first, prefill-first), the ``vllm-v0`` engine profile (host work serial with the GPU), best router;
  ``vllm-v0-round-robin`` and ``vllm-v0-cache-aware`` name the router.
* ``distserve``: a static prefill/decode split chosen as DistServe does: enumerate the splits and each
  phase's parallelism for the GPU budget and keep the one with the highest rate at which 90% of requests
  meet both the TTFT and the TPOT SLO (``max_rate_at_slo``).
* ``banaserve``: DistServe's split plus the global KV store, load-aware routing and the adaptive migration
  as this project changed it: role flips (``cluster/role_flip.py``: whole instances between prefill and
  decode as the mix shifts) in place of the layer- and attention-level moves, which are kept once landed
  and, measured on a phase-shifting load, cost SLO attainment (0.74 with flips and moves against 0.89 with
  flips alone, llama-13b, 4P + 4D, 36 req/s); ``banaserve-paper`` is the algorithm as published (layer- and
  attention-level moves only, ``cluster/adaptive.py`` defaults); ``banaserve-no-migration`` neither.
* ablations: ``banaserve-no-store`` (split + load-aware routing + migration, local prefix caches only) and
  ``banaserve-cache-aware`` (split + store + sgl-router's cache-aware routing, no migration).
* ``llumnix``: ``vllm``'s colocated instances (one per GPU) dispatched to the freest instance, with Llumnix's
  request-level live migration between them (``cluster/llumnix.py``, its default thresholds).
* ``kvbalance``: this project's policy: colocated instances (chunked prefill) sharing the global KV store,
  routed by ``store_aware`` (least work, plus what fetching a prefix that is not local costs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from kvbalance.cluster.adaptive import MigrationSection
from kvbalance.cluster.config import ClusterConfig, InstanceGroup, StoreSection
from kvbalance.cluster.llumnix import LlumnixSection

SYSTEMS = (
    "vllm",
    "vllm-round-robin",
    "vllm-cache-aware",
    "vllm-v0",
    "vllm-v0-round-robin",
    "vllm-v0-cache-aware",
    "distserve",
    "llumnix",
    "banaserve",
    "banaserve-paper",
    "banaserve-no-migration",
    "banaserve-no-store",
    "banaserve-cache-aware",
    "kvbalance",
)
NOT_YET: dict[str, str] = {}
VLLM_ROUTERS = ("round_robin", "least_loaded", "cache_aware", "kv_aware")
VLLM_V0 = {"policy": "vllm", "engine": "vllm-v0"}  # no chunked prefill, host work serial with the GPU
# systems that are vLLM under a named router (the others of the family take the best router found)
NAMED_ROUTER = {"vllm-round-robin": "round_robin", "vllm-cache-aware": "cache_aware",
                "vllm-v0-round-robin": "round_robin", "vllm-v0-cache-aware": "cache_aware"}  # fmt: skip


def vllm_config(
    num_gpus: int, router: str = "least_loaded", tp: int = 1, *, v0: bool = False
) -> ClusterConfig:
    if num_gpus % tp:
        raise ValueError(f"tp: {tp} does not divide the GPU budget {num_gpus}")
    return ClusterConfig(
        instances=[InstanceGroup(role="colocated", count=num_gpus // tp, tp=tp)],
        router=router,
        **(VLLM_V0 if v0 else {}),
    )


def pd_config(
    num_prefill: int, num_decode: int, tp_prefill: int = 1, tp_decode: int = 1, *, router: str = "least_loaded",
    store: bool = False, layerwise_transfer: bool = True, migration: bool | MigrationSection = False,
) -> ClusterConfig:  # fmt: skip
    if migration is True:
        migration = MigrationSection()
    return ClusterConfig(
        instances=[
            InstanceGroup(role="prefill", count=num_prefill, tp=tp_prefill),
            InstanceGroup(role="decode", count=num_decode, tp=tp_decode),
        ],
        router=router,
        store=StoreSection() if store else None,
        layerwise_transfer=layerwise_transfer,
        migration=migration or None,
    )


def distserve_splits(num_gpus: int, tps: tuple[int, ...] = (1, 2)) -> Iterator[tuple[int, int, int, int]]:
    """Every (prefill instances, decode instances, prefill TP, decode TP) that uses the whole GPU budget."""
    for tp_p in tps:
        for tp_d in tps:
            for p in range(1, num_gpus // tp_p):
                rest = num_gpus - p * tp_p
                if rest > 0 and rest % tp_d == 0:
                    yield p, rest // tp_d, tp_p, tp_d


BANASERVE_MIGRATION = MigrationSection(role_flip=True, moves=False)  # role flips in place of the moves


def system_config(
    system: str, num_gpus: int, split: tuple[int, int, int, int], router: str | None = None
) -> ClusterConfig:
    """The cluster config of ``system`` on ``num_gpus`` GPUs (``split``: DistServe's chosen split; ``router``:
    the router a ``vllm``/``vllm-v0`` system runs, its best one for the workload)."""
    if system in NOT_YET:
        raise ValueError(f"system: {system!r} cannot run yet: {NOT_YET[system]}")
    p, d, tp_p, tp_d = split
    if system in ("vllm", "vllm-v0"):
        return vllm_config(num_gpus, router or "least_loaded", v0=system == "vllm-v0")
    if system in NAMED_ROUTER:
        return vllm_config(num_gpus, NAMED_ROUTER[system], v0=system.startswith("vllm-v0"))
    if system == "distserve":
        return pd_config(p, d, tp_p, tp_d, router=router or "least_loaded")
    if system == "banaserve":
        return pd_config(p, d, tp_p, tp_d, router="load_aware", store=True, migration=BANASERVE_MIGRATION)
    if system in ("banaserve-paper", "banaserve-no-migration"):
        return pd_config(
            p, d, tp_p, tp_d, router="load_aware", store=True, migration=system == "banaserve-paper"
        )
    if system == "banaserve-no-store":
        return pd_config(p, d, tp_p, tp_d, router="load_aware", migration=BANASERVE_MIGRATION)
    if system == "banaserve-cache-aware":
        return pd_config(p, d, tp_p, tp_d, router="cache_aware", store=True)
    if system == "llumnix":
        cfg = vllm_config(num_gpus, router or "llumnix")
        return cfg.model_copy(update={"llumnix": LlumnixSection()})
    if system == "kvbalance":
        return ClusterConfig(
            instances=[InstanceGroup(role="colocated", count=num_gpus)],
            router="store_aware",
            store=StoreSection(),
        )
    raise ValueError(f"system: unknown {system!r} (known: {', '.join(SYSTEMS)})")


def max_rate_at_slo(
    attainment: Callable[[float], float], start_rps: float, *, target: float = 0.9, iters: int = 6,
    max_doublings: int = 8,
) -> tuple[float, list[tuple[float, float]]]:  # fmt: skip
    """Highest rate whose SLO attainment is >= ``target`` (DistServe's goodput), by doubling then bisection.

    Assumes attainment falls with the rate. Returns the rate (0.0 if even ``start_rps / 2**max_doublings``
    misses the target) and every (rate, attainment) probed, for plots.
    """
    probes: list[tuple[float, float]] = []

    def probe(r: float) -> bool:
        a = attainment(r)
        probes.append((r, a))
        return a >= target

    lo, hi = 0.0, math.inf
    r = start_rps
    for _ in range(max_doublings):
        if probe(r):
            lo = r
            if hi < math.inf:
                break
            r *= 2
        else:
            hi = r
            if lo > 0:
                break
            r /= 2
    if lo == 0.0 or hi == math.inf:
        return lo, probes
    for _ in range(iters):
        mid = (lo + hi) / 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes
