"""Starting a real cluster on Ray and serving it: ``kvbalance serve --cluster CLUSTER.yaml``.

``start_ray`` starts a local Ray (``ray.init(num_cpus=..., include_dashboard=False)``, its temp dir under the
run folder) or joins one at ``address``. ``launch`` starts the global KV store actor (when the config has
``store:``) and one :class:`~kvbalance.raycluster.actor.InstanceWorker` actor per instance, each declaring
the CPUs its ``cpu_cores`` name (1 when unbound) and its ``num_gpus``, waits for them to load their models
and returns a :class:`RayCluster` whose ``backend`` the server's front end serves (``create_app``: the same
routes, streaming, errors, API key, limits; ``/metrics`` gains the per-instance and router series).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvbalance.executor.cpu_affinity import parse_cores
from kvbalance.raycluster.actor import InstanceSpec, InstanceWorker
from kvbalance.raycluster.backend import ClusterBackend, Slot
from kvbalance.raycluster.config import EngineArgs, ServeClusterConfig
from kvbalance.raycluster.store import KVStoreActor

RAY_SOCKET_SUFFIX_BYTES = 70  # "/session_2026-12-03_14-50-55_145613_7427/sockets/plasma_store", with room
STARTUP_TIMEOUT_S = 600.0  # actors loading their models (SmolLM2's first conversion takes a while)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("cluster: serving a cluster needs Ray (pip install 'kvbalance[ray]')") from None
    return ray


def start_ray(
    address: str | None = None, num_cpus: int | None = None, temp_dir: str | Path | None = None
) -> bool:
    """Start a local Ray (or join ``address``) unless one is running here; True if this call started it."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        return True
    kwargs = {}
    if temp_dir is not None:
        kwargs["_temp_dir"] = short_temp_dir(temp_dir)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **kwargs)
    return True


def short_temp_dir(temp_dir: str | Path) -> str:
    """``temp_dir`` (created), or a short link to it under /tmp when Ray's socket paths under it would pass
    the 107-byte limit of a Unix socket path (Ray adds ``session_<date>_<pid>/sockets/plasma_store``)."""
    path = Path(temp_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    if len(str(path)) + RAY_SOCKET_SUFFIX_BYTES <= 107:
        return str(path)
    link = Path(tempfile.mkdtemp(prefix="kvb-ray-"))
    link.rmdir()
    link.symlink_to(path, target_is_directory=True)
    return str(link)


def cpus_of(cores: str | None) -> int:
    return 1 if cores is None else len(parse_cores(cores))


@dataclass
class RayCluster:
    backend: ClusterBackend
    store: object
    owns_ray: bool

    def close(self) -> None:
        ray = import_ray()
        self.backend.close()
        if self.store is not None:
            ray.kill(self.store, no_restart=True)
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False


def launch(
    engine: EngineArgs,
    cfg: ServeClusterConfig,
    *,
    address: str | None = None,
    run_dir: str | Path | None = None,
    num_cpus: int | None = None,
) -> RayCluster:
    """Start (or join) Ray, the store and one actor per instance; the cluster's backend, ready to serve."""
    from kvbalance.model.weights import load_model

    plan = cfg.instance_plan()
    declared = sum(cpus_of(cores) for _, _, cores, _ in plan)
    if num_cpus is None:
        num_cpus = max(declared, os.cpu_count() or 1)
    loaded = load_model(engine.model, seed=engine.seed)  # the front end's tokenizer; converts SmolLM2 once
    tokenizer, config = loaded.tokenizer, loaded.config
    del loaded
    temp_dir = Path(run_dir) / "ray" if run_dir is not None else None
    owns = start_ray(address, num_cpus, temp_dir)
    ray = import_ray()
    try:
        store = None
        if cfg.store is not None:
            from kvbalance.executor.torch import resolve_dtype

            kv_dtype = resolve_dtype(engine.dtype, config, engine.device)
            block_size = engine.block_size or (64 if engine.device.startswith("cpu") else 16)
            nbytes = (
                config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * kv_dtype.itemsize
            )
            store = ray.remote(num_cpus=0, max_restarts=0)(KVStoreActor).remote(
                cfg.store.to_store_config(), nbytes
            )
        actors = []
        kwargs = engine.engine_kwargs()
        if cfg.policy is not None:
            kwargs["policy"] = cfg.policy
        for name, role, cores, gpus in plan:
            spec = InstanceSpec(name, role, engine.model, kwargs, cores, engine.threads)
            cls = ray.remote(num_cpus=cpus_of(cores), num_gpus=gpus, max_restarts=0)(InstanceWorker)
            actors.append((spec, cls.remote(spec, store)))
        try:
            infos = ray.get([a.info.remote() for _, a in actors], timeout=STARTUP_TIMEOUT_S)
        except Exception as exc:
            raise ValueError(
                f"cluster: an instance failed to start ({type(exc).__name__}: {exc})"[:2000]
            ) from None
        slots = [
            Slot(i, spec.name, spec.role, a, info) for i, ((spec, a), info) in enumerate(zip(actors, infos))
        ]
        if store is not None and any(
            s.role != "decode" and s.info.kv_bytes_per_block != nbytes for s in slots
        ):
            raise ValueError("store: the instances' KV blocks differ in size from the store's")
        backend = ClusterBackend(slots, cfg, model_name=engine.model, tokenizer=tokenizer, store=store)
    except BaseException:
        if owns:
            ray.shutdown()
        raise
    return RayCluster(backend, store, owns)


def create_cluster_app(cluster: RayCluster, **app_kwargs):
    """The server's app over the cluster's backend, with the per-instance and router metrics registered."""
    from kvbalance.raycluster.metrics import ClusterCollector
    from kvbalance.server.app import create_app
    from kvbalance.server.async_engine import AsyncEngine

    max_queue = app_kwargs.pop("max_queue", 256)
    max_prompt_chars = app_kwargs.pop("max_prompt_chars", None)
    aengine = AsyncEngine(cluster.backend, max_queue=max_queue, max_prompt_chars=max_prompt_chars)
    aengine.metrics.registry.register(ClusterCollector(cluster.backend))
    return create_app(aengine, **app_kwargs), aengine


def serve_cluster(
    engine: EngineArgs,
    cfg: ServeClusterConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    address: str | None = None,
    run_dir: str | Path | None = None,
    served_model_name: str | None = None,
    max_queue: int = 256,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
    max_prompt_chars: int | None = None,
    drain_timeout_s: float = 30.0,
    log_level: str = "info",
) -> None:
    """Launch the cluster and serve the OpenAI API over it with uvicorn until interrupted."""
    from kvbalance.server.app import DEFAULT_MAX_BODY_BYTES
    from kvbalance.server.serving import make_server

    if not 0 <= port <= 65535:
        raise ValueError(f"port: must be in 0..65535, got {port}")
    cluster = launch(engine, cfg, address=address, run_dir=run_dir)
    try:
        app, aengine = create_cluster_app(
            cluster,
            model_name=served_model_name or engine.model,
            max_queue=max_queue,
            api_key=api_key,
            max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
            max_prompt_chars=max_prompt_chars,
        )
        try:
            make_server(app, host, port, drain_timeout_s=drain_timeout_s, log_level=log_level).run()
        finally:
            aengine.shutdown()
    finally:
        cluster.close()
