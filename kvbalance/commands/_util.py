"""Helpers shared by the subcommands: argument types and the one-line error format."""

from __future__ import annotations

import argparse
import math
import sys


def parse_rate(text: str) -> float:
    """A request rate: a positive number, or ``inf`` (every request at time 0)."""
    if text.lower() in ("inf", "infinity"):
        return math.inf
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"rate: not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rate: must be > 0 or inf, got {text}")
    return value


def fail(message: str) -> int:
    """Print one line naming the field and return the CLI's error exit code."""
    print(f"kvbalance: error: {message}", file=sys.stderr)
    return 2
