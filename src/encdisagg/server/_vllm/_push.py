"""The producer side of vLLM's ``ECMooncakeConnector``: one item pushed to a PD's TP shards.

Per item, over the control channel (``_control``):

1. ``peers`` to the consumer's address: the ports of its TP shards (same host).
2. ``reserve_batch`` on every shard: each answers where to write (``dst_session``,
   ``dst_ptr``) and whether to (``write``), or that the bytes are there already (``cached``),
   or that the PD gave the transfer up (``cancelled``).
3. Reservations older than ``refresh_after_s`` are refreshed (``cancel`` with ``refresh``,
   then reserved again) before any write: the PD frees reservations left unwritten twice
   that long.
4. One Mooncake write per shard that asked for one (the caller's ``write``: our Encoder's
   delivery, from its registered memory, under its held-memory rules).
5. ``complete_batch`` on each shard written: only then did the push succeed.

On any failure, cancellation included, every reservation is cancelled with ``abandon``
(shielded, bounded), except one whose write ended with an unknown outcome: the bytes may
still land there, so that memory is not handed back (the PD keeps a reservation in writing
until its writer completes or abandons it; it is freed with the PD's transfer). Then the
error is raised: the route answers 500, so a 200 always means every shard has the bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import anyio

from ..._errors import EncdisaggError, InternalError, TransferTimeoutError
from ..._strict import convert
from .._fields import type_name
from ._control import ControlChannel, ControlError, control_result

__all__ = ["PushSpec", "Shard", "push_item"]

_log = logging.getLogger("encdisagg.server.vllm")

_T = TypeVar("_T")

#: Most TP shards one consumer may name.
_MAX_SHARDS: Final = 64


@dataclass(frozen=True, slots=True)
class PushSpec:
    """One item to push: where, under which ids, and its tensor's description."""

    consumer_zmq: str
    transfer_id: str
    mm_hash: str
    nbytes: int
    shape: tuple[int, int]
    dtype: str

    def reserve_item(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "mm_hash": self.mm_hash,
            "nbytes": self.nbytes,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }


@dataclass(frozen=True, slots=True)
class Shard:
    """One shard's reservation, as its ``reserve`` answered (a key left out: its default)."""

    address: str
    #: When the answer came (the caller's clock).
    received_at: float
    reservation_id: str = ""
    dst_session: str = ""
    dst_ptr: int = 0
    nbytes: int = 0
    write: bool = True
    ready: bool = False
    cached: bool = False
    cancelled: bool = False

    @property
    def writable(self) -> bool:
        """Whether this push must write the bytes there."""
        return self.write and not self.cached and not self.cancelled

    @property
    def held(self) -> bool:
        """Whether the shard holds a reservation of ours (to complete or cancel)."""
        return bool(self.reservation_id) and not self.cancelled


#: Writes the staged item into a shard; ``count`` is how many shards are written.
Write = Callable[[Shard, int], Awaitable[None]]


async def push_item(
    channel: ControlChannel,
    spec: PushSpec,
    write: Write,
    *,
    clock: Callable[[], float],
    refresh_after_s: float,
) -> None:
    """Push one item to every shard of ``spec.consumer_zmq`` (see the module's steps).

    A checkpoint; every exchange is bounded by the channel's timeout, each write by the
    writer's own bound. Returns once every shard completed (or had the bytes already).
    Cancelled, the reservations are cancelled (shielded) before the cancellation goes on.

    :raises EncdisaggError: a control exchange or a write failed (the reservations were
        cancelled); :class:`~encdisagg.TransferTimeoutError` when a write's outcome is
        unknown.
    """
    shards = await _shards(channel, spec.consumer_zmq)
    reserved: dict[str, Shard] = {}
    # Shards whose reserve went unanswered (they may hold one), and shards a write of
    # unknown outcome may still touch.
    unanswered: list[str] = []
    unknown: set[str] = set()
    try:
        await _reserve(channel, spec, shards, reserved, clock, unanswered)
        stale = [
            shard
            for shard in reserved.values()
            if shard.held
            and not shard.ready
            and not shard.cached
            and clock() - shard.received_at >= refresh_after_s
        ]
        if stale:
            await _refresh(channel, spec, stale, reserved, clock, unanswered)
        writable = [shard for shard in reserved.values() if shard.writable]
        for shard in writable:
            if shard.nbytes != spec.nbytes:
                raise InternalError(
                    f"{shard.address} reserved {shard.nbytes} bytes for a "
                    f"{spec.nbytes}-byte item (mm_hash {spec.mm_hash!r})"
                )
        # A write that timed out may still land: its shard's reservation is not handed back.
        await _on_each(
            writable,
            lambda shard: write(shard, len(writable)),
            timed_out=lambda shard: unknown.add(shard.address),
        )
        await _complete(channel, spec, writable)
    except BaseException:
        with anyio.CancelScope(shield=True):
            kept = [shard for shard in reserved.values() if shard.address not in unknown]
            await _abandon(channel, spec, kept, unanswered)
        raise


async def _shards(channel: ControlChannel, consumer: str) -> list[str]:
    result = await channel.request(consumer, {"op": "peers"})
    ports = result.get("ports") if isinstance(result, dict) else None
    if (
        not isinstance(ports, list)
        or not 1 <= len(ports) <= _MAX_SHARDS
        or any(isinstance(p, bool) or not isinstance(p, int) or not 0 < p < 65536 for p in ports)
    ):
        raise ControlError(f"peers of {consumer}: expected a list of ports, got {type_name(ports)}")
    host = consumer.rsplit(":", 1)[0]
    return list(dict.fromkeys(f"{host}:{port}" for port in ports))


async def _reserve(
    channel: ControlChannel,
    spec: PushSpec,
    addresses: list[str],
    into: dict[str, Shard],
    clock: Callable[[], float],
    unanswered: list[str],
) -> None:
    """Reserve on every shard at once; every reservation made is recorded in ``into``, and
    every shard that did not answer in ``unanswered``, before the first failure (if any)
    is raised."""

    async def one(address: str) -> None:
        answer = await channel.request(
            address, {"op": "reserve_batch", "items": [spec.reserve_item()]}
        )
        into[address] = _shard(address, answer, clock())

    await _on_each(addresses, one, timed_out=unanswered.append)


def _one_item(answer: object, op: str, address: str) -> object:
    """The one item of a batch's answer (every batch here holds one item)."""
    items = answer.get("items") if isinstance(answer, dict) else None
    if not isinstance(items, list) or len(items) != 1:
        raise ControlError(f"{op} to {address}: expected one item in the answer")
    return items[0]


def _shard(address: str, answer: object, now: float) -> Shard:
    item = _one_item(answer, "reserve_batch", address)
    result = control_result(item, "reserve_batch", address)
    if not isinstance(result, dict):
        raise ControlError(f"reserve_batch to {address}: the item has no result")

    def error(message: str) -> ControlError:
        return ControlError(f"reserve_batch to {address}: {message}")

    fields = {**result, "address": address, "received_at": now}
    return convert(fields, Shard, "the reservation", error)


async def _refresh(
    channel: ControlChannel,
    spec: PushSpec,
    stale: list[Shard],
    reserved: dict[str, Shard],
    clock: Callable[[], float],
    unanswered: list[str],
) -> None:
    """Cancel each stale reservation with ``refresh``, then reserve it again."""
    for shard in stale:
        await channel.request(shard.address, _cancel(spec, shard.reservation_id, "refresh"))
        del reserved[shard.address]
    await _reserve(channel, spec, [shard.address for shard in stale], reserved, clock, unanswered)


async def _complete(channel: ControlChannel, spec: PushSpec, shards: list[Shard]) -> None:
    async def one(shard: Shard) -> None:
        answer = await channel.request(
            shard.address,
            {
                "op": "complete_batch",
                "items": [
                    {"transfer_id": spec.transfer_id, "reservation_id": shard.reservation_id}
                ],
            },
        )
        item = _one_item(answer, "complete_batch", shard.address)
        if not isinstance(item, dict) or item.get("completed") is not True:
            raise ControlError(
                f"complete_batch to {shard.address}: the reservation was not completed"
            )

    await _on_each(shards, one)


async def _on_each(
    targets: Iterable[_T],
    call: Callable[[_T], Awaitable[None]],
    *,
    timed_out: Callable[[_T], object] | None = None,
) -> None:
    """``call`` every target at once and wait for all; then raise the first failure, if any.

    A failure does not cancel the other calls: each records what it did (a reservation
    made, a write started) for the cleanup to see. ``timed_out`` is told of each target whose
    call ended with an unknown outcome.
    """
    failures: list[EncdisaggError] = []

    async def one(target: _T) -> None:
        try:
            await call(target)
        except TransferTimeoutError as exc:
            if timed_out is not None:
                timed_out(target)
            failures.append(exc)
        except EncdisaggError as exc:
            failures.append(exc)

    async with anyio.create_task_group() as group:
        for target in targets:
            group.start_soon(one, target)
    if failures:
        raise failures[0]


async def _abandon(
    channel: ControlChannel, spec: PushSpec, shards: list[Shard], unanswered: list[str]
) -> None:
    """Cancel each reservation with ``abandon``, and the transfer on each shard that did
    not answer its reserve (an empty ``reservation_id`` names whatever the shard holds for
    the transfer); failures are logged, never raised."""

    async def one(address: str, reservation_id: str) -> None:
        try:
            await channel.request(address, _cancel(spec, reservation_id, "abandon"))
        except EncdisaggError as exc:
            _log.warning("abandoning transfer %s on %s failed: %s", spec.transfer_id, address, exc)

    async with anyio.create_task_group() as group:
        for shard in shards:
            if shard.held:
                group.start_soon(one, shard.address, shard.reservation_id)
        for address in unanswered:
            group.start_soon(one, address, "")


def _cancel(spec: PushSpec, reservation_id: str, why: str) -> dict[str, Any]:
    """A ``cancel`` of a reservation, flagged ``why`` (``refresh`` or ``abandon``)."""
    return {
        "op": "cancel",
        "transfer_id": spec.transfer_id,
        "reservation_id": reservation_id,
        why: True,
    }
