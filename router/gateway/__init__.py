"""The HTTP gateway: FastAPI app, routes, placement glue, the streaming relay."""

from .app import create_app

__all__ = ["create_app"]
