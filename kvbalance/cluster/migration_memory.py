"""GPU memory ledger for migrations: what each GPU holds (weights, KV) and what a move has reserved.

A move reserves room on the destination when it starts (its bytes land there during the copy) and,
when it finishes, the destination owns them and the source frees the same bytes: the total over both
GPUs is conserved, and no GPU ever holds more than its capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class GPUMemory:
    """One GPU's memory (bytes). ``reserved_bytes``: a move's destination room, landing, not yet owned."""

    capacity_bytes: int
    weight_bytes: int = 0
    kv_bytes: int = 0
    reserved_bytes: int = 0

    def __post_init__(self) -> None:
        for f in ("capacity_bytes", "weight_bytes", "kv_bytes", "reserved_bytes"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f}: must be >= 0, got {getattr(self, f)}")
        if self.used_bytes > self.capacity_bytes:
            raise ValueError(f"capacity_bytes: {self.capacity_bytes} < {self.used_bytes} bytes in use")

    @property
    def used_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.reserved_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


def reserve_move(dst: GPUMemory, weight_bytes: int, kv_bytes: int) -> GPUMemory:
    """The destination reserves room for a move when it starts."""
    if min(weight_bytes, kv_bytes) < 0:
        raise ValueError(f"weight_bytes / kv_bytes: must be >= 0, got {weight_bytes} / {kv_bytes}")
    need = weight_bytes + kv_bytes
    if need > dst.free_bytes:
        raise ValueError(f"dst: needs {need} bytes for the move, has {dst.free_bytes} free")
    return replace(dst, reserved_bytes=dst.reserved_bytes + need)


def commit_move(
    src: GPUMemory, dst: GPUMemory, weight_bytes: int, kv_bytes: int
) -> tuple[GPUMemory, GPUMemory]:
    """At finish: the destination owns what it reserved, the source frees the same bytes."""
    if weight_bytes > src.weight_bytes or kv_bytes > src.kv_bytes:
        raise ValueError(
            f"src: moves {weight_bytes} weight / {kv_bytes} KV bytes, holds {src.weight_bytes} / {src.kv_bytes}"
        )
    if weight_bytes + kv_bytes > dst.reserved_bytes:
        raise ValueError(f"dst: commits {weight_bytes + kv_bytes} bytes, reserved {dst.reserved_bytes}")
    src2 = replace(src, weight_bytes=src.weight_bytes - weight_bytes, kv_bytes=src.kv_bytes - kv_bytes)
    dst2 = replace(
        dst,
        weight_bytes=dst.weight_bytes + weight_bytes,
        kv_bytes=dst.kv_bytes + kv_bytes,
        reserved_bytes=dst.reserved_bytes - weight_bytes - kv_bytes,
    )
    return src2, dst2


def cancel_move(dst: GPUMemory, weight_bytes: int, kv_bytes: int) -> GPUMemory:
    """A move abandoned before it finished (its requests left): the destination frees its reservation."""
    need = weight_bytes + kv_bytes
    if need > dst.reserved_bytes:
        raise ValueError(f"dst: cancels {need} bytes, reserved {dst.reserved_bytes}")
    return replace(dst, reserved_bytes=dst.reserved_bytes - need)


def kv_capacity_tokens(mem: GPUMemory, kv_bytes_per_token_held: float) -> int:
    """Tokens of KV that still fit on a GPU whose held layers cost ``kv_bytes_per_token_held`` per token."""
    if kv_bytes_per_token_held <= 0:
        raise ValueError(f"kv_bytes_per_token_held: must be > 0, got {kv_bytes_per_token_held}")
    return max(0, int(mem.free_bytes // kv_bytes_per_token_held))
