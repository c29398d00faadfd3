"""``kvbalance cost``: the cost model's predicted time of one step (prefill and/or decode batch): its GPU time,
the engine profile's host time (and the part the overlap hid), and where the GPU preset's curves come from."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("cost", help="predicted time of one step on the cost model")
    p.add_argument("--model", required=True)
    p.add_argument("--gpu", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument(
        "--engine",
        default=None,
        help="engine profile whose host time the step pays (vllm-v1, sglang, vllm-v0, kvbalance, hardware, "
        "or a profile file; default: vllm-v1 on a GPU preset)",
    )
    p.add_argument("--prefill-tokens", type=int, default=0)
    p.add_argument("--decode-batch", type=int, default=0)
    p.add_argument("--context", type=int, default=0)
    p.add_argument("--json", action="store_true")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def run(args) -> int:
    from kvbalance.perf.report import step_cost_report

    if not args.prefill_tokens and not args.decode_batch:
        args.prefill_tokens = 1024
    report = step_cost_report(
        args.model,
        args.gpu,
        args.tp,
        args.prefill_tokens,
        args.decode_batch,
        args.context,
        engine=args.engine,
    )
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    h = report["host"]
    rows = [
        ("model", report["model"]),
        ("gpu", f"{report['gpu']} x{report['tp']}: {report['gpu_fit']['summary']}"),
        ("engine", report["engine"]),
        ("step time", _ms(report["step_time_s"])),
        ("GPU time", f"{_ms(h['gpu_s'])} (compute-bound {_ms(report['compute_time_s'])}, memory-bound "
                     f"{_ms(report['memory_time_s'])}, all-reduce {_ms(report['comm_s'])}, kernel latencies "
                     f"{_ms(h['gpu_s'] - report['compute_time_s'] - report['memory_time_s'] - report['comm_s'])})"),
        ("host time", f"{_ms(h['host_work_s'])} work + {_ms(h['launch_s'])} launch"
                      f"{' (CUDA graph)' if h['cuda_graph'] else ''} + {_ms(h['sync_s'])} sync"),
        ("host exposed", _ms(h["host_exposed_s"])),
        ("host hidden", f"{_ms(h['host_hidden_s'])} (under the GPU step)"),
    ]  # fmt: skip
    for k, v in rows:
        print(f"{k:>13}: {v}")
    return 0
