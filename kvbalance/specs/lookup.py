"""Name lookup for the preset tables: case-insensitive, ``_`` as ``-``, aliases; errors name the field."""

from __future__ import annotations

from typing import Any


def _lookup(table: dict, aliases: dict[str, str], field_name: str, name: str) -> Any:
    if not isinstance(name, str):
        raise ValueError(f"{field_name}: expected a name, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-")
    key = aliases.get(key, aliases.get(name.strip().lower(), key))
    if key in table:
        return table[key]
    raise ValueError(f"{field_name}: unknown {name!r} (known: {', '.join(table)})")
