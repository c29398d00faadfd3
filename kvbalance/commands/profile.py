"""``kvbalance profile``: time the real executor here, fit a CPU hardware preset and validate it."""

from __future__ import annotations

from kvbalance.profile import DEFAULT_OUT


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="time the real executor here, fit a CPU hardware preset, validate it")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="compute threads (torch.set_num_threads)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="a handful of grid points and a small validation run")
    p.add_argument("--no-validate", action="store_true", help="profile and fit only")
    p.add_argument("--num-requests", type=int, help="validation requests")
    p.add_argument("--max-input", type=int, dest="max_input_tokens", help="cap on validation prompt lengths")
    p.add_argument(
        "--max-output", type=int, dest="max_output_tokens", help="cap on validation output lengths"
    )
    p.add_argument("--chunk-size", type=int, help="token budget per step (real engine and simulation)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--kv-tokens", type=int, help="KV capacity in tokens (real engine and simulation)")
    p.add_argument("--repeats", type=int, help="timed repeats per grid point (median)")
    p.add_argument("--seed", type=int)
    p.add_argument("--clock", choices=["wall", "cpu"], help="fit/validate on wall time (default) or CPU time")


def run(args) -> int:
    from kvbalance.profile import ProfileConfig, run_profile

    kw = {k: getattr(args, k) for k in ("num_requests", "max_input_tokens", "max_output_tokens", "chunk_size",
                                         "max_num_seqs", "kv_tokens", "repeats", "seed", "clock")}  # fmt: skip
    kw = {k: v for k, v in kw.items() if v is not None}
    kw.update(threads=args.threads, validate=not args.no_validate)
    cfg = (
        ProfileConfig.quick_config(args.model, **kw) if args.quick else ProfileConfig(model=args.model, **kw)
    )
    result = run_profile(cfg, args.out)
    v = result.get("validation")
    if v is not None and not v["within_20pct"]:
        print("note: the fitted preset missed the real run by more than 20% (see validation.json)")
    return 0
