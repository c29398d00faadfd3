"""Per-step utilisation timeline of one instance: batch size, queue length and KV usage over time.

``Timeline.record`` runs once per engine step (hundreds of thousands of times in a long simulation),
so it only appends to Python lists; numpy arrays are built lazily when a statistic is asked for.

Time convention: row ``i`` describes the instance from ``time_s[i]`` until the next row's
``time_s`` (sample and hold); the last row holds for its own ``step_s``. Record ``time_s`` as the
step's start time and the state it ran with, and the time-weighted statistics are exact.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

BASE_COLUMNS = (
    "time_s",
    "running",
    "waiting",
    "kv_used_tokens",
    "kv_capacity_tokens",
    "batch_tokens",
    "step_s",
)


def downsample_indices(n: int, max_rows: int | None) -> np.ndarray:
    """Evenly spaced row indices (first and last kept) so that at most ``max_rows`` remain.

    Rows are sampled, not averaged: a short spike between two kept rows is not shown.
    """
    if max_rows is not None and max_rows < 2:
        raise ValueError(f"max_rows: must be >= 2, got {max_rows}")
    if max_rows is None or n <= max_rows:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_rows).round().astype(np.int64))


class Timeline:
    """Append-only per-step recorder with time-weighted summaries.

    Base columns: ``time_s``, ``running`` (requests in the batch), ``waiting`` (queue length),
    ``kv_used_tokens``, ``kv_capacity_tokens`` (may change over time, e.g. the elastic reserve),
    ``batch_tokens`` (tokens computed this step) and ``step_s`` (the step's duration). Any keyword
    given to ``record`` becomes an extra column; rows that lack it hold ``None``.
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._time_s: list[float] = []
        self._running: list[int] = []
        self._waiting: list[int] = []
        self._kv_used: list[int] = []
        self._kv_capacity: list[int] = []
        self._batch_tokens: list[int] = []
        self._step_s: list[float] = []
        self._extra: dict[str, list[Any]] = {}
        self._cache: dict[str, np.ndarray] = {}

    # -- recording ----------------------------------------------------------------
    def record(
        self,
        time_s: float,
        running: int,
        waiting: int,
        kv_used_tokens: int,
        kv_capacity_tokens: int,
        batch_tokens: int,
        step_s: float,
        **extra: Any,
    ) -> None:
        """Append one row (one engine step). Cheap: list appends only."""
        self._time_s.append(time_s)
        self._running.append(running)
        self._waiting.append(waiting)
        self._kv_used.append(kv_used_tokens)
        self._kv_capacity.append(kv_capacity_tokens)
        self._batch_tokens.append(batch_tokens)
        self._step_s.append(step_s)
        if self._cache:
            self._cache.clear()
        if extra or self._extra:
            self._record_extra(extra)

    def record_steps(
        self,
        times_s: list[float],
        running: list[int],
        waiting: list[int],
        kv_used_tokens: list[int],
        kv_capacity_tokens: int,
        batch_tokens: list[int],
        steps_s: list[float],
    ) -> None:
        """:meth:`record` of several steps at once, as columns (no extra columns)."""
        if self._extra:
            for row in zip(times_s, running, waiting, kv_used_tokens, batch_tokens, steps_s):
                t, r, w, kv, b, s = row
                self.record(t, r, w, kv, kv_capacity_tokens, b, s)
            return
        self._time_s.extend(times_s)
        self._running.extend(running)
        self._waiting.extend(waiting)
        self._kv_used.extend(kv_used_tokens)
        self._kv_capacity.extend([kv_capacity_tokens] * len(times_s))
        self._batch_tokens.extend(batch_tokens)
        self._step_s.extend(steps_s)
        if self._cache:
            self._cache.clear()

    def _record_extra(self, extra: dict[str, Any]) -> None:
        n = len(self._time_s)
        for key, value in extra.items():
            col = self._extra.get(key)
            if col is None:
                if key in BASE_COLUMNS:
                    raise ValueError(f"{key}: is a base column, pass it positionally")
                col = self._extra[key] = [None] * (n - 1)
            col.append(value)
        for col in self._extra.values():
            if len(col) < n:
                col.append(None)

    # -- access -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._time_s)

    @property
    def columns(self) -> list[str]:
        return [*BASE_COLUMNS, *self._extra]

    def _lists(self) -> dict[str, list[Any]]:
        base = dict(
            zip(
                BASE_COLUMNS,
                (
                    self._time_s,
                    self._running,
                    self._waiting,
                    self._kv_used,
                    self._kv_capacity,
                    self._batch_tokens,
                    self._step_s,
                ),
            )
        )
        return {**base, **self._extra}

    def column(self, name: str) -> np.ndarray:
        """One column as a numpy array (float64; extra columns that are not numeric stay ``object``)."""
        arr = self._cache.get(name)
        if arr is not None:
            return arr
        lists = self._lists()
        if name not in lists:
            raise KeyError(f"column: unknown timeline column {name!r}; have {self.columns}")
        values = lists[name]
        try:
            arr = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
        except (TypeError, ValueError):
            arr = np.array(values, dtype=object)
        self._cache[name] = arr
        return arr

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: self.column(name) for name in self.columns}

    def rows(self, max_rows: int | None = None) -> list[dict[str, Any]]:
        """Rows as dicts, optionally downsampled to at most ``max_rows`` (see ``downsample_indices``)."""
        lists = self._lists()
        names = list(lists)
        cols = list(lists.values())
        return [
            {k: c[i] for k, c in zip(names, cols)} for i in downsample_indices(len(self), max_rows).tolist()
        ]

    def to_csv(self, path: str | os.PathLike, max_rows: int | None = None) -> None:
        """Write the rows as CSV (``None`` as an empty cell), optionally downsampled to ``max_rows``."""
        lists = self._lists()
        cols = list(lists.values())
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(list(lists))
            for i in downsample_indices(len(self), max_rows).tolist():
                w.writerow(["" if c[i] is None else c[i] for c in cols])

    # -- statistics ---------------------------------------------------------------
    def durations(self) -> np.ndarray:
        """How long each row's state holds: the gap to the next row, and ``step_s`` for the last."""
        t = self.column("time_s")
        if len(t) == 0:
            return np.zeros(0)
        dt = np.empty_like(t)
        dt[:-1] = np.diff(t)
        dt[-1] = self.column("step_s")[-1]
        if (dt < 0).any():
            i = int(np.argmax(dt < 0))
            raise ValueError(f"time_s: timeline {self.name!r} goes back in time at row {i + 1}")
        return dt

    def span_s(self) -> float:
        """Covered time: first row's start to the end of the last step."""
        return float(self.durations().sum())

    def integral(self, name: str) -> float:
        """Integral of a numeric column over time (sample and hold); ``nan`` cells count as zero."""
        if len(self) == 0:
            return 0.0
        return float(np.nansum(self.column(name) * self.durations()))

    def time_weighted_mean(self, name: str) -> float | None:
        span = self.span_s()
        return None if span <= 0 else self.integral(name) / span

    def kv_usage_mean(self) -> float | None:
        """Time-weighted KV usage: integral of used tokens / integral of capacity tokens.

        With a fixed capacity this is the time-weighted mean of ``used / capacity``; with a
        changing capacity (elastic reserve) it is the fraction of the offered token-seconds used.
        """
        return kv_usage_mean([self])

    def kv_usage(self) -> tuple[np.ndarray, np.ndarray]:
        """(time_s, used / capacity) per row; rows with zero capacity give 0."""
        used = self.column("kv_used_tokens")
        cap = self.column("kv_capacity_tokens")
        frac = np.divide(used, cap, out=np.zeros_like(used), where=cap > 0)
        return self.column("time_s"), frac

    def queue_length(self) -> tuple[np.ndarray, np.ndarray]:
        """(time_s, waiting requests) per row."""
        return self.column("time_s"), self.column("waiting")

    def running(self) -> tuple[np.ndarray, np.ndarray]:
        """(time_s, running requests) per row."""
        return self.column("time_s"), self.column("running")

    def batch_times(self, nonempty: bool = True) -> np.ndarray:
        """Step durations in seconds (the batch service times the queueing model needs).

        With ``nonempty`` (the default), steps that computed no tokens are left out.
        """
        step = self.column("step_s")
        if nonempty:
            step = step[self.column("batch_tokens") > 0]
        return step.copy()

    def busy_s(self) -> float:
        """Total time spent in steps that computed tokens."""
        return float(self.batch_times(nonempty=True).sum())


def kv_usage_mean(timelines: Sequence[Timeline]) -> float | None:
    """Pooled time-weighted KV usage over several instances: sum of used token-seconds / capacity token-seconds."""
    used = sum(tl.integral("kv_used_tokens") for tl in timelines)
    cap = sum(tl.integral("kv_capacity_tokens") for tl in timelines)
    return None if cap <= 0 else used / cap
