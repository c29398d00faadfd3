"""Name registries: scheduler policies, routers and planners are one class each, found by name.

A new policy is one new module that decorates its class with ``@REGISTRY.register("name")``; CLI
choices, config ``Literal``s and error messages all come from ``registry.names()``, so nothing else
has to change. The registry imports the package that holds the implementations on first use, so a
module that is never imported is never registered by accident.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to classes (or factories) of one kind, e.g. ``Registry("policy", "kvbalance.scheduling")``."""

    def __init__(self, kind: str, package: str | None = None) -> None:
        self.kind = kind  # the config field / CLI flag the names are given for, used in error messages
        self._package = package  # imported (with its submodules listed in its __init__) before a lookup
        self._items: dict[str, T] = {}
        self._loaded = package is None

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind}: {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return add

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            importlib.import_module(self._package)

    def get(self, name: str) -> T:
        self._load()
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"{self.kind}: unknown {name!r} (known: {', '.join(self.names())})") from None

    def names(self) -> tuple[str, ...]:
        self._load()
        return tuple(sorted(self._items))

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._items
