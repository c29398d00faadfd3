"""``kvbalance sweep``: one simulation per point of a cartesian grid over a simulate config, in parallel.

A grid is ``key=v1,v2,...`` per axis; a key is a ``SimulateConfig`` field (``rate``, ``policy``,
``chunk_size``, ...) or, with a ``cluster:`` section, ``cluster.<field>`` (``cluster.router``). Values are
read as YAML scalars (``512`` an int, ``inf`` a rate, ``true`` a bool). Every point is validated before any
runs (an error names the point and the field). Each point writes ``<out>/<point>/summary.json``; the sweep
writes ``<out>/sweep.csv`` (one row per point, grid keys first, then every scalar of the summary, nested
keys joined with dots). A point's result depends only on its config (its seed included), so the process
pool and Ray give the same summaries.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvbalance.metrics.summary import to_json_value, write_summary_json

CLUSTER_PREFIX = "cluster."


def parse_value(text: str) -> Any:
    """A grid value as YAML reads it (numbers, bools), with ``inf`` meaning an infinite rate."""
    import yaml

    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_grid(specs: Iterable[str]) -> dict[str, list[Any]]:
    """``["rate=2,4", "policy=sarathi,vllm"]`` -> ``{"rate": [2, 4], "policy": ["sarathi", "vllm"]}``."""
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"grid: expected key=v1,v2,... got {spec!r}")
        if key in grid:
            raise ValueError(f"grid: {key} is given twice")
        parts = [v.strip() for v in values.split(",")]
        if not values.strip() or any(not v for v in parts):
            raise ValueError(f"grid: {key} has an empty value in {spec!r}")
        grid[key] = [parse_value(v) for v in parts]
    if not grid:
        raise ValueError("grid: give at least one --grid key=v1,v2,...")
    return grid


def grid_points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The cartesian product in axis order (the last axis varies fastest)."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def point_name(point: dict[str, Any]) -> str:
    """A folder name for a point: ``rate=4_policy=vllm`` (characters outside [A-Za-z0-9._=-] become -)."""
    parts = []
    for k, v in point.items():
        text = "inf" if isinstance(v, float) and math.isinf(v) else str(v)
        parts.append(re.sub(r"[^A-Za-z0-9._=-]", "-", f"{k.removeprefix(CLUSTER_PREFIX)}={text}"))
    return "_".join(parts)


def apply_point(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a simulate config mapping, maybe with ``cluster:``) with the point's values set."""
    data = json.loads(json.dumps(base, default=_json_default))  # a deep copy that keeps inf
    for key, value in point.items():
        if key.startswith(CLUSTER_PREFIX):
            section = data.get("cluster")
            if not isinstance(section, dict):
                raise ValueError(f"grid: {key} needs a cluster: section in the config")
            section[key.removeprefix(CLUSTER_PREFIX)] = value
        else:
            data[key] = value
    return data


def _json_default(x: Any) -> Any:
    raise TypeError(f"config: value {x!r} of type {type(x).__name__} is not a plain YAML value")


def validate_config(data: dict[str, Any]):
    """(SimulateConfig, ClusterConfig or None) of a config mapping; ValueError naming the field."""
    from pydantic import ValidationError

    from kvbalance.cluster.config import ClusterConfig
    from kvbalance.sim.run import SimulateConfig, config_error_message

    data = dict(data)
    data.pop("out", None)
    section = data.pop("cluster", None)
    if isinstance(data.get("rate"), str):
        data["rate"] = parse_value(data["rate"])
    try:
        sim = SimulateConfig(**data)
    except ValidationError as e:
        raise ValueError(config_error_message(e)) from None
    if section is None:
        return sim, None
    if not isinstance(section, dict):
        raise ValueError("cluster: must be a mapping (instances, router, store, ...)")
    try:
        return sim, ClusterConfig(**section)
    except ValidationError as e:
        raise ValueError("cluster." + config_error_message(e)) from None


def simulate_config(data: dict[str, Any]) -> dict[str, Any]:
    """The summary of one simulation of a config mapping (single instance, or a ``cluster:`` section)."""
    from kvbalance.cluster.config import run_cluster
    from kvbalance.sim.run import run_simulation
    from kvbalance.specs import get_model
    from kvbalance.workloads.presets import build_requests

    sim, cluster = validate_config(data)
    if cluster is None:
        return run_simulation(sim, report=False).summary
    max_context = min(sim.max_context or 1 << 30, get_model(sim.model).max_context)
    reqs = build_requests(sim.workload, sim.num_requests, sim.rate, sim.seed, max_context, arrival=sim.arrival,
                          cv=sim.cv, time_scale=sim.time_scale)  # fmt: skip
    res = run_cluster(sim, cluster, reqs)
    return to_json_value({**res.summary, "instances": res.instances})


def flatten(summary: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Scalars of a summary with nested keys joined by dots (lists are left out)."""
    out: dict[str, Any] = {}
    for k, v in summary.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        elif not isinstance(v, (list, tuple)):
            out[f"{prefix}{k}"] = v
    return out


def _point_task(item: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return simulate_config(item[1])


def run_sweep(
    base: dict[str, Any],
    grid: dict[str, list[Any]],
    out: str | Path,
    backend,
    *,
    on_done: Callable[[int, str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every point of ``grid`` over ``base`` on ``backend``; write the files; return the summaries in
    point order. ``on_done(done_count, point_name)`` is called as points finish (a progress bar)."""
    points = grid_points(grid)
    names = [point_name(p) for p in points]
    if len(set(names)) != len(names):
        raise ValueError("grid: two points map to the same folder name; use distinct values")
    configs = []
    for name, p in zip(names, points):
        data = apply_point(base, p)
        try:
            validate_config(data)
        except ValueError as e:
            raise ValueError(f"point {name}: {e}") from None
        configs.append((name, data))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summaries: list[dict[str, Any] | None] = [None] * len(points)
    for done, (i, summary) in enumerate(backend.imap(_point_task, configs), start=1):
        summaries[i] = summary
        (out / names[i]).mkdir(parents=True, exist_ok=True)
        write_summary_json(out / names[i] / "summary.json", summary)
        if on_done is not None:
            on_done(done, names[i])
    write_sweep_csv(out / "sweep.csv", points, names, summaries)
    return summaries  # type: ignore[return-value]


def write_sweep_csv(path: Path, points: list[dict], names: list[str], summaries: list[dict]) -> None:
    rows = [flatten(s) for s in summaries]
    keys = list(points[0]) if points else []
    metrics = sorted({k for r in rows for k in r} - set(keys))
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["point", *keys, *metrics])
        for name, p, r in zip(names, points, rows):
            w.writerow([name, *(p[k] for k in keys), *("" if r.get(m) is None else r[m] for m in metrics)])
