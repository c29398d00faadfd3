"""The ``kvbalance`` subcommands, one module each (``add_parser(subparsers)``, ``run(args) -> int``)."""
