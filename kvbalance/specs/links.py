"""Point-to-point links (``LinkSpec``): NVLink, PCIe and network presets, bandwidth per direction and latency."""

from __future__ import annotations

from dataclasses import dataclass

from kvbalance.specs.lookup import _lookup


@dataclass(frozen=True)
class LinkSpec:
    """A point-to-point link: bandwidth in one direction and a per-transfer latency."""

    name: str
    bandwidth_bytes_s: float
    latency_s: float = 0.0
    note: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_s > 0:
            raise ValueError(
                f"bandwidth_bytes_s: must be > 0, got {self.bandwidth_bytes_s!r} (link {self.name!r})"
            )
        if self.latency_s < 0:
            raise ValueError(f"latency_s: must be >= 0, got {self.latency_s!r} (link {self.name!r})")


LINKS: dict[str, LinkSpec] = {
    lk.name: lk
    for lk in [
        LinkSpec(
            "nvlink", 300e9, 8e-6, "A100 NVLink3: 600 GB/s bidirectional per GPU -> 300 GB/s per direction"
        ),
        LinkSpec(
            "nvlink4",
            450e9,
            8e-6,
            "H100/H200 NVLink4: 900 GB/s bidirectional per GPU -> 450 GB/s per direction",
        ),
        LinkSpec("pcie4", 25e9, 10e-6, "PCIe 4.0 x16: 32 GB/s per direction nominal, ~25 GB/s achieved"),
        LinkSpec("pcie5", 50e9, 10e-6, "PCIe 5.0 x16: 64 GB/s per direction nominal, ~50 GB/s achieved"),
        LinkSpec("net-100g", 12.5e9, 10e-6, "100 Gb/s NIC (RDMA): 12.5 GB/s"),
        LinkSpec("net-200g", 25e9, 10e-6, "200 Gb/s NIC (RDMA): 25 GB/s"),
        LinkSpec("net-400g", 50e9, 10e-6, "400 Gb/s NIC (RDMA): 50 GB/s"),
    ]
}


def get_link(name: str | LinkSpec) -> LinkSpec:
    """Preset by name (case-insensitive). A LinkSpec passes through."""
    if isinstance(name, LinkSpec):
        return name
    return _lookup(LINKS, {"nvlink3": "nvlink"}, "link", name)


def list_links() -> list[str]:
    return list(LINKS)
