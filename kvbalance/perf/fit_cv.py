"""The measured-shape corrections of a GPU fit and their errors, three ways (``kvbalance calibrate``):

1. the physical model on its training points (``FitResult.errors``);
2. the corrected model under cross-validation: leave-one-point-out along M within each shape (each profiled
   token count predicted from its neighbours: **the figure the <30% worst-case check is read on**), and
   leave-one-model-out (a whole model's points from the physical model plus corrections learnt on the other
   models, where a shape is shared; by default the physical curves themselves were fitted on every model, a
   handful of parameters over ~50k points, so that leak is small; ``kvbalance calibrate --cv-refit`` removes
   it by refitting them without each held-out model);
3. the corrected model on its training points (near 0 by construction, where a shape's token count was
   measured once: it proves nothing and is shown so nobody mistakes it for (2)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbalance.perf.correction import build_corrections, evaluate, loo_group_log_ratio, loo_point_log_ratio
from kvbalance.perf.cost import CostModel, op_time
from kvbalance.perf.fit_errors import ClassError, operator_errors, point_record
from kvbalance.perf.profiles import OperatorSample
from kvbalance.specs import HardwareSpec, ShapeCorrection

# Relative error the worst-case check allows per operator class (issue 11).
WORST_BOUND = 0.30
# The M tile (rows) each class's corrections interpolate within (ShapeCorrection.tile_tokens, written into the
# preset; :mod:`kvbalance.perf.correction`). Measured by leave-one-point-out on the H100 and A40 profiles: GEMMs
# at ceil(M / 128) cut the points past 30% (resolution-aware) from 70 to 24 (H100) and 36 to 21 (A40), worst
# 74% -> 59% and 69% -> 48%; 64 and 256 rows do less on one GPU each (66% / 54%, 59% / 46% with 29 / 32
# points), floor(M / t) buckets (tiles starting at M = t) far worse (179% / 174%); element-wise classes in
# 128-row tiles get worse (RMSNorm 33% -> 52% H100), so they keep one interpolation over every knot.
CORRECTION_TILES = {"gemm": 128}
# Fits the physical curves of a base spec on some samples (perf.fit_gpu.fit_physical).
PhysicalFit = Callable[[HardwareSpec, Sequence[OperatorSample]], HardwareSpec]


def sample_models(samples: Sequence[OperatorSample], hw: HardwareSpec) -> list[CostModel]:
    """The cost model of every sample's shape and TP degree on ``hw`` (one per distinct pair)."""
    models: dict[tuple, CostModel] = {}
    out = []
    for s in samples:
        key = (s.shape, s.tp)
        cm = models.get(key)
        if cm is None:
            cm = models[key] = CostModel(s.shape.model_spec(), hw, s.tp)
        out.append(cm)
    return out


def sample_keys(samples: Sequence[OperatorSample], hw: HardwareSpec) -> list[str | None]:
    """The kernel shape key of every sample's operator at its shape and TP degree."""
    keys: dict[int, dict[str, str | None]] = {}
    out = []
    for s, cm in zip(samples, sample_models(samples, hw)):
        per = keys.get(id(cm))
        if per is None:
            per = keys[id(cm)] = cm.kernel_keys()
        out.append(per.get(s.op))
    return out


@dataclass
class CorrectionFit:
    """Corrections learnt on a GPU's samples and every sample's prediction under each way of scoring them."""

    corrections: dict[str, ShapeCorrection] = field(repr=False)
    keys: list[str | None] = field(repr=False)
    loo_point_s: np.ndarray = field(repr=False)
    loo_model_s: np.ndarray = field(repr=False)
    corrected_s: np.ndarray = field(repr=False)
    loo_point_errors: list[ClassError]
    loo_model_errors: list[ClassError]
    corrected_errors: list[ClassError]

    def failures(self, samples: Sequence[OperatorSample], bound: float = WORST_BOUND) -> list[dict]:
        """The leave-one-point-out points past ``bound`` (what breaks the worst-case check), worst first."""
        meas = np.array([s.time_s for s in samples])
        rel = self.loo_point_s / meas - 1.0
        bad = np.flatnonzero(np.abs(rel) > bound)
        bad = bad[np.argsort(-np.abs(rel[bad]))]
        return [point_record(samples[i], meas[i], self.loo_point_s[i]) for i in bad]


def physical_times(samples: Sequence[OperatorSample], hw: HardwareSpec) -> np.ndarray:
    """The physical model's time of every sample on ``hw`` (its corrections, if any, left out)."""
    return np.array(
        [
            op_time(cm.kernel(s.op, s.num_tokens), hw).time_s
            for s, cm in zip(samples, sample_models(samples, hw))
        ]
    )


def loo_model_refit(
    samples: Sequence[OperatorSample], hw: HardwareSpec, keys: Sequence[str | None], refit: PhysicalFit
) -> np.ndarray:
    """Leave-one-model-out with the physical curves refitted without the held-out model: each model's samples
    predicted by ``refit(hw, other models' samples)`` times the corrections learnt, against that refit, on the
    other models where they share a shape."""
    models = np.array([s.shape.model for s in samples])
    tokens = np.array([s.num_tokens for s in samples], dtype=float)
    meas = np.array([s.time_s for s in samples])
    out = np.zeros(len(samples))
    for m in dict.fromkeys(models):
        held = np.flatnonzero(models == m)
        train = np.flatnonzero(models != m)
        hw_m = refit(hw, [samples[i] for i in train])
        phys = physical_times(samples, hw_m)
        table = build_corrections(
            [keys[i] for i in train], tokens[train], np.log(meas[train] / phys[train]), CORRECTION_TILES
        )
        out[held] = phys[held] * np.exp(evaluate(table, [keys[i] for i in held], tokens[held]))
    return out


def fit_corrections(
    samples: Sequence[OperatorSample],
    physical_s: np.ndarray,
    hw: HardwareSpec,
    refit: PhysicalFit | None = None,
) -> CorrectionFit:
    """Corrections ``log(measured / physical)`` per profiled shape of ``samples`` (``physical_s``: the physical
    model's prediction of each sample on ``hw``) and their errors, scored the three ways of the module doc
    (with ``refit``, the physical fit, leave-one-model-out refits it without each held-out model)."""
    keys = sample_keys(samples, hw)
    meas = np.array([s.time_s for s in samples])
    tokens = np.array([s.num_tokens for s in samples], dtype=float)
    log_ratio = np.log(meas) - np.log(physical_s)
    corrections = build_corrections(keys, tokens, log_ratio, CORRECTION_TILES)
    models = [s.shape.model for s in samples]
    loo_point = physical_s * np.exp(loo_point_log_ratio(keys, tokens, log_ratio, CORRECTION_TILES))
    if refit is not None:
        loo_model = loo_model_refit(samples, hw, keys, refit)
    else:
        loo_model = physical_s * np.exp(
            loo_group_log_ratio(keys, tokens, log_ratio, models, CORRECTION_TILES)
        )
    corrected = physical_s * np.exp(evaluate(corrections, keys, tokens))
    return CorrectionFit(
        corrections,
        keys,
        loo_point,
        loo_model,
        corrected,
        operator_errors(samples, loo_point),
        operator_errors(samples, loo_model),
        operator_errors(samples, corrected),
    )
