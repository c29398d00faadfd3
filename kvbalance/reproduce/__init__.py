"""``kvbalance reproduce NAME``: experiments that reproduce the papers' headline results.

Each experiment is a module ``kvbalance.reproduce.NAME`` with ``run(out_dir: Path, quick: bool) -> dict``
that writes a table (CSV), plots (PNG) and ``results.json`` into ``out_dir`` and returns the results.
"""

from __future__ import annotations

EXPERIMENTS = {
    "queueing": "queueing-theory stability: mu from theory vs the simulator's saturation throughput",
    "elastic": "elastic KV reserve: chunk sizes vs elastic lending vs static overcommit",
    "banaserve": "BanaServe: vLLM, DistServe and BanaServe (+ ablations) on 8 GPUs, SLO rate / throughput / latency",
    "blendserve": "offline batch inference: blendserve vs DFS-ordered vLLM/SGLang/NanoFlow, LPM, balance",
}
