"""``kvbalance`` command line: one module per subcommand under :mod:`kvbalance.commands`.

Each command module has ``add_parser(subparsers)`` and ``run(args) -> int`` and imports what it needs
inside ``run`` (so ``kvbalance simulate`` never loads torch). Every subcommand turns bad input into one
clear line naming the field and a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvbalance.commands._util import fail

# subcommand name -> module under kvbalance.commands (a new command is one new module and one line here)
COMMANDS = {
    "simulate": "simulate",
    "cost": "cost",
    "capacity": "capacity",
    "reproduce": "reproduce",
    "serve": "serve",
    "bench": "bench",
    "profile": "profile",
    "offline": "offline",
    "calibrate": "calibrate",
    "sweep": "sweep",
    "search": "search",
}


def _module(name: str):
    return importlib.import_module(f"kvbalance.commands.{COMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbalance", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    for name in COMMANDS:
        _module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["simulate", *(argv or [])])
    try:
        return _module(args.command).run(args)
    except (ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        return fail(str(msg))


if __name__ == "__main__":
    sys.exit(main())
