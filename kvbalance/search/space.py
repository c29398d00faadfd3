"""The deployments a search enumerates: GPU type and count, tensor parallelism, colocated or disaggregated
with every prefill:decode split, scheduler, chunk size and batch cap; each becomes a cluster config.

A colocated deployment is ``count`` identical instances of ``tp`` GPUs; a disaggregated one is ``p``
prefill instances of ``tp_p`` GPUs and ``d`` decode instances of ``tp_d`` GPUs using the whole budget
(``pd_splits``: DistServe's splits, including those whose prefill TP does not divide the budget). A deployment that cannot hold the model's
weights plus one request of the longest context is ``infeasible`` (found once per GPU, TP, scheduler).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MODES = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Deployment:
    """One candidate: ``groups`` = ((role, count, tp), ...) on ``gpu``, with one scheduler config."""

    gpu: str
    groups: tuple[tuple[str, int, int], ...]
    policy: str = "sarathi"
    chunk_size: int = 512
    max_num_seqs: int = 256

    @property
    def num_gpus(self) -> int:
        return sum(count * tp for _, count, tp in self.groups)

    @property
    def mode(self) -> str:
        return "disaggregated" if any(role == "prefill" for role, _, _ in self.groups) else "colocated"

    @property
    def name(self) -> str:
        layout = "+".join(
            f"{c}{role[0].upper()}" + (f"tp{tp}" if tp > 1 else "") for role, c, tp in self.groups
        )
        sched = f"{self.policy}{self.chunk_size}" if self.policy == "sarathi" else self.policy
        return f"{self.gpu}:{layout}:{sched}:cap{self.max_num_seqs}"

    def cluster_config(self, router: str = "least_loaded"):
        from kvbalance.cluster.config import ClusterConfig, InstanceGroup

        return ClusterConfig(
            instances=[InstanceGroup(role=role, count=c, tp=tp) for role, c, tp in self.groups],
            router=router,
        )

    def sim_fields(self) -> dict[str, Any]:
        """The ``SimulateConfig`` fields this deployment sets (the rest come from the search settings)."""
        return {"gpu": self.gpu, "policy": self.policy, "chunk_size": self.chunk_size,
                "max_num_seqs": self.max_num_seqs}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups"] = [list(g) for g in self.groups]
        return d | {"name": self.name, "num_gpus": self.num_gpus, "mode": self.mode}


def schedulers(
    policies: Sequence[str], chunk_sizes: Sequence[int], batch_caps: Sequence[int]
) -> list[tuple[str, int, int]]:
    """(policy, chunk, cap) combinations; ``vllm`` runs whole prompts, so it takes one chunk value only."""
    out = []
    for policy in policies:
        chunks = chunk_sizes if policy == "sarathi" else chunk_sizes[:1]
        for chunk in chunks:
            for cap in batch_caps:
                out.append((policy, int(chunk), int(cap)))
    return out


def pd_splits(num_gpus: int, tps: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """Every (prefill instances, decode instances, prefill TP, decode TP) using exactly ``num_gpus`` GPUs."""
    out = []
    for tp_p in tps:
        for tp_d in tps:
            for p in range(1, num_gpus // tp_p + 1):
                rest = num_gpus - p * tp_p
                if rest > 0 and rest % tp_d == 0:
                    out.append((p, rest // tp_d, tp_p, tp_d))
    return out


def layouts(
    num_gpus: int, tps: Sequence[int], modes: Iterable[str]
) -> list[tuple[tuple[str, int, int], ...]]:
    """Every instance layout on exactly ``num_gpus`` GPUs: colocated per TP, disaggregated per split."""
    out: list[tuple[tuple[str, int, int], ...]] = []
    modes = set(modes)
    if "colocated" in modes:
        for tp in tps:
            if num_gpus % tp == 0:
                out.append((("colocated", num_gpus // tp, tp),))
    if "disaggregated" in modes and num_gpus >= 2:
        for p, d, tp_p, tp_d in pd_splits(num_gpus, tps):
            out.append((("prefill", p, tp_p), ("decode", d, tp_d)))
    return out


def enumerate_deployments(
    gpus: Sequence[str],
    max_gpus: int,
    *,
    tps: Sequence[int] = (1, 2, 4, 8),
    modes: Sequence[str] = MODES,
    policies: Sequence[str] = ("sarathi",),
    chunk_sizes: Sequence[int] = (512,),
    batch_caps: Sequence[int] = (256,),
    min_gpus: int = 1,
) -> list[Deployment]:
    """The cartesian space, in a fixed order (GPU, GPU count, layout, scheduler)."""
    if max_gpus < 1 or min_gpus < 1 or min_gpus > max_gpus:
        raise ValueError(f"max_gpus: need 1 <= min_gpus ({min_gpus}) <= max_gpus ({max_gpus})")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"modes: unknown {m!r} (known: {', '.join(MODES)})")
    for tp in tps:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tps: must be positive integers, got {tp!r}")
    scheds = schedulers(policies, chunk_sizes, batch_caps)
    out = []
    for gpu in gpus:
        for n in range(min_gpus, max_gpus + 1):
            for groups in layouts(n, tps, modes):
                for policy, chunk, cap in scheds:
                    out.append(Deployment(gpu, groups, policy, chunk, cap))
    return out
