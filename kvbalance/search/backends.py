"""Where sweep points and search candidates run: a local process pool (default) or Ray.

Both take a picklable module-level function and a list of inputs and yield ``(index, result)`` in completion
order, with at most ``max_in_flight`` tasks submitted at once (the Ray idiom: submit, ``ray.wait`` for the
next finished one, submit another). Every task fixes its own seeds from its input, so results do not depend
on the backend, the worker count or the completion order; callers sort by index. ``serial`` runs in this
process (tests, debugging). Ray: ``pip install kvbalance[ray]``; a local start is
``ray.init(num_cpus=..., include_dashboard=False)`` with its temp dir under the output folder, and
``close()`` shuts down what this backend started.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

BACKENDS = ("process", "ray", "serial")
_UNIX_SOCKET_MAX = 107  # bytes in an AF_UNIX path (Linux); Ray puts its sockets under the temp dir
_RAY_SOCKET_SUFFIX = 70  # about what Ray appends: /session_<date>_<pid>/sockets/plasma_store
SMALL_SHM_BYTES = 2 << 30  # below this /dev/shm, Ray's object store falls back to disk (slower)


class SerialBackend:
    name = "serial"

    def imap(self, fn: Callable, items: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        for i, item in enumerate(items):
            yield i, fn(item)

    def close(self) -> None:
        pass


class ProcessBackend:
    """``workers`` processes (default: the CPU count) of a ``ProcessPoolExecutor``."""

    name = "process"

    def __init__(self, workers: int | None = None, max_in_flight: int | None = None) -> None:
        self.workers = _positive("workers", workers or os.cpu_count() or 1)
        self.max_in_flight = _positive("max_in_flight", max_in_flight or 2 * self.workers)
        self._pool = ProcessPoolExecutor(max_workers=self.workers)

    def imap(self, fn: Callable, items: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        pending: dict = {}
        queue = iter(enumerate(items))
        for i, item in queue:
            pending[self._pool.submit(fn, item)] = i
            if len(pending) >= self.max_in_flight:
                break
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                yield i, fut.result()
                nxt = next(queue, None)
                if nxt is not None:
                    pending[self._pool.submit(fn, nxt[1])] = nxt[0]

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("ray: needs Ray (pip install 'kvbalance[ray]')") from None
    return ray


def ray_temp_dir(out_dir: str | Path) -> str:
    """``<out_dir>/ray`` (absolute) when Ray's socket paths fit under it, else a short folder in the system
    temp dir (with a warning): Ray's AF_UNIX sockets live under the temp dir and their paths are capped."""
    want = Path(out_dir).resolve() / "ray"
    if len(str(want)) + _RAY_SOCKET_SUFFIX <= _UNIX_SOCKET_MAX:
        want.mkdir(parents=True, exist_ok=True)
        return str(want)
    short = tempfile.mkdtemp(prefix="kvb-ray-")
    warnings.warn(f"ray: {want} is too long for Ray's socket paths; its temp dir is {short}", stacklevel=2)
    return short


def warn_small_shm(path: str = "/dev/shm") -> bool:
    """Warn (and return True) when ``path`` is smaller than 2 GiB: Ray's object store then spills to disk."""
    try:
        total = shutil.disk_usage(path).total
    except OSError:
        return False
    if total < SMALL_SHM_BYTES:
        warnings.warn(
            f"ray: {path} holds only {total / 2**30:.2f} GiB; Ray's object store falls back to disk "
            "(give the container --shm-size=2g or more)",
            stacklevel=2,
        )
        return True
    return False


class RayBackend:
    """Tasks on Ray: a local instance of ``num_cpus`` CPUs (temp dir under ``out_dir``) or the cluster at
    ``address``. One CPU per task; at most ``max_in_flight`` tasks submitted (default 2 x the cluster's CPUs)."""

    name = "ray"

    def __init__(
        self,
        out_dir: str | Path,
        *,
        num_cpus: int | None = None,
        address: str | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        ray = self._ray = _import_ray()
        self._owns = not ray.is_initialized()
        if self._owns:
            if address is None:
                warn_small_shm()
                ray.init(
                    num_cpus=_positive("workers", num_cpus or os.cpu_count() or 1),
                    include_dashboard=False,
                    log_to_driver=False,
                    _temp_dir=ray_temp_dir(out_dir),
                    object_store_memory=200 << 20,  # results are small JSON-like dicts
                )
            else:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.max_in_flight = _positive("max_in_flight", max_in_flight or 2 * cpus)
        self._remote = ray.remote(num_cpus=1)(_call)

    def imap(self, fn: Callable, items: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        ray = self._ray
        pending: dict = {}
        queue = iter(enumerate(items))
        fn_ref = ray.put(fn)
        for i, item in queue:
            pending[self._remote.remote(fn_ref, item)] = i
            if len(pending) >= self.max_in_flight:
                break
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                i = pending.pop(ref)
                yield i, ray.get(ref)
                nxt = next(queue, None)
                if nxt is not None:
                    pending[self._remote.remote(fn_ref, nxt[1])] = nxt[0]

    def close(self) -> None:
        if self._owns:
            self._ray.shutdown()
            self._owns = False


def _call(fn: Callable, item: Any) -> Any:
    return fn(item)


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    return value


def make_backend(
    kind: str = "process",
    *,
    workers: int | None = None,
    out_dir: str | Path = ".",
    ray_address: str | None = None,
    max_in_flight: int | None = None,
):
    """The backend named ``kind`` (``process``, ``ray`` or ``serial``); ``ray_address`` implies Ray."""
    if ray_address is not None:
        kind = "ray"
    if kind == "serial":
        return SerialBackend()
    if kind == "process":
        return ProcessBackend(workers, max_in_flight)
    if kind == "ray":
        return RayBackend(out_dir, num_cpus=workers, address=ray_address, max_in_flight=max_in_flight)
    raise ValueError(f"backend: unknown {kind!r} (known: {', '.join(BACKENDS)})")
