"""The CPU step budgets: LLMEngine's defaults are the measured choice, and the CLI commands mirror them."""

from __future__ import annotations

import argparse
import inspect

from kvbalance.commands import serve
from kvbalance.llm.engine import LLMEngine
from kvbalance.offline.runner import add_run_arguments


def engine_defaults() -> tuple[int, int]:
    params = inspect.signature(LLMEngine.__init__).parameters
    return params["max_num_batched_tokens"].default, params["max_num_seqs"].default


def test_engine_defaults_are_the_measured_cpu_budget():
    # issue 12 item 3: 2,048 batched tokens / 256 sequences beat 512 / 64 on both trace draws at bf16
    assert engine_defaults() == (2048, 256)


def test_serve_defaults_mirror_the_engine():
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert (args.chunk_size, args.max_num_seqs) == engine_defaults()


def test_offline_run_defaults_mirror_the_engine():
    parser = argparse.ArgumentParser()
    add_run_arguments(parser, positional_input=False)
    args = parser.parse_args([])
    assert (args.max_num_batched_tokens, args.max_num_seqs) == engine_defaults()
