"""``kvbalance sweep``: simulate the cartesian product of ``--grid`` axes over a config, in parallel."""

from __future__ import annotations

DEFAULT_OUT = "runs/sweep"


def add_backend_args(p) -> None:
    """``--workers``, ``--ray``, ``--ray-address`` (shared with ``kvbalance search``)."""
    p.add_argument("--workers", type=int, default=None, help="parallel simulations (default: CPU count)")
    p.add_argument(
        "--ray", action="store_true", help="run on a local Ray instance (pip install kvbalance[ray])"
    )
    p.add_argument("--ray-address", default=None, help="join the Ray cluster at ADDR (implies --ray)")
    p.add_argument("--serial", action="store_true", help="run in this process, one after another")


def backend_from_args(args, out: str):
    from kvbalance.search.backends import make_backend

    kind = "ray" if (args.ray or args.ray_address) else "serial" if args.serial else "process"
    return make_backend(kind, workers=args.workers, out_dir=out, ray_address=args.ray_address)


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="simulate a cartesian grid of configs in parallel (process pool or Ray)")
    p.add_argument("config", nargs="?", help="simulate YAML config (may hold a cluster: section)")
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="an axis of the grid: a config field (rate, policy, chunk_size, ...) or cluster.<field>",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true")
    add_backend_args(p)


def run(args) -> int:
    from kvbalance.commands.simulate import load_yaml
    from kvbalance.search.sweep import grid_points, parse_grid, run_sweep

    base = load_yaml(args.config) if args.config else {}
    grid = parse_grid(args.grid)
    total = len(grid_points(grid))
    backend = backend_from_args(args, args.out)
    try:
        if args.no_progress:
            summaries = run_sweep(base, grid, args.out, backend)
        else:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TextColumn("{task.description}"), transient=True) as bar:  # fmt: skip
                task = bar.add_task("", total=total)
                summaries = run_sweep(
                    base, grid, args.out, backend,
                    on_done=lambda n, name: bar.update(task, completed=n, description=name),
                )  # fmt: skip
    finally:
        backend.close()
    unfinished = sum(int(s.get("unfinished") or 0) for s in summaries)
    print(
        f"{total} points on the {backend.name} backend: wrote {args.out}/sweep.csv and <point>/summary.json"
    )
    if unfinished:
        from kvbalance.commands._util import fail

        return fail(f"{unfinished} requests neither finished nor were rejected (simulator bug)")
    return 0
