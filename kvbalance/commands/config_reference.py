"""The configuration reference (``docs/configuration.md``), written from the config models themselves.

Each section is one pydantic model: its keys with type, default, the ``simulate`` flag that sets it (where
there is one) and the field's description. Nothing is listed by hand, so the page cannot drift from the
code; ``tests/test_config_reference.py`` checks that the committed page equals what this writes.

    python -m kvbalance.commands.config_reference docs/configuration.md
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from kvbalance.commands._config_flags import flag_name

HEADER = """# Configuration reference

`kvbalance simulate CONFIG.yaml` reads a YAML mapping whose keys are the fields below; a flag given on the
command line overrides the file. An unknown key, a value of the wrong type or out of range stops the run
with one line naming the key. This page is generated from the config models
(`python -m kvbalance.commands.config_reference docs/configuration.md`); do not edit it by hand.
"""


def _type_text(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(annotation))
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    if text is None:
        text = str(annotation).replace("typing.", "")
    for mod in ("kvbalance.cluster.config.", "kvbalance.cluster.adaptive.", "kvbalance.cluster.llumnix."):
        text = text.replace(mod, "")
    return text.replace("|", "\\|")


def _default_text(info) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump() for v in value]
    return f"`{value}`"


def model_table(model: type[BaseModel], *, flags: bool) -> str:
    head = "| key | type | default | flag | description |\n| --- | --- | --- | --- | --- |\n"
    if not flags:
        head = "| key | type | default | description |\n| --- | --- | --- | --- |\n"
    rows = []
    for name, info in model.model_fields.items():
        cells = [f"`{name}`", _type_text(info.annotation), _default_text(info)]
        if flags:
            cells.append(f"`{flag_name(name, info)}`")
        cells.append((info.description or "").replace("|", "\\|").replace("\n", " "))
        rows.append("| " + " | ".join(cells) + " |\n")
    return head + "".join(rows)


def sections() -> list[tuple[str, str, type[BaseModel], bool]]:
    """(heading, text, model, has flags) for every config section, top-level first."""
    from kvbalance.cluster.adaptive import MigrationSection
    from kvbalance.cluster.config import ClusterConfig, InstanceGroup, StoreSection
    from kvbalance.cluster.llumnix import LlumnixSection
    from kvbalance.sim.config import SimulateConfig

    return [
        ("Top level", "One instance (or every instance of a cluster): model, GPU, workload, batching.",
         SimulateConfig, True),
        ("`cluster:`", "Many instances on one clock (`kvbalance/cluster/`).", ClusterConfig, False),
        ("`cluster.instances[]`", "A group of instances of one role.", InstanceGroup, False),
        ("`cluster.store:`", "The global KV store shared by the instances.", StoreSection, False),
        ("`cluster.migration:`", "BanaServe's adaptive layer- and attention-level migration.",
         MigrationSection, False),
        ("`cluster.llumnix:`", "Llumnix's request-level live migration between colocated instances.",
         LlumnixSection, False),
    ]  # fmt: skip


def render() -> str:
    parts = [HEADER]
    for heading, text, model, flags in sections():
        parts.append(f"\n## {heading}\n\n{text}\n\n{model_table(model, flags=flags)}")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if argv:
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
