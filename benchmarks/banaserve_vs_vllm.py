"""`kvbalance` (colocated + global store + store_aware routing) against vLLM under a named router, at the
full-mode scale of `kvbalance reproduce banaserve` (15-16 s of arrivals, 5% search resolution, seed 0), on
chosen settings: the "never below vLLM's best router" part of issue 24's check (a) without rerunning every
system. vLLM's router is the one the full run found best for the setting (docs/reproductions.md).

Run: .venv/bin/python benchmarks/banaserve_vs_vllm.py --settings docqa-uniform --router cache_aware \
         --out benchmarks/results/banaserve_vs_vllm
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", required=True, help="workload names, comma-separated (llama-13b, Poisson)")
    ap.add_argument("--router", required=True, help="vLLM's router (its best for the settings)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from kvbalance.cluster.evaluate import Workbench
    from kvbalance.cluster.systems import system_config, vllm_config
    from kvbalance.reproduce.banaserve import ARRIVALS, GPU, NUM_GPUS, SEED, SETTINGS, _sizes

    names = args.settings.split(",")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = _sizes(False)
    for st in SETTINGS:
        if st.name not in names or st.arrival != "poisson" or st.model != "llama-13b":
            continue
        kind, cv = ARRIVALS[st.arrival]
        lo, hi = st.requests
        wb = Workbench(st.model, GPU, st.workload, kind, cv, st.ttft_slo_s, st.tpot_slo_s,
                       duration_s=st.span_s[1], min_requests=lo, max_requests=hi, seed=SEED,
                       resolution=sizes["resolution"])  # fmt: skip
        t0 = time.process_time()
        vllm = wb.max_rate_at_slo(vllm_config(NUM_GPUS, args.router), st.start_rps)
        # kvbalance is colocated: the split argument is unused
        ours = wb.max_rate_at_slo(
            system_config("kvbalance", NUM_GPUS, (4, 4, 1, 1)), vllm or st.start_rps, 1 + sizes["resolution"]
        )
        row = {
            "setting": st.key,
            "vllm_router": args.router,
            "vllm_max_rate_rps": vllm,
            "kvbalance_max_rate_rps": ours,
            "ratio": ours / vllm if vllm else None,
            "probes": {k: sorted(p) for k, p in wb.probes.items()},
            "cpu_s": time.process_time() - t0,
        }
        (out_dir / f"{st.name}.json").write_text(json.dumps(row, indent=1, default=str))
        print(
            f"{st.key}: vLLM ({args.router}) {vllm:.1f} req/s, kvbalance {ours:.1f} req/s, {row['ratio']:.2f}x"
        )


if __name__ == "__main__":
    main()
