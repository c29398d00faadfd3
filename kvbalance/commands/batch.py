"""``kvbalance batch run INPUT --output OUT``: an OpenAI Batch file through the real engine (temporary home).

The flags and the work live in :mod:`kvbalance.offline.runner` (``add_run_arguments`` / ``run_command``), so
this module goes away once ``kvbalance offline run`` takes them over.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("batch", help="OpenAI Batch API files with the real engine")
    sub = p.add_subparsers(dest="batch_command", required=True)
    run = sub.add_parser(
        "run",
        help="generate a Batch input file in the planned order; rerun with the same --output to resume",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from kvbalance.offline.runner import add_run_arguments

    add_run_arguments(run)


def run(args: argparse.Namespace) -> int:
    from kvbalance.offline.runner import run_command

    return run_command(args)
