"""The E→P→D pipeline on one machine: tiny language model prefill and decode workers."""

from ._serve import serve_asgi as serve_asgi

__all__ = ("serve_asgi",)
