"""Fakes for the global cache tests: an in-memory store with failure switches, and a model
wrapper that counts what it preprocesses and forwards."""

from __future__ import annotations

import io
import threading
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from encdisagg import Modality, TransferError
from encdisagg.models import Preprocessed


class MemoryStore:
    """An ``EmbeddingStore`` in a dict. Every switch applies to the calls made after it is set.

    ``fail``: call name → exception raised by that call. ``gone``: keys ``fetch`` cannot read.
    ``gate``: when set, every call waits for it (to play a stalled store). :meth:`entered`
    and :meth:`hold` watch and stall calls of one name.
    """

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.fail: dict[str, Exception] = {}
        self.gone: set[str] = set()
        self.gate: threading.Event | None = None
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.closed = False
        self._lock = threading.Lock()
        self._entered: dict[str, threading.Event] = {}
        self._held: dict[str, threading.Event] = {}

    def entered(self, call: str) -> threading.Event:
        """An event set once a call named ``call`` starts (from now on)."""
        return self._entered.setdefault(call, threading.Event())

    def hold(self, call: str) -> threading.Event:
        """Calls named ``call`` wait, once started, until the returned event is set."""
        return self._held.setdefault(call, threading.Event())

    def _enter(self, call: str, keys: Sequence[str]) -> None:
        with self._lock:
            self.calls.append((call, tuple(keys)))
        if call in self._entered:
            self._entered[call].set()
        if call in self._held:
            self._held[call].wait(30)
        gate = self.gate
        if gate is not None:
            gate.wait(30)
        error = self.fail.get(call)
        if error is not None:
            raise error

    def count(self, call: str) -> int:
        return sum(1 for name, _ in self.calls if name == call)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._enter("exists", keys)
        return [key in self.values for key in keys]

    def fetch(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        self._enter("fetch", keys)
        out: list[torch.Tensor | None] = []
        for key in keys:
            value = self.values.get(key)
            if value is None or key in self.gone:
                out.append(None)
            else:
                out.append(torch.frombuffer(bytearray(value), dtype=torch.uint8))
        return out

    def put(self, key: str, header: bytes, payload: memoryview) -> None:
        self._enter("put", [key])
        with self._lock:
            self.values.setdefault(key, header + bytes(payload))

    def remove(self, key: str) -> None:
        self._enter("remove", [key])
        with self._lock:
            self.values.pop(key, None)

    def close(self) -> None:
        self.closed = True


def store_down() -> TransferError:
    return TransferError("mooncake store batch_is_exist failed (rc=-900 RPC_FAIL)")


class CountingModel:
    """Wraps a ``VisionModel``; counts the items it preprocesses and forwards."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.preprocessed = 0
        self.forwarded = 0
        self._lock = threading.Lock()

    @property
    def identity(self) -> str:
        identity: str = self.inner.identity
        return identity

    @property
    def hidden_size(self) -> int:
        size: int = self.inner.hidden_size
        return size

    @property
    def dtype(self) -> torch.dtype:
        dtype: torch.dtype = self.inner.dtype
        return dtype

    @property
    def device(self) -> torch.device:
        device: torch.device = self.inner.device
        return device

    def preprocess(self, items: Sequence[object], modality: Modality) -> Preprocessed:
        with self._lock:
            self.preprocessed += len(items)
        pre: Preprocessed = self.inner.preprocess(items, modality)
        return pre

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        with self._lock:
            self.forwarded += sum(len(pre.token_counts) for pre in batch)
        outputs: list[torch.Tensor] = self.inner.forward(batch)
        return outputs


def png(seed: int, width: int = 56, height: int = 56) -> bytes:
    """A PNG of seeded noise (56 x 56: 4 tokens with the tiny model)."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


async def round_trip_through_global_tier(
    model: Any, pre: Preprocessed, rows: torch.Tensor, listening: int
) -> Any:
    """Insert ``rows`` (of ``pre``, forwarded by ``model``) into a global tier over a
    :class:`MemoryStore`, drain, look it up again: the hit."""
    from encdisagg.cache import CachedItem, GlobalCache, parse_global_cache_url

    settings = parse_global_cache_url(
        f"mooncake://127.0.0.1:{listening}?metadata=http://127.0.0.1:{listening}/m"
    )
    store = MemoryStore()
    cache = GlobalCache(
        settings, hidden_size=model.hidden_size, dtype=model.dtype, open_store=lambda _: store
    )
    async with cache:
        assert cache.insert_soon(
            "k", CachedItem(rows=rows, tokens=pre.num_tokens, grid=pre.grid[0])
        )
        await cache.drain()
        found = await cache.lookup(["k"])
    return found["k"]
