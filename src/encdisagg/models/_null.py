"""A model that does no work, for benchmarks and tests of everything around the model."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final, final

import torch

from .._modality import Modality
from ._protocol import Preprocessed

__all__ = ["NullVisionModel"]

_FILL: Final = "fill"


def _content(item: object) -> bytes | None:
    if isinstance(item, str):
        return item.encode()
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    return None


def _fill(index: int, content: bytes | None) -> float:
    # At most 31 * 64 + 64 = 2048: every value is an integer float16 holds exactly.
    salt = hashlib.sha256(content).digest()[0] % 32 if content is not None else 0
    return float(salt * 64 + index % 64 + 1)


@final
class NullVisionModel:
    """Implements ``VisionModel`` without decoding or compute.

    ``preprocess`` accepts any items of any modality; every item becomes ``tokens_per_item``
    tokens with the grid ``(1, 2, 2 * tokens_per_item)`` (which a merge size of 2 turns back
    into ``tokens_per_item``). ``forward`` returns, per element, rows filled with one value
    per item: ``1 + index % 64`` for the item's position in its request, plus 64 times a number
    below 32 taken from the sha256 of bytes and string items. Values are integers up to 2048,
    exact in float16, and the same whatever the batch. Nothing blocks for long.

    :param hidden_size: width of each row.
    :param tokens_per_item: rows per item.
    :param dtype: dtype of the returned tensors.
    """

    #: Its calls do no I/O and finish in microseconds: the Encoder calls them inline.
    blocking = False

    def __init__(
        self, hidden_size: int = 64, tokens_per_item: int = 16, dtype: torch.dtype = torch.float16
    ) -> None:
        if hidden_size < 1 or tokens_per_item < 1:
            raise ValueError("hidden_size and tokens_per_item must be positive")
        self._hidden_size = hidden_size
        self._tokens_per_item = tokens_per_item
        self._dtype = dtype

    @property
    def name(self) -> str:
        """``"null"``."""
        return "null"

    @property
    def hidden_size(self) -> int:
        """Width of every returned row."""
        return self._hidden_size

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of every returned tensor."""
        return self._dtype

    @property
    def tokens_per_item(self) -> int:
        """Rows each item becomes."""
        return self._tokens_per_item

    def preprocess(self, items: Sequence[object], modality: Modality | str) -> Preprocessed:
        """Count ``tokens_per_item`` tokens per item. Does not block.

        ``cache_key`` is set when every item is bytes or a string (it hashes them), else
        ``None``.
        """
        Modality.parse(modality)
        contents = [_content(item) for item in items]
        fills = tuple(_fill(index, content) for index, content in enumerate(contents))
        cache_key = None
        known = [content for content in contents if content is not None]
        if len(known) == len(contents):
            digest = hashlib.sha256(f"null/{self._hidden_size}/{self._tokens_per_item}".encode())
            for content in known:
                digest.update(len(content).to_bytes(8, "little"))
                digest.update(content)
            cache_key = digest.hexdigest()
        count = self._tokens_per_item
        return Preprocessed(
            token_counts=(count,) * len(fills),
            grid=((1, 2, 2 * count),) * len(fills),
            features={_FILL: fills},
            cache_key=cache_key,
        )

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        """One ``[tokens, hidden_size]`` tensor per element, filled per item. Does not block."""
        outputs = []
        shape = (self._tokens_per_item, self._hidden_size)
        for element in batch:
            fills = element.features.get(_FILL, ())
            if len(fills) == 1:
                # One item: one fill, and one torch call instead of five.
                outputs.append(torch.full(shape, fills[0], dtype=self._dtype))
                continue
            values = torch.tensor(fills, dtype=torch.float32).repeat_interleave(
                self._tokens_per_item
            )
            rows = values[:, None].expand(-1, self._hidden_size)
            outputs.append(rows.to(self._dtype).contiguous())
        return outputs
