"""Per-item decisions of one request's encode through the cache tiers (synchronous).

An :class:`ItemPlan` keys each item, takes what the tiers hold, says what is left to
preprocess and forward, and assembles the embedding in item order. It never awaits and
does no I/O (building it hashes the items, which is why that step runs in a worker
thread); the Encoder does the awaiting around it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._errors import BadRequestError, InternalError
from ..models import Preprocessed, split_embedding
from ._entry import CachedItem
from ._keys import ModalityKeys

__all__ = ["ItemPlan", "Origin", "relabel_items"]

_ITEM_LABEL = re.compile(r"mm_items\[(\d+)\]")


def relabel_items(message: str, indices: Sequence[int]) -> str:
    """Rewrite ``mm_items[i]`` in an error about a subset of a request's items to name the
    item's place in the whole request (``mm_items[indices[i]]``)."""

    def renumber(match: re.Match[str]) -> str:
        local = int(match.group(1))
        return f"mm_items[{indices[local]}]" if local < len(indices) else match.group(0)

    return _ITEM_LABEL.sub(renumber, message)


class Origin(enum.Enum):
    """Where an item's embedding came from."""

    LOCAL = "local"
    GLOBAL = "global"
    COMPUTED = "computed"


@dataclass(eq=False, slots=True)
class _Slot:
    #: The item's cache key; ``None``: not known yet (``pre`` is None) or not cacheable.
    key: str | None
    #: The item preprocessed alone (to learn its key), reused for its forward.
    pre: Preprocessed | None = None
    item: CachedItem | None = None
    origin: Origin | None = None


class ItemPlan:
    """The cache plan of one request. Build it with :meth:`build` (in a worker thread).

    Order of use: :meth:`unkeyed` / :meth:`key_by_preprocessing` → :meth:`open_keys` /
    :meth:`fill` (local tier, then global tier) → :meth:`to_preprocess` /
    :meth:`set_preprocessed` → :meth:`forward_batch` / :meth:`set_outputs` →
    :meth:`assemble`; then :meth:`computed` and :meth:`fetched` say what to insert where.
    Items with the same key are fetched or computed once.
    """

    def __init__(self, keys: Sequence[str | None], key_builder: ModalityKeys) -> None:
        self._keys = key_builder
        self._slots = [_Slot(key) for key in keys]
        # Set by set_preprocessed: the cache misses preprocessed together.
        self._group: tuple[list[int], Preprocessed] | None = None
        # Set by forward_batch: the item indices each forwarded element covers.
        self._jobs: list[tuple[list[int], Preprocessed]] | None = None

    @classmethod
    def build(
        cls,
        items: Sequence[object],
        hashes: Sequence[str] | None,
        key_builder: ModalityKeys,
        *,
        max_media_bytes: int,
        digests: Sequence[str] | None = None,
    ) -> ItemPlan:
        """Key every item: by its caller-supplied hash, else by its content when it carries
        it (``digests``: every item's :func:`~._keys.content_digest`, already computed).
        Blocks while hashing item bytes.

        :raises BadRequestError: if ``hashes`` does not have one entry per item.
        """
        if hashes is not None:
            if len(hashes) != len(items):
                raise BadRequestError(
                    f"hashes has {len(hashes)} entries but items has {len(items)}"
                )
            return cls([key_builder.for_hash(value) for value in hashes], key_builder)
        if digests is not None and len(digests) == len(items):
            return cls([key_builder.for_digest(digest) for digest in digests], key_builder)
        keys = [key_builder.for_content(item, max_media_bytes=max_media_bytes) for item in items]
        return cls(keys, key_builder)

    def __len__(self) -> int:
        return len(self._slots)

    # -- keys ----------------------------------------------------------------------------------

    def unkeyed(self) -> list[int]:
        """Items whose key needs them preprocessed alone (they name their content elsewhere)."""
        return [i for i, slot in enumerate(self._slots) if slot.key is None and slot.pre is None]

    def key_by_preprocessing(self, index: int, pre: Preprocessed) -> None:
        """Record item ``index`` preprocessed alone; its key is the model's cache key (none:
        the item is computed and never cached).

        :raises InternalError: if ``pre`` does not describe exactly one item.
        """
        if len(pre.token_counts) != 1:
            raise InternalError(f"preprocessing one item gave {len(pre.token_counts)} token counts")
        slot = self._slots[index]
        slot.pre = pre
        slot.key = None if pre.cache_key is None else self._keys.for_model_key(pre.cache_key)

    # -- hits ----------------------------------------------------------------------------------

    def open_keys(self) -> list[str]:
        """Distinct keys of the items not filled yet, in item order."""
        keys = (slot.key for slot in self._slots if slot.item is None and slot.key is not None)
        return list(dict.fromkeys(keys))

    def fill(self, key: str, item: CachedItem, origin: Origin) -> int:
        """Give every open item with ``key`` the embedding ``item``; returns how many."""
        filled = 0
        for slot in self._slots:
            if slot.item is None and slot.key == key:
                slot.item = item
                slot.origin = origin
                filled += 1
        return filled

    # -- misses --------------------------------------------------------------------------------

    def _open_representatives(self) -> list[int]:
        seen: set[str] = set()
        chosen = []
        for index, slot in enumerate(self._slots):
            if slot.item is not None:
                continue
            if slot.key is not None:
                if slot.key in seen:
                    continue
                seen.add(slot.key)
            chosen.append(index)
        return chosen

    def to_preprocess(self) -> list[int]:
        """Open items still to preprocess (one per key), to be preprocessed together."""
        return [i for i in self._open_representatives() if self._slots[i].pre is None]

    def set_preprocessed(self, indices: Sequence[int], pre: Preprocessed) -> None:
        """Record the items ``indices`` (from :meth:`to_preprocess`) preprocessed together.

        :raises InternalError: if ``pre`` describes another number of items.
        """
        if len(pre.token_counts) != len(indices):
            raise InternalError(
                f"preprocessing {len(indices)} items gave {len(pre.token_counts)} token counts"
            )
        self._group = (list(indices), pre)

    def forward_batch(self) -> list[Preprocessed]:
        """What to forward: the items preprocessed together, then each item preprocessed
        alone that is still open (one per key). Empty when everything was a hit."""
        jobs: list[tuple[list[int], Preprocessed]] = []
        if self._group is not None:
            jobs.append(self._group)
        grouped = set(self._group[0]) if self._group is not None else set()
        for index in self._open_representatives():
            pre = self._slots[index].pre
            if index not in grouped and pre is not None:
                jobs.append(([index], pre))
        self._jobs = jobs
        return [pre for _, pre in jobs]

    def set_outputs(self, outputs: Sequence[torch.Tensor]) -> None:
        """Take the forward's outputs (one per element of :meth:`forward_batch`).

        :raises InternalError: for a wrong number of outputs or rows.
        """
        jobs = self._jobs
        if jobs is None or len(outputs) != len(jobs):
            raise InternalError(
                f"expected {0 if jobs is None else len(jobs)} forward outputs, got {len(outputs)}"
            )
        for (indices, pre), output in zip(jobs, outputs, strict=True):
            pieces = split_embedding(output, pre.token_counts)
            for index, rows, tokens, grid in zip(
                indices, pieces, pre.token_counts, pre.grid, strict=True
            ):
                item = CachedItem(rows=rows, tokens=tokens, grid=grid)
                slot = self._slots[index]
                if slot.key is None:
                    slot.item, slot.origin = item, Origin.COMPUTED
                else:
                    self.fill(slot.key, item, Origin.COMPUTED)

    # -- result --------------------------------------------------------------------------------

    def assemble(
        self, device: torch.device
    ) -> tuple[torch.Tensor, tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """The request's embedding (``[tokens, hidden]``, items in order, on ``device``),
        its token counts and its grid. The tensor shares memory with no cache entry (it is
        either freshly assembled or the only output of a forward).

        :raises InternalError: if an item has no embedding.
        """
        items = []
        for index, slot in enumerate(self._slots):
            if slot.item is None:
                raise InternalError(f"mm_items[{index}] has no embedding after the forward")
            items.append((slot.item, slot.origin))
        token_counts = tuple(item.tokens for item, _ in items)
        grid = tuple(item.grid for item, _ in items)
        if len(items) == 1 and items[0][1] is Origin.COMPUTED:
            rows = items[0][0].rows
            if _owns_storage(rows) and rows.device == device:
                return rows, token_counts, grid
        tensor = torch.cat([item.rows.to(device) for item, _ in items])
        return tensor, token_counts, grid

    def _by_origin(self, origin: Origin) -> list[tuple[str, CachedItem]]:
        found: dict[str, CachedItem] = {}
        for slot in self._slots:
            if slot.origin is origin and slot.key is not None and slot.item is not None:
                found.setdefault(slot.key, slot.item)
        return list(found.items())

    def computed(self) -> list[tuple[str, CachedItem]]:
        """Cacheable items this request computed (one per key)."""
        return self._by_origin(Origin.COMPUTED)

    def fetched(self) -> list[tuple[str, CachedItem]]:
        """Items the global tier served (one per key)."""
        return self._by_origin(Origin.GLOBAL)

    def origins(self) -> list[Origin | None]:
        """Where each item's embedding came from (``None``: not yet)."""
        return [slot.origin for slot in self._slots]


def _owns_storage(rows: torch.Tensor) -> bool:
    return (
        rows.storage_offset() == 0
        and rows.untyped_storage().nbytes() == rows.numel() * rows.element_size()
    )
