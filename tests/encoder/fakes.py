"""Fakes for unit tests of the Encoder: a scripted model and a recording engine.

The real-component tests (tiny HF model, LoopbackEngine, Mooncake, ZMQ) live beside these.
"""

from __future__ import annotations

import ctypes
import hashlib
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio.from_thread
import torch

from encdisagg import Modality, TransferError
from encdisagg.models import Preprocessed

HIDDEN = 8


class ScriptedModel:
    """A vision model whose items script its behaviour.

    An item is an int (that many tokens) or one of the strings ``"bad"`` (preprocess raises
    ValueError), ``"crash"`` (preprocess raises RuntimeError), ``"short"`` (the forward
    returns one row too few), ``"poison"`` (a fused forward containing it raises).
    """

    def __init__(self, *, hidden_size: int = HIDDEN, dtype: torch.dtype = torch.float16) -> None:
        self._hidden = hidden_size
        self._dtype = dtype
        self.name = "scripted"
        self.forward_batches: list[int] = []
        self.gate: threading.Event | None = None
        self.forward_started: anyio.Event | None = None
        self._lock = threading.Lock()

    @property
    def hidden_size(self) -> int:
        return self._hidden

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def block_forward(self) -> tuple[threading.Event, anyio.Event]:
        """Make the next forwards wait for the returned gate; the event says one started."""
        self.gate = threading.Event()
        self.forward_started = anyio.Event()
        return self.gate, self.forward_started

    def preprocess(self, items: Sequence[object], modality: Modality) -> Preprocessed:
        counts = []
        for index, item in enumerate(items):
            if item == "bad":
                raise ValueError(f"mm_items[{index}]: cannot decode")
            if item == "crash":
                raise RuntimeError("processor exploded")
            if item in ("short", "poison"):
                counts.append(4)
            elif isinstance(item, int) and not isinstance(item, bool) and item > 0:
                counts.append(item)
            else:
                raise TypeError(f"mm_items[{index}]: unsupported item {item!r}")
        key = hashlib.sha256(repr((list(items), modality.value)).encode()).hexdigest()
        return Preprocessed(
            token_counts=tuple(counts),
            grid=tuple((1, 2, 2 * n) for n in counts),
            features={"items": tuple(items)},
            cache_key=key,
        )

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        with self._lock:
            self.forward_batches.append(len(batch))
        if self.forward_started is not None:
            anyio.from_thread.run_sync(self.forward_started.set)
        if self.gate is not None:
            self.gate.wait()
        outputs = []
        for pre in batch:
            items = pre.features["items"]
            if "poison" in items and len(batch) > 1:
                raise RuntimeError("fused forward failed")
            rows = sum(pre.token_counts) - (1 if "short" in items else 0)
            seed = int(pre.cache_key[:8], 16) if pre.cache_key else 0
            values = torch.arange(rows * self._hidden, dtype=torch.float32) + seed % 1000
            outputs.append(values.reshape(rows, self._hidden).to(self._dtype))
        return outputs


@dataclass
class RecordingEngine:
    """A TransferEngine that checks the rules a real NIC would punish silently.

    Violations recorded: a deregistration while a write reads the region, a write from
    unregistered local memory, a write into unregistered remote memory, a double
    deregistration. Failures can be injected with probabilities (seeded) or counts.
    """

    session_id: str = "recording:1"
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    register_failure_rate: float = 0.0
    write_failure_rate: float = 0.0
    deregister_failures: int = 0
    write_gate: threading.Event | None = None
    write_started: anyio.Event | None = None
    regions: dict[int, int] = field(default_factory=dict)
    remote: dict[int, int] = field(default_factory=dict)
    active_writes: dict[int, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    registrations: int = 0
    deregistrations: int = 0
    writes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _remote_buffers: list[torch.Tensor] = field(default_factory=list)

    def add_remote_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        # Kept alive here: a test that drops its reference must not let a write land in
        # freed memory.
        self._remote_buffers.append(buffer)
        self.remote[buffer.data_ptr()] = nbytes
        return buffer

    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            if self.rng.random() < self.register_failure_rate:
                raise TransferError(f"injected register failure at {ptr:#x}")
            if ptr in self.regions:
                self.violations.append(f"double registration of {ptr:#x}")
            self.regions[ptr] = nbytes
            self.registrations += 1
            self.log.append(f"register {ptr:#x}")

    def deregister(self, ptr: int) -> None:
        with self._lock:
            if ptr not in self.regions:
                self.violations.append(f"deregistration of unknown region {ptr:#x}")
                raise TransferError(f"region {ptr:#x} is not registered")
            if self.active_writes.get(ptr):
                self.violations.append(f"deregistration of {ptr:#x} during a write")
            if self.deregister_failures > 0:
                self.deregister_failures -= 1
                raise TransferError(f"injected deregister failure at {ptr:#x}")
            del self.regions[ptr]
            self.deregistrations += 1
            self.log.append(f"deregister {ptr:#x}")

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        with self._lock:
            region = next(
                (
                    base
                    for base, size in self.regions.items()
                    if base <= local_ptr and local_ptr + nbytes <= base + size
                ),
                None,
            )
            if region is None:
                self.violations.append(f"write from unregistered memory {local_ptr:#x}")
                raise TransferError("local memory is not registered")
            if not any(
                base <= remote_ptr and remote_ptr + nbytes <= base + size
                for base, size in self.remote.items()
            ):
                raise TransferError(f"remote address {remote_ptr:#x} is not registered")
            fail = self.rng.random() < self.write_failure_rate
            self.active_writes[region] = self.active_writes.get(region, 0) + 1
            self.log.append(f"write start {local_ptr:#x}")
        try:
            if self.write_started is not None:
                anyio.from_thread.run_sync(self.write_started.set)
            if self.write_gate is not None:
                self.write_gate.wait()
            if fail:
                raise TransferError("injected write failure")
            ctypes.memmove(remote_ptr, local_ptr, nbytes)
        finally:
            with self._lock:
                self.active_writes[region] -= 1
                if not self.active_writes[region]:
                    del self.active_writes[region]
                self.writes += 1
                self.log.append(f"write end {local_ptr:#x}")
