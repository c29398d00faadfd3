"""GPU memory ledger for migrations: what each GPU holds (weights, KV) and what a move has reserved.

A move reserves room on the destination when it starts (its bytes land there during the copy) and,
when it finishes, the destination owns them and the source frees the same bytes: the total over both
GPUs is conserved, and no GPU ever holds more than its capacity. ``layer_move_blocks`` sizes the two
instances' block pools after a layer move (the helper lends blocks, the source's blocks get cheaper).
"""

from __future__ import annotations

import math
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


def layer_move_blocks(
    src_blocks: int, helper_available_blocks: int, helper_blocks: int, block_bytes: int, weight_bytes: int,
    split_layer: int, num_layers: int, lend_fraction: float,
) -> tuple[int, int] | None:  # fmt: skip
    """Block pools after moving layers ``[k, L)`` (``k = split_layer``) from a source to a helper GPU.

    A source block then holds KV of ``k`` layers (``block_bytes x k / L`` there) and needs its moved part,
    ``m = block_bytes x (L - k) / L``, on the helper. The helper gives up ``G`` of its blocks (free or idle
    cached ones only, at most ``lend_fraction`` of its pool) for the moved weights and those parts; the
    source's pool becomes ``N' = min(N x L / k, (G x block_bytes - weights) / m)`` blocks: the same memory
    holds more tokens, bounded by what the helper holds for the moved layers. ``G`` must cover at least the
    source's present ``N`` blocks (so the source never shrinks: its KV in use never has to move). Returns
    ``(G, N')``, or None when the helper cannot spare that much (the move is refused).
    """
    if not 0 < split_layer < num_layers:
        raise ValueError(f"split_layer: must be in (0, {num_layers}), got {split_layer}")
    if not 0 <= lend_fraction <= 1:
        raise ValueError(f"lend_fraction: must be in [0, 1], got {lend_fraction}")
    moved = block_bytes * (num_layers - split_layer) / num_layers
    grown = src_blocks * num_layers // split_layer
    g_min = math.ceil((weight_bytes + src_blocks * moved) / block_bytes)
    g_max = math.ceil((weight_bytes + grown * moved) / block_bytes)
    g = min(helper_available_blocks, int(lend_fraction * helper_blocks), g_max)
    if g < g_min:
        return None
    return g, min(grown, int((g * block_bytes - weight_bytes) // moved))
