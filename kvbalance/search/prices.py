"""GPU prices ($ per GPU-hour) and the cost of a deployment: the packaged table (``prices.yaml``, each entry
with its source) or a user's file, in the same layout or as a plain ``gpu: price`` mapping."""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path


def _parse(data, where: str) -> dict[str, float]:
    if not isinstance(data, dict):
        raise ValueError(f"prices: {where} must hold a mapping of GPU names to prices")
    table = data.get("prices", data)
    if not isinstance(table, dict) or not table:
        raise ValueError(f"prices: {where} has no prices")
    out: dict[str, float] = {}
    for gpu, entry in table.items():
        value = entry.get("usd_per_gpu_hour") if isinstance(entry, dict) else entry
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ValueError(
                f"prices: {gpu}: usd_per_gpu_hour must be a positive number, got {value!r} ({where})"
            )
        out[str(gpu)] = float(value)
    return out


def default_prices() -> dict[str, float]:
    import yaml

    text = resources.files("kvbalance.search").joinpath("prices.yaml").read_text()
    return _parse(yaml.safe_load(text), "the packaged prices.yaml")


def load_prices(path: str | Path | None = None) -> dict[str, float]:
    """The default table, with the entries of ``path`` (if given) replacing or adding to it."""
    import yaml

    prices = default_prices()
    if path is None:
        return prices
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"prices: no such file {path}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"prices: {path} is not valid YAML ({e})") from None
    return prices | _parse(data, str(path))


def gpu_price(prices: dict[str, float], gpu: str) -> float:
    if gpu not in prices:
        raise ValueError(
            f"prices: no price for gpu {gpu!r} (known: {', '.join(sorted(prices))}; add it with --prices FILE)"
        )
    return prices[gpu]
