"""Migration costs on the paper's setting (llama-13b / opt-13b on A100-80GB): what each move costs and
what a step costs after it, from ``kvbalance.perf.migration`` (a 2x2048-token prefill batch for the
layer move, 32 decodes at 1k context for the attention move). Prints a table; writes
benchmarks/results/migration.json.

Run: .venv/bin/python benchmarks/bench_migration.py
"""

from __future__ import annotations

import json
from pathlib import Path

from kvbalance.perf.cost import CostModel
from kvbalance.perf.migration import (
    attention_migration_cost,
    attention_split_step,
    layer_migration_cost,
    live_migration_cost,
    pipeline_step,
)

DECODES, CONTEXT = 32, 1024  # a decode batch of 32 requests at 1k tokens of context
PREFILL = [(2048, 2048, True)] * 2


def rows_for(model: str, gpu: str = "a100-80gb") -> list[dict]:
    cm = CostModel(model, gpu)
    L = cm.model.num_layers
    decode = [(1, CONTEXT, True)] * DECODES
    step_dec = cm.step_seconds(decode)
    step_pre = cm.step_seconds(PREFILL)
    rows = []
    for link in ("nvlink", "net-100g"):
        quarter = (3 * L // 4, L)
        lm = layer_migration_cost(
            cm, quarter, DECODES * CONTEXT, link, DECODES / step_dec, num_requests=DECODES
        )
        p = pipeline_step(cm, cm, PREFILL, quarter[0], link)
        rows.append(
            {
                "model": model,
                "link": link,
                "move": f"layers [{quarter[0]}, {L})",
                "bytes_gb": lm.total_bytes / 1e9,
                "transfer_s": lm.transfer_s,
                "step_before_s": step_pre,
                "step_after_s": p.latency_s,
                "home_busy_after_s": p.stage1.total_s,
                "helper_busy_s": p.stage2.total_s,
            }
        )
        heads = cm.model.num_kv_heads // 4
        nbytes, secs = attention_migration_cost(cm, heads, DECODES * CONTEXT, link)
        s = attention_split_step(cm, cm, decode, heads / cm.model.num_kv_heads, 1.0, link)
        rows.append(
            {
                "model": model,
                "link": link,
                "move": f"{heads} KV heads of {DECODES} decodes",
                "bytes_gb": nbytes / 1e9,
                "transfer_s": secs,
                "step_before_s": step_dec,
                "step_after_s": s.step_s,
                "home_busy_after_s": s.home_busy_s,
                "helper_busy_s": s.helper_busy_s,
            }
        )
        live = live_migration_cost(2048, 1 / step_dec, 16, 16 * cm.kv_bytes_per_token, link)
        rows.append(
            {
                "model": model,
                "link": link,
                "move": f"one 2k-token request (Llumnix, {live.rounds} rounds)",
                "bytes_gb": live.total_bytes / 1e9,
                "transfer_s": live.total_s,
                "step_before_s": step_dec,
                "step_after_s": step_dec,
                "downtime_s": live.downtime_s,
            }
        )
    return rows


def main() -> list[dict]:
    rows = rows_for("llama-13b") + rows_for("opt-13b")
    head = ("model", "link", "move", "GB", "move ms", "step ms", "after ms", "home ms", "helper|down ms")
    print(f"{head[0]:10} {head[1]:9} {head[2]:40} " + " ".join(f"{h:>9}" for h in head[3:]))
    for r in rows:
        ms = [r["transfer_s"], r["step_before_s"], r["step_after_s"], r.get("home_busy_after_s", 0)]
        ms.append(r.get("helper_busy_s", r.get("downtime_s", 0)))
        print(
            f"{r['model']:10} {r['link']:9} {r['move']:40} {r['bytes_gb']:9.2f} "
            + " ".join(f"{1e3 * x:9.2f}" for x in ms)
        )
    out = Path(__file__).parent / "results" / "migration.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
