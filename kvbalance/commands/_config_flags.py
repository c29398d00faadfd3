"""Command-line flags derived from a pydantic config model, so every setting is declared once.

``add_config_flags`` turns each field of a model into a flag (``chunk_size`` -> ``--chunk-size``): its type
from the annotation (``X | None`` is ``X``, a ``Literal`` gives the choices), its help text and default from
the field's description and default; a bool that defaults to true becomes ``--no-...``. Every flag defaults
to ``None`` so that only what the user typed overrides a YAML file; ``config_overrides`` collects those.
Presentation details that are the CLI's business (a parse function, extra aliases, a registry's choices)
come in ``extras``, keyed by field name.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def flag_name(name: str, info: FieldInfo) -> str:
    """The flag a field gets: ``--field-name``, or ``--no-field-name`` for a bool that defaults to true."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "flag" in extra:
        return str(extra["flag"])
    dashed = name.replace("_", "-")
    if _base_type(info.annotation) is bool and info.default is True:
        return "--no-" + dashed.removeprefix("enable-")
    return "--" + dashed


def _base_type(annotation: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _default_text(info: FieldInfo) -> str:
    if info.default is PydanticUndefined or info.default is None:
        return ""
    return f" (default: {info.default})"


def add_config_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    skip: tuple[str, ...] = (),
    extras: dict[str, dict[str, Any]] | None = None,
) -> None:
    """One flag per field of ``model`` (except ``skip``); ``extras[field]`` adds argparse keywords and
    ``aliases`` (more flag names for the same field)."""
    extras = extras or {}
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        kw: dict[str, Any] = {
            "dest": name,
            "default": None,
            "help": (info.description or "") + _default_text(info),
        }
        more = dict(extras.get(name, {}))
        aliases = more.pop("aliases", [])
        base = _base_type(info.annotation)
        if base is bool:
            kw["action"] = "store_false" if info.default is True else "store_true"
            kw["help"] = ("turn off: " if info.default is True else "") + (info.description or "")
        elif typing.get_origin(base) is Literal:
            kw["choices"] = list(typing.get_args(base))
            kw["type"] = type(kw["choices"][0])
        elif base in (int, float, str):
            kw["type"] = base
        else:
            raise TypeError(f"{model.__name__}.{name}: no flag for type {info.annotation!r} (skip it)")
        kw.update(more)
        parser.add_argument(flag_name(name, info), *aliases, **kw)


def config_overrides(args: argparse.Namespace, model: type[BaseModel], *, skip: tuple[str, ...] = ()) -> dict:
    """The fields of ``model`` given on the command line (flags left at ``None`` are not overrides)."""
    return {
        name: getattr(args, name)
        for name in model.model_fields
        if name not in skip and getattr(args, name, None) is not None
    }
