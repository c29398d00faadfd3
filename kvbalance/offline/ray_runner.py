"""Data-parallel Batch runs: N engine replicas as Ray actors, each generating one balanced rank of the plan.

``RayBackend(spec, n)`` starts a local Ray instance (``ray.init(num_cpus=..., include_dashboard=False)``)
or joins one at ``address``, builds one :class:`~kvbalance.offline.batch_worker.BatchWorker` per actor from
the picklable :class:`EngineSpec`, and speaks the runner's ``Backend`` protocol: ``prepare`` is split over
the replicas, ``generate(shards)`` streams each actor's finished records back (Ray streaming generators)
and merges them as they come, so the driver journals them at once and a crash loses nothing written.
The runner takes the shards from ``plan.ranks(n)`` (BlendServe section 4.5: balanced subtrees, one per
rank); greedy outputs equal a single replica's. Needs ``pip install kvbalance[ray]``.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

from kvbalance.offline.batch_worker import BatchWorker, EngineSpec, PreparedRequest, Records, ReplicaInfo

_DONE = object()


def merge_streams(streams: list[Callable[[], Iterable[Records]]]) -> Iterator[Records]:
    """Run each stream (a thunk returning an iterable) in its own thread; yield items as they arrive.

    The first stream to fail raises its exception here, after the items that came before it.
    """
    q: queue.Queue = queue.Queue()

    def pump(make: Callable[[], Iterable[Records]]) -> None:
        try:
            for item in make():
                q.put((True, item))
        except BaseException as e:  # handed to the consumer, which re-raises it
            q.put((False, e))
        finally:
            q.put((True, _DONE))

    threads = [threading.Thread(target=pump, args=(s,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    live = len(threads)
    while live:
        ok, item = q.get()
        if not ok:
            raise item
        if item is _DONE:
            live -= 1
        else:
            yield item


class _Replica:
    """The actor: one BatchWorker over an engine built from ``source`` (an EngineSpec or a factory)."""

    def __init__(self, source, served_model: str | None) -> None:
        engine = source if isinstance(source, EngineSpec) else source()
        self.worker = BatchWorker(engine, served_model)

    def info(self) -> ReplicaInfo:
        return self.worker.info()

    def prepare(self, items):
        return self.worker.prepare(items)

    def generate(self, shard: list[PreparedRequest]):
        yield from self.worker.generate(shard)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("data-parallel: needs Ray (pip install 'kvbalance[ray]')") from None
    return ray


class RayBackend:
    """``num_replicas`` BatchWorkers as Ray actors (one CPU each, or ``gpus_per_replica`` GPUs)."""

    def __init__(
        self,
        source: EngineSpec | Callable,
        num_replicas: int,
        *,
        address: str | None = None,
        num_cpus: int | None = None,
        gpus_per_replica: float = 0.0,
        served_model: str | None = None,
    ) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"data-parallel: must be a positive integer, got {num_replicas!r}")
        if num_cpus is not None and num_cpus < 1:
            raise ValueError(f"num-cpus: must be >= 1, got {num_cpus}")
        ray = self._ray = _import_ray()
        self.num_replicas = num_replicas
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if address is None:
                num_cpus = num_cpus or max(num_replicas, os.cpu_count() or 1)
                ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
        if isinstance(source, EngineSpec) and source.num_threads is None:
            total = num_cpus or int(ray.cluster_resources().get("CPU", 1))
            source = dataclasses.replace(source, num_threads=max(1, total // num_replicas))
        actor_cls = ray.remote(num_cpus=1, num_gpus=gpus_per_replica)(_Replica)
        self.actors = [actor_cls.remote(source, served_model) for _ in range(num_replicas)]
        self._info: ReplicaInfo | None = None

    def info(self) -> ReplicaInfo:
        if self._info is None:
            self._info = self._ray.get(self.actors[0].info.remote())
        return self._info

    def prepare(self, items):
        """Tokenise and check ``items`` split over the replicas (in order)."""
        n = self.num_replicas
        size = -(-len(items) // n) if items else 0
        refs = [a.prepare.remote(items[k * size : (k + 1) * size]) for k, a in enumerate(self.actors) if size]
        return [p for part in self._ray.get(refs) for p in part]

    def generate(self, shards: list[list[PreparedRequest]]) -> Iterator[Records]:
        if len(shards) > self.num_replicas:
            raise ValueError(f"shards: {len(shards)} given for {self.num_replicas} replicas")
        ray = self._ray

        def stream(actor, shard):
            return lambda: (
                ray.get(ref) for ref in actor.generate.options(num_returns="streaming").remote(shard)
            )

        yield from merge_streams([stream(a, s) for a, s in zip(self.actors, shards) if s])

    def close(self) -> None:
        for a in self.actors:
            self._ray.kill(a)
        self.actors = []
        if self._owns_ray:
            self._ray.shutdown()
            self._owns_ray = False
