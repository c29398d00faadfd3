"""GPU presets: datasheet peaks with the efficiency curves fitted by ``kvbalance calibrate`` (package data in
``perf/fits/``), borrowed by GPUs without their own fit; ``get_gpu`` by name or from a spec file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvbalance.specs.hardware import MIB, HardwareSpec, load_hardware
from kvbalance.specs.links import LINKS
from kvbalance.specs.lookup import _lookup


def _gpu(name: str, peak: float, bw: float, cap_mib: int, link: str, source: str, **kw: Any) -> HardwareSpec:
    # memory_half_bytes: Little's law, bytes in flight to cover ~0.5 us of DRAM latency at full bandwidth.
    kw.setdefault("memory_half_bytes", round(bw * 0.5e-6))
    return HardwareSpec(
        name=name,
        peak_flops=peak,
        mem_bandwidth_bytes_s=bw,
        mem_capacity_bytes=cap_mib * MIB,
        tp_link=LINKS[link],
        source=source,
        **kw,
    )


_EFF_NOTE = (
    " Efficiency defaults (no fit): GEMMs saturate at 55% of peak with half efficiency at M=16 tokens,"
    " memory-bound kernels at 90% of peak bandwidth, attention at 0.8x the GEMM fraction; 1 ms per step,"
    " 8 us per layer. Estimates, not fits."
)
# Fitted presets written by ``kvbalance calibrate`` (package data): efficiency curves, kernel latency, host
# overhead and TP link fitted on measured profiles; the datasheet peaks stay as given.
FITS_DIR = Path(__file__).resolve().parent.parent / "perf" / "fits"
# What a fit transfers to another GPU: everything except peaks, bandwidth, capacity, L2, link, name, source.
FITTED_FIELDS = (
    "compute_eff_max",
    "compute_half_tokens",
    "memory_eff_max",
    "memory_half_bytes",
    "attention_eff_ratio",
    "kv_memory_eff_ratio",
    "step_overhead_s",
    "per_layer_overhead_s",
    "kernel_latency_s",
    "host_overhead_per_seq_s",
    "host_overhead_per_token_s",
    "host_overhead_tp_s",
    "host_overhead_tp_per_seq_s",
    "host_overhead_per_tp_rank_s",
    "elementwise_curves",
)


def _fit(name: str) -> HardwareSpec | None:
    path = FITS_DIR / f"{name}.json"
    return load_hardware(path) if path.is_file() else None


def _borrow(
    datasheet: HardwareSpec, fit: HardwareSpec | None, why: str, link: bool = False, own: bool = False
) -> HardwareSpec:
    """``datasheet``'s peaks with ``fit``'s efficiency curves and overheads (and its TP link if ``link``; and
    its measured-shape corrections if ``own``: the fit was made on this very GPU)."""
    if fit is None:
        return datasheet.with_(source=datasheet.source + _EFF_NOTE)
    extra: dict[str, Any] = {"tp_link": fit.tp_link} if link else {}
    if own:
        extra["shape_corrections"] = fit.shape_corrections
    fitted = {f: getattr(fit, f) for f in FITTED_FIELDS}
    fitted_on = datasheet.name if own else (fit.fitted_on or fit.name)
    return datasheet.with_(
        **fitted, **extra, fitted_on=fitted_on, source=f"{datasheet.source} {why} Fit: {fit.source}"
    )


_DATASHEETS = {
    g.name: g
    for g in [
        # NVIDIA A100 datasheet: 312 TFLOPS fp16/bf16 tensor dense; 1,555 GB/s (40GB), 2,039 GB/s (80GB SXM);
        # 40 MB L2; 108 SMs. Capacity: nvidia-smi total (40960 / 81920 MiB).
        _gpu("a100-40gb", 312e12, 1555e9, 40960, "nvlink", "NVIDIA A100 datasheet (SXM4 40GB).", l2_cache_bytes=40e6, num_sms=108),
        _gpu("a100-80gb", 312e12, 2039e9, 81920, "nvlink", "NVIDIA A100 datasheet (SXM4 80GB).", l2_cache_bytes=40e6, num_sms=108),
        # NVIDIA H100 datasheet, SXM5: 989 TFLOPS bf16 dense (1,979 with sparsity), 3.35 TB/s, 80GB
        # (nvidia-smi: 81559 MiB); 50 MB L2; 132 SMs.
        _gpu("h100-sxm", 989e12, 3.35e12, 81559, "nvlink4", "NVIDIA H100 datasheet (SXM5).", l2_cache_bytes=50e6, num_sms=132),
        # NVIDIA H200 datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e, 141GB (nvidia-smi: 143771 MiB); the
        # H100's GH100 die (50 MB L2, 132 SMs).
        _gpu("h200", 989e12, 4.8e12, 143771, "nvlink4", "NVIDIA H200 datasheet (SXM).", l2_cache_bytes=50e6, num_sms=132),
        # NVIDIA L40S datasheet: 362 TFLOPS fp16/bf16 tensor dense (733 with sparsity), 864 GB/s GDDR6,
        # 48GB (nvidia-smi: 46068 MiB with ECC), 96 MB L2, 142 SMs; PCIe 4.0 x16, no NVLink.
        _gpu("l40s", 362e12, 864e9, 46068, "pcie4", "NVIDIA L40S datasheet.", l2_cache_bytes=96e6, num_sms=142),
        # NVIDIA A40 datasheet: 149.7 TFLOPS fp16 tensor dense (299.4 with sparsity), 696 GB/s GDDR6, 48GB
        # (nvidia-smi: 46068 MiB with ECC), 6 MB L2, 84 SMs (GA102); PCIe 4.0 x16 (NVLink bridge pairs only).
        _gpu("a40", 149.7e12, 696e9, 46068, "pcie4", "NVIDIA A40 datasheet.", l2_cache_bytes=6e6, num_sms=84),
    ]
}  # fmt: skip


# Values a borrowing preset takes from a measurement on its own GPU instead of the borrowed fit. The A100's
# HBM2e streams at a larger fraction of its datasheet bandwidth than the A40's GDDR6 (A40 fit: 0.766): a read
# kernel profiled with Nsight Compute on an A100 80GB SXM reaches 1.80 of 2.04 TB/s, 88% of peak, and a GTC talk
# quoted there puts the best kernels near 90% (NVIDIA developer forum, "Trouble to Reach Peak
# Bandwidth of A100", https://forums.developer.nvidia.com/t/trouble-to-reach-peak-bandwidth-of-a100/339083).
# The A100 40GB has the same memory system at a lower clock; the same fraction is assumed.
_MEASURED_NOTE = (
    "memory_eff_max 0.88 (a read kernel at 1.80 of 2.04 TB/s, 88% of peak in Nsight Compute, on an A100 80GB"
    " SXM: NVIDIA developer forum, 'Trouble to Reach Peak Bandwidth of A100')."
)
MEASURED_OVERRIDES: dict[str, dict[str, float]] = {
    "a100-40gb": {"memory_eff_max": 0.88},
    "a100-80gb": {"memory_eff_max": 0.88},
}


def _presets() -> dict[str, HardwareSpec]:
    d, h100, a40 = _DATASHEETS, _fit("h100-sxm"), _fit("a40")
    ampere = (
        "Efficiency curves and overheads borrowed from the A40 fit (the closest fitted architecture: Ampere;"
        " risk: A100's HBM2e and 40 MB L2 and L40S's Ada SMs differ from the A40's GDDR6 and 6 MB L2, so the"
        " memory-bound fractions and GEMM half-size may be off by tens of percent)."
    )
    hopper = "Efficiency curves, overheads and TP link from the H100 fit (same GH100 die; bandwidth, capacity own)."
    hbm = f" Own measured value: {_MEASURED_NOTE}"
    return {
        "a100-40gb": _borrow(d["a100-40gb"], a40, ampere + hbm).with_(**MEASURED_OVERRIDES["a100-40gb"]),
        "a100-80gb": _borrow(d["a100-80gb"], a40, ampere + hbm).with_(**MEASURED_OVERRIDES["a100-80gb"]),
        "h100-sxm": _borrow(d["h100-sxm"], h100, "Fitted on H100 measurements.", link=True, own=True),
        "h200": _borrow(d["h200"], h100, hopper, link=True),
        "l40s": _borrow(d["l40s"], a40, ampere.replace("A40 fit (", "A40 fit (for Ada: ")),
        "a40": _borrow(d["a40"], a40, "Fitted on A40 measurements.", own=True),
    }


GPUS: dict[str, HardwareSpec] = _presets()

_GPU_ALIASES = {
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "a100-40g": "a100-40gb",
    "a100-80g": "a100-80gb",
    "h200-sxm": "h200",
}


HARDWARE_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def get_gpu(name: str | os.PathLike | HardwareSpec) -> HardwareSpec:
    """Preset by name (case-insensitive; "h100" means h100-sxm), or a saved spec file (``.json``/``.yaml``/
    ``.yml``, e.g. the ``hardware.json`` that ``kvbalance profile`` fits). A HardwareSpec passes through."""
    if isinstance(name, HardwareSpec):
        return name
    if isinstance(name, os.PathLike) or (
        isinstance(name, str) and name.lower().endswith(HARDWARE_FILE_SUFFIXES)
    ):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"gpu: no such hardware file {str(path)!r}")
        import yaml

        try:
            return load_hardware(path)
        except (OSError, ValueError, yaml.YAMLError) as e:  # JSONDecodeError is a ValueError
            raise ValueError(f"gpu: cannot read hardware file {str(path)!r} ({e})") from None
    return _lookup(GPUS, _GPU_ALIASES, "gpu", name)


def list_gpus() -> list[str]:
    return list(GPUS)


def gpu_provenance(gpu: HardwareSpec | str) -> dict[str, Any]:
    """Where a GPU spec's efficiency curves and host terms come from: its own fit (``own_fit``: fitted on this
    GPU's measured profiles, with ``shape_corrections`` measured kernel shapes), another GPU's fit it borrows
    (``borrowed_from``), or none (datasheet peaks with estimated efficiencies). JSON-ready."""
    hw = get_gpu(gpu)
    own = bool(hw.fitted_on) and hw.fitted_on == hw.name
    borrowed = hw.fitted_on if hw.fitted_on and not own else None
    if own:
        summary = f"own fit (measured on {hw.name}; {len(hw.shape_corrections)} measured kernel shapes)"
    elif borrowed:
        summary = f"borrows {borrowed}'s fitted curves (datasheet peaks its own; no measured kernel shapes)"
    else:
        summary = "no fit: datasheet peaks with estimated efficiencies"
    measured = {k: v for k, v in MEASURED_OVERRIDES.get(hw.name, {}).items() if getattr(hw, k) == v}
    if borrowed and measured:
        summary += "; own measured " + ", ".join(f"{k} {v:g}" for k, v in measured.items())
    return {
        "fitted_on": hw.fitted_on or None,
        "own_fit": own,
        "borrowed_from": borrowed,
        "shape_corrections": len(hw.shape_corrections),
        "measured_overrides": measured,
        "summary": summary,
    }
