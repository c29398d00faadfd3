"""OpenAI-compatible HTTP serving over the real engine: an asyncio front end and one engine thread.

``AsyncEngine`` batches concurrent requests continuously on a background thread; ``create_app`` builds the
FastAPI app (``app``: guard and errors; ``routes``: completions and chat; ``streaming``: SSE; ``protocol``:
request bodies; ``metrics``: Prometheus); ``serve`` runs it with uvicorn (``serving``). FastAPI and uvicorn
are imported only by those modules (the ``server`` extra).
"""

from kvbalance.server.async_engine import AsyncEngine
from kvbalance.server.streams import EngineStopped, Overloaded, Rejected, StreamOutput

__all__ = ["AsyncEngine", "EngineStopped", "Overloaded", "Rejected", "StreamOutput", "create_app", "serve"]


def __getattr__(name: str):
    if name == "create_app":
        from kvbalance.server.app import create_app

        return create_app
    if name == "serve":
        from kvbalance.server.serving import serve

        return serve
    raise AttributeError(f"module 'kvbalance.server' has no attribute {name!r}")
