"""OpenAI-compatible HTTP serving over the real engine: an asyncio front end and one engine thread.

``AsyncEngine`` batches concurrent requests continuously on a background thread; ``create_app`` builds the
FastAPI app (completions, chat, SSE streaming, /metrics); ``serve`` runs it with uvicorn. FastAPI and
uvicorn are imported only by ``app`` (the ``server`` extra).
"""

from kvbalance.server.async_engine import AsyncEngine, EngineStopped, Overloaded, Rejected, StreamOutput

__all__ = ["AsyncEngine", "EngineStopped", "Overloaded", "Rejected", "StreamOutput", "create_app", "serve"]


def __getattr__(name: str):
    if name in ("create_app", "serve"):
        from kvbalance.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'kvbalance.server' has no attribute {name!r}")
