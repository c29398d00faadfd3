"""Running the app with uvicorn, with a bounded drain at shutdown.

On SIGINT/SIGTERM uvicorn stops accepting connections and waits for the open ones; ``DrainingServer``
gives requests in flight ``drain_timeout_s`` to finish, then ends the rest (their streams get an error
event and ``[DONE]``, non-streaming ones a 503) so the process exits instead of waiting on a long stream.
"""

from __future__ import annotations

import asyncio

import uvicorn

from kvbalance.server.app import DEFAULT_MAX_BODY_BYTES, create_app

DEFAULT_DRAIN_TIMEOUT_S = 30.0


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose shutdown drains the app's engine for at most ``drain_timeout_s``."""

    def __init__(
        self, config: uvicorn.Config, aengine, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    ) -> None:
        if not drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s: must be >= 0, got {drain_timeout_s}")
        if config.timeout_graceful_shutdown is None:  # a backstop should the ended streams not close
            config.timeout_graceful_shutdown = int(drain_timeout_s) + 5
        super().__init__(config)
        self.aengine = aengine
        self.drain_timeout_s = drain_timeout_s
        self.num_cut_at_shutdown: int | None = None

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.ensure_future(self.aengine.drain(self.drain_timeout_s))
        try:
            await super().shutdown(sockets)
        finally:  # the connections may close before the drain's next look: let it see that
            done, _ = await asyncio.wait({drain}, timeout=self.drain_timeout_s + 1.0)
            if done and not drain.cancelled() and drain.exception() is None:
                self.num_cut_at_shutdown = drain.result()
            drain.cancel()


def make_server(
    app,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    **config,
) -> DrainingServer:
    """A ``DrainingServer`` for an app made by ``create_app`` (``config`` goes to ``uvicorn.Config``)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port: must be in 0..65535, got {port}")
    cfg = uvicorn.Config(app, host=host, port=port, **config)
    return DrainingServer(cfg, app.state.engine, drain_timeout_s)


def serve(
    model: str = "smollm2-135m",
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    max_queue: int = 256,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_prompt_chars: int | None = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    log_level: str = "info",
    **engine_kwargs,
) -> None:
    """Load ``model`` into an ``LLMEngine`` (``engine_kwargs`` go to it) and serve the API with uvicorn."""
    from kvbalance.llm import LLMEngine

    if not 0 <= port <= 65535:
        raise ValueError(f"port: must be in 0..65535, got {port}")
    engine = LLMEngine(model, **engine_kwargs)
    app = create_app(
        engine,
        served_model_name or model,
        max_queue=max_queue,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_prompt_chars=max_prompt_chars,
    )
    make_server(app, host, port, drain_timeout_s=drain_timeout_s, log_level=log_level).run()
