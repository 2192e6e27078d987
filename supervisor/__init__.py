"""The supervisor daemon: HTTP gateway, router, worker processes. Never imports MLX or the worker package."""

__version__ = "0.1.0"
