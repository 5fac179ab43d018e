"""Embedding layouts: several per-token tensors side by side in one ``[tokens, width]`` tensor.

A model whose encoder returns more than one tensor per token (Qwen3-VL: the merged embedding
plus one deepstack feature map per deepstack layer, all ``[tokens, hidden]``) concatenates them
along the hidden axis. Rows still belong to tokens, so splitting per item, the caches and every
transport work on the joint tensor unchanged; the layout says which columns are which, and the
receiver hands each section out as a view (no copy).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Final

import torch

from .._errors import BadRequestError
from .._numbers import whole

__all__ = ["EmbeddingLayout", "MAIN_SECTION", "deepstack_layout"]

#: The name of the section the language model splices in at the media tokens.
MAIN_SECTION: Final = "embedding"
#: A layout never has more sections than this (a header field bounded like every other).
MAX_SECTIONS: Final = 64
_NAME: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")


def bad_field(field: str, requirement: str, value: object) -> BadRequestError:
    """The error for an embedding header ``field`` whose ``value`` (its repr cut to 80
    characters) is not ``requirement``."""
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return BadRequestError(f"embedding header field {field!r} must be {requirement}; got {shown}")


def _bad(requirement: str, value: object) -> BadRequestError:
    return bad_field("layout", requirement, value)


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingLayout:
    """Named column ranges of a ``[tokens, width]`` embedding, in column order.

    ``sections`` is ``((name, columns), ...)``; the first one is :data:`MAIN_SECTION`.
    Construction validates and never blocks.

    :raises BadRequestError: naming ``layout`` for an empty list, more than
        :data:`MAX_SECTIONS` sections, a name that is not a lower-case identifier, a repeated
        name, a first section other than ``"embedding"``, or a width that is not a positive int.
    """

    sections: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        sections = self.sections
        if type(sections) is not tuple or not 1 <= len(sections) <= MAX_SECTIONS:
            raise _bad(f"an array of 1 to {MAX_SECTIONS} [name, columns] pairs", sections)
        seen: set[str] = set()
        for entry in sections:
            if type(entry) is not tuple or len(entry) != 2:
                raise _bad("an array of [name, columns] pairs", sections)
            name, columns = entry
            if type(name) is not str or not _NAME.fullmatch(name) or name in seen:
                raise _bad("pairs with distinct lower-case identifier names", sections)
            # Exact type: bools are ints to Python, never to this format.
            if type(columns) is not int or columns < 1:
                raise _bad("pairs with a positive int column count", sections)
            seen.add(name)
        if sections[0][0] != MAIN_SECTION:
            raise _bad(f"a list whose first section is {MAIN_SECTION!r}", sections)

    @classmethod
    def from_wire(cls, value: object) -> EmbeddingLayout:
        """The layout of a decoded header value (arrays as tuples or lists).

        :raises BadRequestError: naming ``layout`` for anything but ``[[name, columns], ...]``.
        """
        if not isinstance(value, (tuple, list)):
            raise _bad("an array of [name, columns] pairs", value)
        pairs = []
        for entry in value:
            if not isinstance(entry, (tuple, list)):
                raise _bad("an array of [name, columns] pairs", value)
            pairs.append(tuple(entry))
        return cls(tuple(pairs))  # each pair is checked in __post_init__

    def to_wire(self) -> list[list[str | int]]:
        """The header value: ``[[name, columns], ...]``."""
        return [[name, columns] for name, columns in self.sections]

    @property
    def width(self) -> int:
        """Columns of the joint tensor: the sum over the sections."""
        return sum(columns for _, columns in self.sections)

    @property
    def names(self) -> tuple[str, ...]:
        """The section names, in column order."""
        return tuple(name for name, _ in self.sections)

    def split(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each section of ``tensor`` (``[tokens, width]``) as a column view, by name.

        The views share ``tensor``'s memory (they are not contiguous unless the layout has
        one section); they are valid as long as that memory is. Does not block.

        :raises BadRequestError: if ``tensor`` is not 2-D or not :attr:`width` wide.
        """
        if tensor.dim() != 2 or int(tensor.shape[1]) != self.width:
            raise BadRequestError(
                f"an embedding of shape {list(tensor.shape)} does not fit layout "
                f"{self.to_wire()} ({self.width} columns)"
            )
        views: dict[str, torch.Tensor] = {}
        start = 0
        for name, columns in self.sections:
            views[name] = tensor[:, start : start + columns]
            start += columns
        return views


def deepstack_layout(hidden: int, deepstack_layers: int) -> EmbeddingLayout:
    """The layout of a Qwen3-VL style embedding: ``"embedding"`` then ``"deepstack_0"`` ...
    ``"deepstack_{N-1}"``, each ``hidden`` columns wide. Does not block.

    :raises BadRequestError: for a non-positive ``hidden`` or a negative count.
    """
    whole("deepstack_layers", deepstack_layers, error=BadRequestError)
    names: Sequence[str] = [MAIN_SECTION] + [f"deepstack_{i}" for i in range(deepstack_layers)]
    return EmbeddingLayout(tuple((name, hidden) for name in names))
