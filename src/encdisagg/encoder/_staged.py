"""What the region owner hands around: staged embeddings and registrations it deregisters."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import anyio
import torch

from ._arena import StagingArena

__all__ = ["CallRunning", "Handover", "Staged", "ThreadSafeCounter", "calls_block"]


def calls_block(part: object) -> bool:
    """Whether a model's or engine's calls may block (the default when it does not say)."""
    return bool(getattr(part, "blocking", True))


@dataclass(eq=False, slots=True)
class Staged:
    """A staged embedding: where its bytes are, and how its memory is registered.

    It lives either in a block of the staging arena (covered by the arena's registration)
    or in a tensor of its own (``own``).
    """

    nbytes: int
    ptr: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    own: torch.Tensor | None = None
    arena: StagingArena | None = None
    #: Offset of its block when it lives in the staging arena.
    arena_offset: int | None = None
    #: The record holds a registration of its own for this memory.
    registered: bool = False
    #: Something outside the Encoder (ZMQ, after a give-up) may still read the memory: an
    #: arena block is then never reused.
    pinned: bool = False

    def pin(self) -> None:
        self.pinned = True

    @property
    def tensor(self) -> torch.Tensor:
        """The embedding as a tensor (a view of the arena block when it lives there)."""
        if self.own is not None:
            return self.own
        assert self.arena is not None
        assert self.arena_offset is not None
        return self.arena.view(self.arena_offset, self.nbytes, self.dtype, self.shape)

    @property
    def is_cuda(self) -> bool:
        if self.own is not None:
            return self.own.is_cuda
        assert self.arena is not None
        return self.arena.is_cuda

    def host_bytes(self) -> memoryview | None:
        """The embedding's bytes as a zero-copy view when it lives in a host-memory arena
        block (a slice, no torch call); None otherwise (see :attr:`tensor`)."""
        if self.arena is None or self.arena_offset is None:
            return None
        return self.arena.host_bytes(self.arena_offset, self.nbytes)

    @property
    def transferable(self) -> bool:
        """Whether the engine may write from it without registering it first."""
        return self.arena_offset is not None or self.registered


@dataclass(eq=False, slots=True)
class Handover:
    """A registration handed to the owner task for deregistration. ``tensor`` keeps the
    memory alive until the engine let go of it."""

    req_id: str
    ptr: int
    nbytes: int
    tensor: torch.Tensor | None
    attempts: int = 0
    next_try: float = 0.0
    deregistered: bool = False
    #: Set once the first deregistration attempt ended, however it ended.
    attempted: anyio.Event = field(default_factory=anyio.Event)
    #: Held by the one deregistration call running on this region, if any (a call cut
    #: short by the sweep's bound may still run in its thread).
    lock: threading.Lock = field(default_factory=threading.Lock)


class CallRunning(Exception):
    """A deregistration of this region is still running in another thread."""


class ThreadSafeCounter:
    """Registrations held, counted by whichever thread made or dropped one."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, delta: int) -> None:
        with self._lock:
            self.value += delta
