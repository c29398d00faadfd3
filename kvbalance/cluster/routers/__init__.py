"""Routers, one class per module behind ``ROUTERS``: importing this package registers them all."""

from kvbalance.cluster.routers import (
    cache_aware,
    kv_aware,
    least_loaded,
    llumnix,
    load_aware,
    round_robin,
    store_aware,
)
from kvbalance.cluster.routers.base import ROUTERS, Router, build_router

__all__ = [
    "ROUTERS",
    "Router",
    "build_router",
    "cache_aware",
    "kv_aware",
    "least_loaded",
    "llumnix",
    "load_aware",
    "round_robin",
    "store_aware",
]
