"""Every setting is declared once: the simulate flags and docs/configuration.md come from the config models."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvbalance.cli import build_parser
from kvbalance.commands import config_reference
from kvbalance.commands._config_flags import add_config_flags, config_overrides, flag_name
from kvbalance.sim.config import SimulateConfig

ROOT = Path(__file__).resolve().parents[1]


def _simulate_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["simulate"]


def test_every_simulate_config_field_has_a_flag_and_a_description():
    flags = {s for a in _simulate_parser()._actions for s in a.option_strings}
    for name, info in SimulateConfig.model_fields.items():
        assert flag_name(name, info) in flags, f"{name}: no simulate flag"
        assert info.description, (
            f"SimulateConfig.{name}: no description (the flag's help and the docs use it)"
        )


def test_flags_override_only_what_was_typed():
    p = _simulate_parser()
    args = p.parse_args(["--chunk-size", "256", "--no-prefix-caching", "--ttft-slo", "0.5", "--rate", "inf"])
    got = config_overrides(args, SimulateConfig)
    assert got == {"chunk_size": 256, "enable_prefix_caching": False, "ttft_slo_s": 0.5, "rate": float("inf")}
    assert config_overrides(p.parse_args([]), SimulateConfig) == {}


def test_literal_fields_become_choices():
    with pytest.raises(SystemExit):
        _simulate_parser().parse_args(["--arrival", "uniform"])


def test_a_field_of_an_unsupported_type_is_a_named_error():
    from pydantic import BaseModel

    class Odd(BaseModel):
        pairs: list[int] = []

    with pytest.raises(TypeError, match="Odd.pairs"):
        add_config_flags(argparse.ArgumentParser(), Odd)


def test_the_committed_configuration_page_is_what_the_models_write():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_reference.render(), (
        "docs/configuration.md is stale: python -m kvbalance.commands.config_reference docs/configuration.md"
    )


def test_the_reference_lists_every_field_of_every_section():
    text = config_reference.render()
    for _, _, model, _ in config_reference.sections():
        for name in model.model_fields:
            assert f"| `{name}` |" in text
