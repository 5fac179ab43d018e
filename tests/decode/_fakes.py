"""Test doubles shared by the decode tests."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

from encdisagg import TransferError
from encdisagg.decode import (
    AbortAckTracker,
    CommitStatus,
    DecodeRequest,
    DecodeTransferQueue,
    KVSink,
    MetadataSlotAllocator,
)
from encdisagg.transfer import Hold, HoldPolicy


@dataclass
class FakeClock:
    """A clock the test moves by hand."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class RecordingSink(KVSink):
    """A KV sink that records every call; commit results and failing releases are scripted."""

    results: dict[str, CommitStatus] = field(default_factory=dict)
    failing_releases: set[str] = field(default_factory=set)
    events: list[tuple[str, str]] = field(default_factory=list)
    messages: dict[str, str] = field(default_factory=dict)

    def commit(self, req: DecodeRequest) -> CommitStatus:
        self.events.append(("commit", req.rid))
        return self.results.get(req.rid, CommitStatus.COMMITTED)

    def release(self, req: DecodeRequest) -> None:
        self.events.append(("release", req.rid))
        if req.rid in self.failing_releases:
            raise RuntimeError(f"releasing {req.rid} failed")

    def abort(self, req: DecodeRequest, message: str) -> None:
        self.events.append(("abort", req.rid))
        self.messages[req.rid] = message

    def calls(self, kind: str) -> list[str]:
        return [rid for what, rid in self.events if what == kind]


@dataclass
class HoldingSink(RecordingSink):
    """A recording sink that also learns which requests' memory is held, and by what."""

    holds: dict[str, Hold] = field(default_factory=dict)

    def hold(self, req: DecodeRequest, hold: Hold) -> None:
        self.events.append(("hold", req.rid))
        self.holds[req.rid] = hold


@dataclass
class SlotWatch:
    """Records each zeroing, and whether the slot was still allocated while being zeroed."""

    zeroed: list[int] = field(default_factory=list)
    zeroed_while_free: list[int] = field(default_factory=list)
    allocator: MetadataSlotAllocator | None = None

    def zero(self, slot: int) -> None:
        assert self.allocator is not None
        if not self.allocator.is_allocated(slot):
            self.zeroed_while_free.append(slot)
        self.zeroed.append(slot)


def watched_slots(size: int) -> tuple[MetadataSlotAllocator, SlotWatch]:
    watch = SlotWatch()
    slots = MetadataSlotAllocator(size, zero_slot=watch.zero)
    watch.allocator = slots
    return slots, watch


@dataclass
class Harness:
    queue: DecodeTransferQueue
    sink: RecordingSink
    slots: MetadataSlotAllocator
    watch: SlotWatch
    acks: AbortAckTracker
    clock: FakeClock

    def request(
        self,
        rid: str,
        room: int,
        *,
        required_acks: int = 1,
        abort_notified: bool = False,
        generation: int | None = None,
        pages: tuple[int, ...] = (),
    ) -> DecodeRequest:
        slot = self.slots.alloc()
        assert slot is not None
        req = DecodeRequest(
            rid,
            room,
            slot,
            required_acks,
            generation=generation,
            abort_notified=abort_notified,
            pages=pages,
        )
        self.queue.add(req)
        return req


def make_harness(
    *,
    slots: int = 16,
    release_timeout_s: float = 30.0,
    on_timeout: HoldPolicy | str = HoldPolicy.REUSE,
    page_bytes: int = 0,
    sink: RecordingSink | None = None,
) -> Harness:
    sink = RecordingSink() if sink is None else sink
    allocator, watch = watched_slots(slots)
    acks = AbortAckTracker()
    clock = FakeClock()
    queue = DecodeTransferQueue(
        kv=sink,
        slots=allocator,
        acks=acks,
        release_timeout_s=release_timeout_s,
        clock=clock,
        on_timeout=on_timeout,
        page_bytes=page_bytes,
    )
    return Harness(queue, sink, allocator, watch, acks, clock)


class CopyingEngine:
    """A transfer engine within one process: ``write`` copies between addresses.

    Records every call and whether a write hit memory that was not registered.
    """

    def __init__(self, session_id: str = "local:0") -> None:
        self._session_id = session_id
        self.regions: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.threads: set[str] = set()
        self.fail_register = False
        self.fail_deregister = False
        self._lock = threading.Lock()

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, ptr: int, nbytes: int) -> None:
        self.threads.add(threading.current_thread().name)
        if self.fail_register:
            raise TransferError(f"register({ptr:#x}) failed with rc -1")
        with self._lock:
            self.regions[ptr] = nbytes
            self.calls.append(("register", ptr))

    def deregister(self, ptr: int) -> None:
        self.threads.add(threading.current_thread().name)
        with self._lock:
            self.calls.append(("deregister", ptr))
            if self.fail_deregister:
                raise TransferError(f"deregister({ptr:#x}) failed with rc -1")
            del self.regions[ptr]

    def _registered(self, ptr: int, nbytes: int) -> bool:
        return any(
            base <= ptr and ptr + nbytes <= base + size for base, size in self.regions.items()
        )

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        with self._lock:
            if not self._registered(remote_ptr, nbytes):
                raise TransferError(f"write to unregistered memory at {remote_ptr:#x}")
            ctypes.memmove(remote_ptr, local_ptr, nbytes)
