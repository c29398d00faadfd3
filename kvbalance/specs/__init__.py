"""Model, GPU and link specifications with cited presets: the shapes and peak numbers the cost model
and the KV-capacity arithmetic are built on.

``models`` (ModelSpec presets), ``links`` (LinkSpec presets), ``hardware`` (HardwareSpec and its curves),
``presets`` (the GPU presets from datasheets and fits); everything is importable from ``kvbalance.specs``.
"""

from kvbalance.specs.hardware import (
    ELEMENTWISE_CLASSES,
    MIB,
    HardwareSpec,
    MemoryCurve,
    ShapeCorrection,
    load_hardware,
)
from kvbalance.specs.links import LINKS, LinkSpec, get_link, list_links
from kvbalance.specs.models import ARCHS, MODELS, ModelSpec, get_model, list_models
from kvbalance.specs.presets import (
    FITS_DIR,
    FITTED_FIELDS,
    GPUS,
    HARDWARE_FILE_SUFFIXES,
    MEASURED_OVERRIDES,
    get_gpu,
    gpu_provenance,
    list_gpus,
)

__all__ = [
    "ARCHS",
    "ELEMENTWISE_CLASSES",
    "FITS_DIR",
    "FITTED_FIELDS",
    "GPUS",
    "HARDWARE_FILE_SUFFIXES",
    "MEASURED_OVERRIDES",
    "LINKS",
    "MIB",
    "MODELS",
    "HardwareSpec",
    "LinkSpec",
    "MemoryCurve",
    "ModelSpec",
    "ShapeCorrection",
    "get_gpu",
    "get_link",
    "gpu_provenance",
    "get_model",
    "list_gpus",
    "list_links",
    "list_models",
    "load_hardware",
]
