"""What the region owner hands around: staged embeddings and registrations it deregisters."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import anyio
import torch

from ...transfer import Hold, MemoryRegistration, MemoryRegistrationState
from ._arena import StagingArena

__all__ = ["Handover", "Staged", "ThreadSafeCounter"]


@dataclass(eq=False, slots=True)
class Staged:
    """A staged embedding: where its bytes are, how its memory is registered, and whether a
    transfer may still touch it.

    It lives either in a block of the staging arena (covered by the arena's registration)
    or in a tensor of its own (``own``), registered on its own (``registration``) or not.
    """

    nbytes: int
    ptr: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    own: torch.Tensor | None = None
    arena: StagingArena | None = None
    #: Offset of its block when it lives in the staging arena.
    arena_offset: int | None = None
    #: The record's own registration of this memory, while the record holds one.
    registration: MemoryRegistration | None = None
    #: Holds on this memory (None until the first): transfers that gave up waiting may still
    #: touch it. While one is unsettled the memory is never freed, reused or deregistered.
    holds: list[Hold] | None = None

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
    def registered(self) -> bool:
        """Whether the record holds a registration of its own for this memory."""
        registration = self.registration
        return registration is not None and registration.state is MemoryRegistrationState.REGISTERED

    @property
    def transferable(self) -> bool:
        """Whether the engine may write from it without registering it first."""
        return self.arena_offset is not None or self.registered

    @property
    def held(self) -> bool:
        """Whether a transfer may still touch this memory."""
        holds = self.holds
        return holds is not None and any(not hold.settled for hold in holds)

    def take_hold(self, hold: Hold) -> None:
        """A transfer that gave up waiting may still touch this memory: keep the memory alive
        through ``hold`` (the arena buffer, or its own tensor and registration) until the
        hold settles. Not a checkpoint; thread-safe as far as ``hold`` goes."""
        if self.holds is None:
            self.holds = []
        self.holds.append(hold)
        if self.own is not None:
            hold.keep(self.own)
        if self.arena is not None:
            hold.keep(self.arena)
        if self.registration is not None:
            self.registration.hold(hold)


@dataclass(eq=False, slots=True)
class Handover:
    """A request's own registration, handed to the owner task to deregister."""

    req_id: str
    registration: MemoryRegistration
    attempts: int = 0
    next_try: float = 0.0
    #: Set once the first deregistration attempt ended, however it ended.
    attempted: anyio.Event = field(default_factory=anyio.Event)

    @property
    def deregistered(self) -> bool:
        return self.registration.state is MemoryRegistrationState.DEREGISTERED

    @property
    def ptr(self) -> int:
        return self.registration.ptr


class ThreadSafeCounter:
    """Registrations held, counted by whichever thread made or dropped one."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, delta: int) -> None:
        with self._lock:
            self.value += delta
