"""Transfer engines and the embedding wire format."""

from ._engine import TransferEngine as TransferEngine

__all__ = ("TransferEngine",)
