"""kvbalance's own control plane per step (issue 23): the CPU time of ``Instance.step`` planning (scheduler,
KV cache manager, prefix cache, plan building) and of applying the step's result (``Instance.complete``), with
the SimExecutor's time taken out (timed separately and subtracted: the cost model is the simulator's, not the
control plane's). No model runs.

Two sweeps, each point a fresh instance (llama-2-7b shapes, a KV pool that never preempts, prefix caching on):
decode steps at a batch of 1-512 running sequences (one token each), and prefill steps of 128-8192 tokens
(one sequence, a fresh prompt each step, so every full block is hashed and inserted into the prefix cache).
CPU seconds (``time.process_time``) per step, alternating the points round by round so all see the same
machine load; the means (garbage-collection pauses included, as a real engine pays them) are fitted by least squares as ``fixed + per_seq * seqs + per_token * tokens``, the
``host_*`` parameters of the ``kvbalance`` engine profile (``kvbalance/perf/engines/kvbalance.yaml``).

    nice -n 10 .venv/bin/python benchmarks/bench_control_plane.py --out benchmarks/results/control_plane
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from kvbalance.engine import InstanceConfig, build_instance
from kvbalance.executor.sim import SimExecutor
from kvbalance.perf.cost import CostModel
from kvbalance.request import Request, SamplingParams

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PREFILL_TOKENS = (128, 512, 2048, 8192)
PROMPT = 128  # tokens of each decoding sequence's prompt


class _TimedExecutor:
    """The SimExecutor with its CPU time per call recorded (to subtract it from the step)."""

    def __init__(self, inner: SimExecutor) -> None:
        self.inner = inner
        self.last_s = 0.0

    def execute(self, plan):
        c0 = time.process_time()
        r = self.inner.execute(plan)
        self.last_s = time.process_time() - c0
        return r

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _Point:
    """One instance kept in the state of the measured step (a decode batch or a prefill of some size)."""

    def __init__(self, kind: str, size: int, seed: int) -> None:
        self.kind, self.size = kind, size
        self.rng = np.random.default_rng(seed)
        tokens = max(size, 2048)
        cfg = InstanceConfig(
            kv_tokens=1 << 22, chunk_size=tokens, max_num_seqs=max(size, 1) if kind == "decode" else 8
        )
        self.ex = _TimedExecutor(SimExecutor(CostModel("llama-2-7b", "h100-sxm")))
        self.inst = build_instance(cfg, self.ex)
        self.now = 0.0
        self.n = 0
        if kind == "decode":
            for _ in range(size):
                self._add(PROMPT, 1 << 20)
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.inst.scheduler.running) or (
                self.inst.scheduler.waiting
            ):
                self._step()

    def _add(self, prompt: int, max_tokens: int) -> None:
        ids = self.rng.integers(0, 32000, prompt)
        self.inst.add_request(
            Request(f"r{self.n}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)), self.now
        )
        self.n += 1

    def _step(self) -> tuple[float, int, int]:
        c0 = time.process_time()
        out = self.inst.step(self.now)
        self.now += out.result.duration_s
        self.inst.complete(out, self.now)
        c2 = time.process_time()
        return (c2 - c0) - self.ex.last_s, len(out.plan.seqs), out.plan.num_tokens

    def measure(self) -> tuple[float, int, int]:
        """CPU seconds of one step's control plane, its sequences and tokens."""
        if self.kind == "prefill":
            self._add(self.size, 1)  # finishes with its first token: the next prefill starts from empty
        return self._step()


def run(rounds: int, steps: int, seed: int) -> dict:
    points = [_Point("decode", b, seed + i) for i, b in enumerate(DECODE_BATCHES)]
    points += [_Point("prefill", t, seed + 100 + i) for i, t in enumerate(PREFILL_TOKENS)]
    samples: dict[int, list[tuple[float, int, int]]] = {i: [] for i in range(len(points))}
    for _ in range(rounds):
        for i, p in enumerate(points):  # round by round: every point sees the same machine load
            p.measure()  # one warm-up step per round
            for _ in range(steps):
                samples[i].append(p.measure())
    rows = []
    for i, p in enumerate(points):
        t = [s[0] for s in samples[i]]
        seqs, tokens = samples[i][0][1], samples[i][0][2]
        mean = statistics.fmean(t)
        rows.append(
            {
                "kind": p.kind,
                "seqs": seqs,
                "tokens": tokens,
                "steps": len(t),
                "mean_s": mean,
                "median_s": statistics.median(t),
                "q1_s": statistics.quantiles(t, n=4)[0],
                "q3_s": statistics.quantiles(t, n=4)[2],
                "per_seq_s": mean / seqs,
                "per_token_s": mean / tokens,
            }
        )
    a = np.array([[1.0, r["seqs"], r["tokens"] - r["seqs"]] for r in rows])  # tokens beyond one per sequence
    y = np.array([r["mean_s"] for r in rows])
    w = 1.0 / y  # relative error: every point counts alike
    coef, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    coef = np.maximum(coef, 0.0)
    fit = {"host_fixed_s": coef[0], "host_per_seq_s": coef[1], "host_per_token_s": coef[2]}
    pred = a @ coef
    for r, p in zip(rows, pred):
        r["fit_s"] = float(p)
        r["fit_error"] = float(p / r["mean_s"] - 1.0)
    return {
        "what": "kvbalance control plane CPU seconds per step (Instance.step planning + Instance.complete, "
        "SimExecutor time subtracted), llama-2-7b shapes, prefix caching on",
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "rounds": rounds,
        "steps_per_round": steps,
        "rows": rows,
        "fit": {k: float(v) for k, v in fit.items()},
        "fit_note": "step = host_fixed_s + host_per_seq_s * seqs + host_per_token_s * (tokens - seqs): "
        "weighted least squares on the means (relative error; the mean, not the median, so that the "
        "garbage collector's pauses, which a real engine pays too, count); the per-token term prices prompt "
        "tokens beyond a decode's one",
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="steps timed per point and round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for control_plane.json")
    args = p.parse_args()
    res = run(args.rounds, args.steps, args.seed)
    res["cpu"] = _cpu_name()
    print(f"control plane CPU time per step on {res['cpu']} (mean of {args.rounds} x {args.steps} steps)")
    print(
        f"{'kind':8s} {'seqs':>5s} {'tokens':>6s} {'ms/step':>8s} {'median':>8s} {'us/seq':>7s} "
        f"{'us/token':>8s} {'fit err':>7s}"
    )
    for r in res["rows"]:
        print(
            f"{r['kind']:8s} {r['seqs']:5d} {r['tokens']:6d} {1e3 * r['mean_s']:8.3f} {1e3 * r['median_s']:8.3f} "
            f"{1e6 * r['per_seq_s']:7.1f} {1e6 * r['per_token_s']:8.2f} {100 * r['fit_error']:+6.1f}%"
        )
    f = res["fit"]
    print(
        f"fit: {1e6 * f['host_fixed_s']:.1f} us + {1e6 * f['host_per_seq_s']:.2f} us/seq "
        f"+ {1e6 * f['host_per_token_s']:.3f} us/prompt token"
    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "control_plane.json").write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {out / 'control_plane.json'}")


if __name__ == "__main__":
    main()
