"""The dtype spellings of ``--wire vllm``: checked with the server settings, which own them."""

from __future__ import annotations

from .._settings import canonical_dtype

__all__ = ["canonical_dtype"]
