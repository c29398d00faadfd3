"""What a ``kvbalance profile`` run measures and how its validation run is set up (:class:`ProfileConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvbalance.specs import get_model

DEFAULT_OUT = "runs/profile"
# The engine's knobs shared by the real run and the simulation (LLMEngine's defaults).
FIT_PARAMS = (
    "compute_eff_max",
    "memory_eff_max",
    "attention_eff_ratio",
    "kv_memory_eff_ratio",
    "step_overhead_s",
    "compute_half_tokens",
)


@dataclass
class ProfileConfig:
    """What a profile run measures and how the validation run is set up."""

    model: str = "smollm2-135m"
    threads: int = 1
    quick: bool = False
    block_size: int = 64  # LLMEngine's default on CPU
    warmup: int = 1
    repeats: int = 3
    max_repeat_s: float = 4.0  # stop repeating a grid point once this much time went into it (>= 1 repeat)
    seed: int = 0
    fit: tuple[str, ...] = FIT_PARAMS
    # "wall": fit and validate on wall-clock time (what the engine's clock sees); "cpu": on the process's CPU
    # time, which on a shared machine approximates the uncontended time (one compute thread)
    clock: str = "wall"
    # validation
    validate: bool = True
    workload: str = "sharegpt-trace"  # lengths source; falls back to "sharegpt" when the trace is missing
    num_requests: int = 32
    max_input_tokens: int = 512
    max_output_tokens: int = 128
    chunk_size: int = 512  # sarathi token budget per step (LLMEngine max_num_batched_tokens)
    max_num_seqs: int = 64
    kv_tokens: int = 32_768
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for f in ("threads", "block_size", "repeats", "num_requests", "max_input_tokens", "max_output_tokens",
                  "chunk_size", "max_num_seqs", "kv_tokens"):  # fmt: skip
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: must be a positive integer, got {v!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup: must be >= 0, got {self.warmup}")
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"clock: must be 'wall' or 'cpu', got {self.clock!r}")
        if not self.max_repeat_s > 0:
            raise ValueError(f"max_repeat_s: must be > 0, got {self.max_repeat_s}")
        get_model(self.model)

    @classmethod
    def quick_config(cls, model: str = "tiny-llama", **kw) -> ProfileConfig:
        """Seconds, not minutes: a handful of grid points and a small validation run (tests, smoke checks)."""
        base = dict(quick=True, repeats=2, max_repeat_s=1.0, num_requests=8, max_input_tokens=128,
                    max_output_tokens=16, chunk_size=128, max_num_seqs=16, kv_tokens=4096)  # fmt: skip
        base.update(kw)
        return cls(model=model, **base)
