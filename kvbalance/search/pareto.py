"""The Pareto front of cost ($/h, lower is better) against goodput (requests/s at SLO, higher is better)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def pareto_front(points: Sequence[dict[str, Any]], cost: str = "usd_per_hour",
                 value: str = "goodput_rps") -> list[dict[str, Any]]:  # fmt: skip
    """Points no other point beats on both axes (cheaper or equal and strictly more goodput, or strictly
    cheaper and at least as much), sorted by cost; of exact ties the first given is kept."""
    order = sorted(range(len(points)), key=lambda i: (points[i][cost], -points[i][value], i))
    front: list[dict[str, Any]] = []
    best = -float("inf")
    for i in order:
        p = points[i]
        if p[value] > best:
            front.append(p)
            best = p[value]
    return front
