"""The transfer contract as a model: a Hypothesis state machine over a real Encoder and a real
EmbeddingReceiver, on asyncio and on Trio (``docs/cancellation.md``, the transfer contract).

Requests go through the real ``fetch_embeddings``: encode on the Encoder, landing pages from
the receiver, a Mooncake-style write into them, and on any failure the release whose answer
decides what becomes of the pages. Only the HTTP hop is replaced, by calls on the Encoder in
this process (``InProcessClient``), and the transfer engines are scripted
(``ScriptedWrites``): each write completes, fails, is slow (it runs until the machine lets it
go), or ends with an unknown outcome (the write raises ``TransferTimeoutError`` and may still
land later, when the machine says so, or never). Between those, the machine cancels
requests, releases them, closes and reopens the receiver or everything.

After every step: no memory was deregistered while a write may still read or fill it; no
memory a write may still touch was handed to another write; a pending write's source memory
is kept alive by its hold, and its landing pages are out of use; no request received bytes
other than its own. Whenever every transfer is terminal, every counter is back to zero.

Examples: a few per backend in ``nox -s tests``; hundreds under ``ENCDISAGG_SOAK=1``
(``nox -s soak``).
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from encdisagg import (
    EncdisaggError,
    Encoder,
    EncoderConfig,
    EncodeRequest,
    Modality,
    MooncakeDestination,
    TransferError,
    TransferTimeoutError,
)
from encdisagg.receiver import EmbeddingReceiver, ReleaseOutcome, _landing_holds, fetch_embeddings
from encdisagg.receiver._encoder_wire import PartMetadata
from encdisagg.receiver._plan import PartPlan, RequestPlan, assign_parts
from encdisagg.transfer import Hold
from tests.encoder.fakes import ScriptedModel

from ._support import sized

HIDDEN = 8
ITEM = 2  # float16
PAGE_BYTES = 1024
LANDING_PAGES = 12
OUTCOMES = ("complete", "fail", "slow", "unknown")
SETTLE_S = 10.0


@dataclass(eq=False)
class _Write:
    """A write that may still touch memory: slow (running), or with an unknown outcome."""

    rid: str
    local: int
    remote: int
    nbytes: int
    engine: ScriptedWrites
    hold: Hold | None = None
    gate: anyio.Event | None = None


@dataclass(eq=False)
class ScriptedWrites:
    """A transfer engine whose writes do what the machine planned for their request.

    One per encoder incarnation, for its registrations and writes; the receivers have one
    of their own (``writes=False``). A write's request is told by its size (each request
    has a size of its own). Calls never block (``blocking = False``); ``write_async`` waits
    for a slow write's gate, shielded. ``destroy`` is the engine's end: writes that had not
    landed never will, their holds settle, and what owners left to it goes.
    """

    name: str
    world: World
    blocking = False
    regions: dict[int, int] = field(default_factory=dict)
    kept: list[object] = field(default_factory=list)
    destroyed: bool = False

    @property
    def session_id(self) -> str:
        return self.name

    def register(self, ptr: int, nbytes: int) -> None:
        self.regions[ptr] = nbytes

    def deregister(self, ptr: int) -> None:
        nbytes = self.regions.pop(ptr)
        for write in self.world.pending:
            if _overlaps(write.local, write.nbytes, ptr, nbytes) or _overlaps(
                write.remote, write.nbytes, ptr, nbytes
            ):
                self.world.violation(f"{self.name} deregistered {ptr:#x} under a write")

    def keep_until_closed(self, keepalive: object, ptr: int | None = None) -> None:
        if not self.destroyed:
            self.kept.append(keepalive)

    def _begin(self, local: int, remote: int, nbytes: int) -> _Write:
        world = self.world
        if not any(base <= local < base + size for base, size in self.regions.items()):
            world.violation(f"a write from unregistered memory {local:#x}")
        for other in world.pending:
            if _overlaps(other.local, other.nbytes, local, nbytes):
                world.violation(f"a write reads memory a write of {other.rid} may still read")
            if _overlaps(other.remote, other.nbytes, remote, nbytes):
                world.violation(f"a write fills pages a write of {other.rid} may still fill")
        return _Write(world.rid_of(nbytes), local, remote, nbytes, self)

    def write(self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        write = self._begin(local_ptr, remote_ptr, nbytes)
        self._end(write, self.world.outcome_of(write.rid))

    async def write_async(
        self, target_session: str, local_ptr: int, remote_ptr: int, nbytes: int
    ) -> None:
        write = self._begin(local_ptr, remote_ptr, nbytes)
        outcome = self.world.outcome_of(write.rid)
        if outcome == "slow":
            write.gate = anyio.Event()
            self.world.pending.append(write)
            with anyio.CancelScope(shield=True):
                await write.gate.wait()
            self.world.pending.remove(write)
            outcome = "complete"
        await anyio.lowlevel.checkpoint()
        self._end(write, outcome)

    def _end(self, write: _Write, outcome: str) -> None:
        if outcome == "complete":
            ctypes.memmove(write.remote, write.local, write.nbytes)
        elif outcome == "fail":
            raise TransferError(f"{self.name}: the write of {write.rid} failed")
        else:
            write.hold = Hold(f"a write of {write.rid}", write.nbytes)
            self.world.pending.append(write)
            raise TransferTimeoutError(
                f"{self.name}: the write of {write.rid} timed out", hold=write.hold
            )

    def __repr__(self) -> str:
        return f"<ScriptedWrites {self.name}>"

    def destroy(self) -> None:
        self.destroyed = True
        for write in list(self.world.pending):
            if write.engine is self and write.hold is not None:
                self.world.end(write, landed=False, reason="its engine was destroyed")
        self.kept.clear()


@dataclass(eq=False)
class World:
    """What the machine planned and what the engines saw."""

    outcomes: dict[str, str] = field(default_factory=dict)
    sizes: dict[int, str] = field(default_factory=dict)
    pending: list[_Write] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def rid_of(self, nbytes: int) -> str:
        return self.sizes[nbytes]

    def outcome_of(self, rid: str) -> str:
        return self.outcomes[rid]

    def end(self, write: _Write, *, landed: bool, reason: str) -> None:
        """An unknown write's outcome becomes known: it lands (copies) now, or never."""
        assert write.hold is not None
        if landed:
            if not _keeps(write.hold, write.local, write.nbytes):
                self.violation(f"the source memory of {write.rid}'s write was let go")
            else:
                ctypes.memmove(write.remote, write.local, write.nbytes)
        self.pending.remove(write)
        write.hold.settle(reason)


def _keeps(hold: Hold, ptr: int, nbytes: int) -> bool:
    """Whether ``hold`` keeps alive a tensor covering ``[ptr, ptr + nbytes)``."""
    kept = list(hold._kept)
    while kept:
        obj = kept.pop()
        tensor = getattr(obj, "buffer", obj)
        if isinstance(tensor, torch.Tensor):
            start = tensor.data_ptr()
            if start <= ptr and ptr + nbytes <= start + tensor.numel() * tensor.element_size():
                return True
        keepalive = getattr(obj, "keepalive", None)
        if keepalive is not None:
            kept.append(keepalive)
    return False


def _overlaps(a: int, a_bytes: int, b: int, b_bytes: int) -> bool:
    return a < b + b_bytes and b < a + a_bytes


class InProcessClient:
    """The calls ``fetch_embeddings`` makes of an ``EncoderClient``, made on the Encoder in
    this process: the HTTP hop is all that is left out (its answers map one to one).

    ``cancel_at[part_id]`` names the call (``"encode"``, ``"send"``) at whose start the
    request's fetch is cancelled: a cancellation at a point the machine chose.
    """

    def __init__(self, encoder: Callable[[], Encoder]) -> None:
        self._encoder = encoder
        self.cancel_at: dict[str, tuple[str, anyio.CancelScope]] = {}

    async def _maybe_cancelled(self, part: PartPlan, call: str) -> None:
        point = self.cancel_at.get(part.req_id)
        if point is not None and point[0] == call:
            point[1].cancel()
            await anyio.lowlevel.checkpoint()

    def plan(self, rid: str, items: Mapping[Modality | str, Sequence[object]]) -> RequestPlan:
        return assign_parts(rid, items, ["in-process"])

    async def encode_part(self, part: PartPlan) -> PartMetadata:
        await self._maybe_cancelled(part, "encode")
        request = EncodeRequest(
            part.req_id, list(part.items), num_parts=part.num_parts, part_idx=part.part_idx
        )
        result = await self._encoder().encode(request)
        return PartMetadata(
            req_id=result.req_id,
            part_idx=part.part_idx,
            embedding_size=result.nbytes,
            embedding_len=result.num_tokens,
            embedding_dim=result.hidden_size,
            token_counts=result.token_counts,
            grid=result.grid,
        )

    async def send(self, part: PartPlan, target: Any) -> None:
        await self._maybe_cancelled(part, "send")
        destination = MooncakeDestination(target.session_id, target.buffer_address, "prefill")
        await self._encoder().send(part.req_id, destination)

    async def release_outcome(self, parts: Iterable[PartPlan]) -> ReleaseOutcome:
        confirmed, held, unconfirmed = set(), set(), set()
        for part in parts:
            try:
                await self._encoder().release(part.req_id)
            except TransferTimeoutError:
                held.add(part.req_id)
            except EncdisaggError:
                unconfirmed.add(part.req_id)
            else:
                confirmed.add(part.req_id)
        return ReleaseOutcome(frozenset(confirmed), frozenset(held), frozenset(unconfirmed))

    async def release_confirmed(self, part: PartPlan) -> bool:
        try:
            await self._encoder().release(part.req_id)
        except EncdisaggError:
            return False
        return True


class TransferContract(RuleBasedStateMachine):
    """See the module. ``backend`` is set by the test that runs it."""

    backend = "asyncio"

    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.model = ScriptedModel(hidden_size=HIDDEN)
        self.stack = ExitStack()
        self.portal = self.stack.enter_context(
            anyio.from_thread.start_blocking_portal(self.backend)
        )
        self.receiver_engine = ScriptedWrites("receiver:1", self.world)
        self.engines: list[ScriptedWrites] = []
        self.encoder: Encoder | None = None
        self.receiver: EmbeddingReceiver | None = None
        self._encoder_cm: AbstractContextManager[Any] | None = None
        self._receiver_cm: AbstractContextManager[Any] | None = None
        self.client = InProcessClient(self._current_encoder)
        self.fetches: dict[str, Future[None]] = {}
        self.scopes: dict[str, anyio.CancelScope] = {}
        self.cancel_points: dict[str, str] = {}
        self.mismatches: list[str] = []
        self.sizes = itertools.count(4)
        self.arena_mb = 0

    def _current_encoder(self) -> Encoder:
        assert self.encoder is not None
        return self.encoder

    # -- set-up ---------------------------------------------------------------------------

    @initialize(arena=st.booleans())
    def open_everything(self, arena: bool) -> None:
        self.arena_mb = 1 if arena else 0
        self._open_encoder()
        self._open_receiver()

    def _open_encoder(self) -> None:
        engine = ScriptedWrites(f"encoder:{len(self.engines) + 1}", self.world)
        self.engines.append(engine)
        config = EncoderConfig(
            staging_arena_mb=self.arena_mb, shutdown_grace_s=0.05, cleanup_timeout_s=0.2
        )
        encoder = Encoder(config, model=self.model, engine=engine)
        self._encoder_cm = self.portal.wrap_async_context_manager(encoder)
        self.encoder = self._encoder_cm.__enter__()

    def _open_receiver(self) -> None:
        receiver = EmbeddingReceiver(
            transport="mooncake",
            hidden_size=HIDDEN,
            dtype=torch.float16,
            engine=self.receiver_engine,
            landing_pages=LANDING_PAGES,
            page_bytes=PAGE_BYTES,
            alloc_timeout_s=0.05,
            quarantine_s=3600.0,
            close_timeout_s=0.2,
        )
        self._receiver_cm = self.portal.wrap_async_context_manager(receiver)
        self.receiver = self._receiver_cm.__enter__()

    def _close_receiver(self) -> None:
        assert self._receiver_cm is not None
        self._receiver_cm.__exit__(None, None, None)
        self._receiver_cm = self.receiver = None

    def _close_encoder(self) -> None:
        assert self._encoder_cm is not None
        self._encoder_cm.__exit__(None, None, None)
        self._encoder_cm = self.encoder = None

    # -- requests -------------------------------------------------------------------------

    def _expected(self, tokens: int) -> bytes:
        pre = self.model.preprocess([tokens], Modality.IMAGE)
        return self.model.forward([pre])[0].contiguous().view(torch.uint8).numpy().tobytes()

    async def _fetch(self, rid: str, tokens: int) -> None:
        receiver = self.receiver
        assert receiver is not None
        scope = self.scopes[rid] = anyio.CancelScope()
        point = self.cancel_points.get(rid)
        if point is not None:
            self.client.cancel_at[f"{rid}#0"] = (point, scope)
        with scope:
            try:
                async with fetch_embeddings(
                    self.client, receiver, rid, {"image": [tokens]}, timeout_s=SETTLE_S
                ) as got:
                    landed = got.parts[0].tensor.contiguous().view(torch.uint8).numpy().tobytes()
                    if landed != self._expected(tokens):
                        self.mismatches.append(f"{rid} received bytes not its own")
            except EncdisaggError:
                pass

    def _running(self) -> list[str]:
        """Requests whose fetch runs: only those whose write is slow, between rules."""
        return [rid for rid, future in self.fetches.items() if not future.done()]

    @rule(
        outcome=st.sampled_from(OUTCOMES),
        cancelled=st.sampled_from((None, "encode", "send")),
    )
    def start(self, outcome: str, cancelled: str | None) -> None:
        """A request's fetch, run until it ended or its write is slow (so what the machine
        knows of it never depends on timing); ``cancelled``: cancelled as that call starts."""
        tokens = next(self.sizes)
        rid = f"r{tokens}"
        part = f"{rid}#0"
        self.world.sizes[tokens * HIDDEN * ITEM] = part
        self.world.outcomes[part] = outcome
        if cancelled is not None:
            self.cancel_points[rid] = cancelled
        future = self.portal.start_task_soon(self._fetch, rid, tokens)
        self.fetches[rid] = future
        deadline = time.monotonic() + SETTLE_S
        while not future.done() and not any(w.rid == part for w in self._slow()):
            assert time.monotonic() < deadline, f"{rid} neither ended nor reached its write"
            futures.wait([future], timeout=0.005)

    def _unknown(self) -> list[_Write]:
        return [write for write in self.world.pending if write.hold is not None]

    @precondition(lambda self: bool(self._unknown()))
    @rule(data=st.data(), lands=st.booleans())
    def an_unknown_write_ends(self, data: st.DataObject, lands: bool) -> None:
        write = data.draw(st.sampled_from(self._unknown()))
        reason = "the write landed late" if lands else "the write failed late"
        self.portal.call(self._end_write, write, lands, reason)

    async def _end_write(self, write: _Write, lands: bool, reason: str) -> None:
        self.world.end(write, landed=lands, reason=reason)

    def _slow(self) -> list[_Write]:
        return [write for write in self.world.pending if write.gate is not None]

    @precondition(lambda self: bool(self._slow()))
    @rule(data=st.data())
    def a_slow_write_ends(self, data: st.DataObject) -> None:
        write = data.draw(st.sampled_from(self._slow()))
        assert write.gate is not None
        self.portal.call(write.gate.set)
        self.fetches[write.rid.partition("#")[0]].result(timeout=SETTLE_S)

    @precondition(lambda self: bool(self._slow()))
    @rule(data=st.data())
    def cancel_during_a_slow_write(self, data: st.DataObject) -> None:
        """Cancelled mid-transfer: the fetch still waits for its write (shielded)."""
        write = data.draw(st.sampled_from(self._slow()))
        self.portal.call(self.scopes[write.rid.partition("#")[0]].cancel)

    @precondition(lambda self: bool(self.fetches))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        part = f"{data.draw(st.sampled_from(sorted(self.fetches)))}#0"
        if any(write.rid == part and write.gate is not None for write in self.world.pending):
            return  # a release waits for a slow write: the machine would wait on itself
        unknown = any(write.rid == part and write.hold is not None for write in self.world.pending)
        try:
            self.portal.call(self._current_encoder().release, part)
        except TransferTimeoutError:
            # The contract: never confirmed as stopped while the write may still land.
            assert unknown, f"a release of {part} said held with no write pending"
        else:
            assert not unknown, f"a release of {part} confirmed a write that may still land"

    @rule()
    def close_and_reopen_the_receiver(self) -> None:
        self._finish_fetches()
        self._close_receiver()
        self._open_receiver()

    @rule()
    def close_and_reopen_everything(self) -> None:
        self._finish_fetches()
        self._close_receiver()
        self._close_encoder()
        # A closed encoder's engine goes with it: its writes stop, their holds settle.
        self.engines[-1].destroy()
        self._open_encoder()
        self._open_receiver()

    def _finish_fetches(self, *, land: bool = False) -> None:
        """Let every slow write go (and, with ``land``, every unknown one land) until every
        request's fetch ended: a fetch may reach its write only later."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            for write in self._slow():
                assert write.gate is not None
                self.portal.call(write.gate.set)
            if land:
                for write in self._unknown():
                    self.portal.call(self._end_write, write, True, "the write landed late")
            running = [future for future in self.fetches.values() if not future.done()]
            if not running and not (land and self.world.pending):
                break
            assert time.monotonic() < deadline, f"requests still running: {self._running()}"
            futures.wait(running, timeout=0.01)
        for future in self.fetches.values():
            future.result()

    @rule()
    def every_transfer_ends(self) -> None:
        """Every write ends (the unknown ones land), every request ends: every counter
        must come back to zero."""
        self._finish_fetches(land=True)
        self.portal.call(self._settled)

    async def _settled(self) -> None:
        encoder, receiver = self.encoder, self.receiver
        assert encoder is not None
        assert receiver is not None
        with anyio.move_on_after(SETTLE_S):
            while True:
                stats, landing = encoder.stats(), receiver.stats()
                if (
                    stats.live_requests,
                    stats.staged_bytes,
                    stats.held_bytes,
                    stats.inflight_transfers,
                    landing.live_requests,
                    landing.landing_pages_in_use,
                    landing.held_pages,
                ) == (0,) * 7:
                    return
                await anyio.sleep(0.005)
        raise AssertionError(f"not back to zero: {encoder.stats()} / {receiver.stats()}")

    # -- what must hold after every step ----------------------------------------------------

    @invariant()
    def nothing_touched_memory_it_should_not(self) -> None:
        assert self.world.violations == []
        assert self.mismatches == []

    @invariant()
    def pending_writes_keep_their_memory(self) -> None:
        self.portal.call(self._check_pending)

    async def _check_pending(self) -> None:
        receiver = self.receiver
        held = [] if receiver is None else receiver.pool.held_runs()
        for write in self.world.pending:
            if write.hold is not None:
                assert _keeps(write.hold, write.local, write.nbytes), write.rid
            if receiver is None or write.hold is None:
                continue
            pool = receiver.pool
            if not pool.ptr <= write.remote < pool.ptr + pool.nbytes:
                continue  # an earlier receiver's pool, left to its engine
            page = (write.remote - pool.ptr) // pool.page_bytes
            rid = write.rid.partition("#")[0]
            inside = any(run.start <= page < run.start + run.count for run in held)
            assert inside or rid in self._running(), f"{rid}'s landing pages are not held"

    def teardown(self) -> None:
        try:
            self._finish_fetches()
            for write in self._unknown():
                self.portal.call(self._end_write, write, False, "teardown")
            if self.receiver is not None:
                self._close_receiver()
            if self.encoder is not None:
                self._close_encoder()
            for engine in self.engines:
                engine.destroy()
        finally:
            self.stack.close()
        assert self.world.violations == []


@pytest.fixture
def quick_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver asks encoders again after a millisecond, at most 10 ms apart."""
    monkeypatch.setattr(_landing_holds, "_FIRST_ASK_S", 0.001)
    monkeypatch.setattr(_landing_holds, "_MAX_ASK_S", 0.01)


@pytest.mark.usefixtures("quick_asks")
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_transfer_contract_holds(backend: str) -> None:
    machine = type(f"TransferContract_{backend}", (TransferContract,), {"backend": backend})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=sized(25, 1000),
            stateful_step_count=sized(25, 60),
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
