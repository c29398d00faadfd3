"""Where a cluster's instances sit: GPUs of one preset grouped into nodes, and the links between them.

Two GPUs in the same node talk over the GPU's NVLink (``HardwareSpec.tp_link``: NVLink3 on A100, NVLink4 on
H100/H200); GPUs in different nodes over the node's network (``inter_node_link``, default a 200 Gb/s RDMA
NIC). A transfer costs bytes / bandwidth + latency on the slower of the links it crosses
(``perf.cost.transfer_time``); host memory (the global KV store's tier) is reached over PCIe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbalance.perf.cost import transfer_time
from kvbalance.specs import HardwareSpec, LinkSpec, get_gpu, get_link


@dataclass(frozen=True)
class Topology:
    """``num_gpus`` GPUs of one preset, ``gpus_per_node`` per node (GPU g is on node g // gpus_per_node)."""

    gpu: HardwareSpec
    num_gpus: int
    gpus_per_node: int = 8
    inter_node_link: LinkSpec = field(default_factory=lambda: get_link("net-200g"))
    host_link: LinkSpec = field(default_factory=lambda: get_link("pcie4"))  # GPU <-> host DRAM

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ValueError(f"num_gpus: must be >= 1, got {self.num_gpus}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node: must be >= 1, got {self.gpus_per_node}")

    @classmethod
    def build(
        cls, gpu: str | HardwareSpec, num_gpus: int, gpus_per_node: int = 8, inter_node_link: str = "net-200g"
    ) -> Topology:
        return cls(get_gpu(gpu), num_gpus, gpus_per_node, get_link(inter_node_link))

    @property
    def intra_node_link(self) -> LinkSpec:
        return self.gpu.tp_link

    def node_of(self, gpu_index: int) -> int:
        if not 0 <= gpu_index < self.num_gpus:
            raise ValueError(f"gpu: index {gpu_index} outside 0..{self.num_gpus - 1}")
        return gpu_index // self.gpus_per_node

    def link(self, a: int, b: int) -> LinkSpec:
        """The link between GPUs ``a`` and ``b`` (NVLink inside a node, the network between nodes)."""
        return self.intra_node_link if self.node_of(a) == self.node_of(b) else self.inter_node_link

    def link_between(self, gpus_a: tuple[int, ...], gpus_b: tuple[int, ...]) -> LinkSpec:
        """The slowest link any pair of the two GPU groups crosses (a transfer waits for its slowest shard)."""
        links = [self.link(a, b) for a in gpus_a for b in gpus_b]
        return min(links, key=lambda ln: ln.bandwidth_bytes_s)

    def transfer_s(self, num_bytes: float, gpus_a: tuple[int, ...], gpus_b: tuple[int, ...]) -> float:
        """Time to move ``num_bytes`` from one GPU group to another, sharded over min(len(a), len(b)) pairs."""
        shards = max(1, min(len(gpus_a), len(gpus_b)))
        return transfer_time(num_bytes / shards, self.link_between(gpus_a, gpus_b))
