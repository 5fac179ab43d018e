"""A small etcd v3 client over etcd's JSON gateway (HTTP), on asyncio and on Trio.

etcd's gRPC API has a JSON face (grpc-gateway): ``POST /v3/kv/put``, ``/v3/kv/range``,
``/v3/kv/deleterange``, ``/v3/lease/grant``, ``/v3/lease/keepalive``, ``/v3/lease/revoke``
and the streaming ``/v3/watch``, with keys and values in base64 and 64-bit integers as
strings. ``httpx`` speaks it on both AnyIO backends, which no maintained etcd client does.
Only what the registry needs is here: leases, puts, prefix reads and prefix watches.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

import anyio
import httpx

from .._errors import ServiceUnavailableError
from ._url import RegistryUrl

__all__ = [
    "EtcdClient",
    "KeyValue",
    "RegistryUnavailableError",
    "WatchCompactedError",
    "WatchEvent",
]

#: gRPC status etcd answers for a lease it does not know (expired or revoked).
_NOT_FOUND: Final = 5
#: Longest watch line accepted: one batch of events of a small fleet is a few kB.
_MAX_LINE_BYTES: Final = 16 * 1024 * 1024


class RegistryUnavailableError(ServiceUnavailableError):
    """etcd could not be reached, or answered something that is not its API (503)."""


class WatchCompactedError(Exception):
    """The watch's start revision was compacted away: read the prefix afresh."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}")


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    #: The revision of the put that wrote this value.
    mod_revision: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    #: The new value (empty for a delete).
    value: bytes
    revision: int


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode("ascii")


def _unb64(value: object, what: str) -> bytes:
    if value is None:
        return b""
    if not isinstance(value, str):
        raise RegistryUnavailableError(f"etcd answered a non-string {what}")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise RegistryUnavailableError(f"etcd answered a {what} that is not base64") from None


def _int(value: object, what: str) -> int:
    # grpc-gateway writes int64 as a JSON string and leaves zero values out.
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise RegistryUnavailableError(f"etcd answered a {what} that is not an integer")
    try:
        return int(value)
    except ValueError:
        raise RegistryUnavailableError(f"etcd answered a {what} that is not an integer") from None


def prefix_end(prefix: str) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        # etcd's "every key from here on".
        return b"\0"
    raw[-1] += 1
    return bytes(raw)


def _event(raw: object, header_revision: int) -> WatchEvent:
    if not isinstance(raw, dict) or not isinstance(raw.get("kv"), dict):
        raise RegistryUnavailableError("etcd answered a watch event without kv")
    kv = raw["kv"]
    kind: Literal["put", "delete"] = "delete" if raw.get("type") == "DELETE" else "put"
    key = _unb64(kv.get("key"), "key").decode("utf-8", errors="replace")
    revision = _int(kv.get("mod_revision"), "mod_revision") or header_revision
    value = b"" if kind == "delete" else _unb64(kv.get("value"), "value")
    return WatchEvent(kind, key, value, revision)


class EtcdClient(anyio.AsyncContextManagerMixin):
    """An etcd v3 client for one server; ``async with`` opens its connection pool.

    Every call is a checkpoint bounded by ``timeout_s`` (the watch only while it connects)
    and raises :class:`RegistryUnavailableError` when etcd cannot be reached or answers
    with an error. Cancelling a call abandons its HTTP request.

    :param url: the registry (its host and port are etcd's client endpoint).
    :param timeout_s: bound on one call.
    :param transport: an ``httpx`` transport (e.g. one bound to a local address).
    """

    def __init__(
        self,
        url: RegistryUrl,
        *,
        timeout_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url
        self._timeout_s = timeout_s
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[EtcdClient]:
        """Entering opens the pool (not a checkpoint); leaving closes it (shielded, bounded)."""
        client = httpx.AsyncClient(
            base_url=self.url.gateway,
            timeout=httpx.Timeout(self._timeout_s),
            transport=self._transport,
        )
        self._client = client
        try:
            yield self
        finally:
            self._client = None
            with anyio.move_on_after(self._timeout_s, shield=True):
                await client.aclose()

    def _require(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RegistryUnavailableError("the etcd client is not open")
        return self._client

    async def _call(self, path: str, body: dict[str, Any], *, lease_call: bool = False) -> Any:
        client = self._require()
        try:
            with anyio.fail_after(self._timeout_s):
                response = await client.post(path, json=body)
        except (TimeoutError, httpx.TimeoutException):
            raise RegistryUnavailableError(
                f"etcd at {self.url.gateway} did not answer {path} within {self._timeout_s} s"
            ) from None
        except httpx.HTTPError as exc:
            raise RegistryUnavailableError(
                f"etcd at {self.url.gateway} could not be reached: {exc!r}"
            ) from None
        try:
            answer = response.json()
        except ValueError:
            raise RegistryUnavailableError(f"etcd answered {path} with a non-JSON body") from None
        if not isinstance(answer, dict):
            raise RegistryUnavailableError(f"etcd answered {path} with a non-object")
        if response.status_code >= 400 or "error" in answer:
            if lease_call and answer.get("code") == _NOT_FOUND:
                return None
            message = answer.get("message") or answer.get("error") or response.reason_phrase
            raise RegistryUnavailableError(f"etcd refused {path}: {str(message)[:200]}")
        return answer

    # -- leases ------------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id. A checkpoint."""
        answer = await self._call("/v3/lease/grant", {"TTL": str(ttl_s)})
        lease = _int(answer.get("ID"), "lease ID")
        if lease == 0:
            raise RegistryUnavailableError("etcd granted no lease")
        return lease

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; the seconds it has left, 0 if it is gone. A checkpoint."""
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        result = answer.get("result") if isinstance(answer, dict) else None
        if not isinstance(result, dict):
            raise RegistryUnavailableError("etcd answered a keepalive without a result")
        # A lease etcd no longer knows comes back without a TTL.
        return _int(result.get("TTL"), "TTL")

    async def revoke(self, lease: int) -> None:
        """End ``lease`` and delete its keys; a lease already gone is fine. A checkpoint."""
        await self._call("/v3/lease/revoke", {"ID": str(lease)}, lease_call=True)

    # -- keys --------------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Write ``key``; the revision of the write. A checkpoint."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = str(lease)
        answer = await self._call("/v3/kv/put", body)
        return _int(answer.get("header", {}).get("revision"), "revision")

    async def delete(self, key: str) -> int:
        """Delete ``key``; how many keys were deleted (0 or 1). A checkpoint."""
        answer = await self._call("/v3/kv/deleterange", {"key": _b64(key)})
        return _int(answer.get("deleted"), "deleted")

    async def get_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the store's revision at the read. A checkpoint."""
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        answer = await self._call("/v3/kv/range", body)
        revision = _int(answer.get("header", {}).get("revision"), "revision")
        kvs = answer.get("kvs") or []
        if not isinstance(kvs, list):
            raise RegistryUnavailableError("etcd answered a range whose kvs is not a list")
        found = []
        for kv in kvs:
            if not isinstance(kv, dict):
                raise RegistryUnavailableError("etcd answered a range entry that is not an object")
            found.append(
                KeyValue(
                    _unb64(kv.get("key"), "key").decode("utf-8", errors="replace"),
                    _unb64(kv.get("value"), "value"),
                    _int(kv.get("mod_revision"), "mod_revision"),
                )
            )
        return revision, found

    async def watch_prefix(
        self,
        prefix: str,
        start_revision: int,
        on_events: Callable[[Sequence[WatchEvent]], None],
        *,
        on_created: Callable[[], None] | None = None,
    ) -> None:
        """Watch every key under ``prefix`` from ``start_revision`` on.

        A checkpoint that runs until the stream ends: ``on_events`` (synchronous) gets each
        batch of changes in revision order, ``on_created`` is called once etcd confirmed
        the watch. Cancelling it closes the stream.

        :raises WatchCompactedError: ``start_revision`` is older than etcd keeps.
        :raises RegistryUnavailableError: etcd could not be reached, or the stream broke.
        """
        client = self._require()
        request = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        # Idle watches send nothing for as long as nothing changes: no read timeout.
        timeout = httpx.Timeout(self._timeout_s, read=None)
        try:
            async with client.stream("POST", "/v3/watch", json=request, timeout=timeout) as stream:
                if stream.status_code >= 400:
                    raise RegistryUnavailableError(f"etcd refused the watch ({stream.status_code})")
                # Closed here, not left to the garbage collector, when a line ends the watch.
                lines = cast("AsyncGenerator[str, None]", stream.aiter_lines())
                async with aclosing(lines):
                    async for line in lines:
                        if len(line) > _MAX_LINE_BYTES:
                            raise RegistryUnavailableError("etcd sent an oversized watch line")
                        if line.strip():
                            self._watch_line(line, on_events, on_created)
        except httpx.HTTPError as exc:
            raise RegistryUnavailableError(f"the etcd watch broke: {exc!r}") from None
        raise RegistryUnavailableError("etcd ended the watch stream")

    @staticmethod
    def _watch_line(
        line: str,
        on_events: Callable[[Sequence[WatchEvent]], None],
        on_created: Callable[[], None] | None,
    ) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            raise RegistryUnavailableError("etcd sent a watch line that is not JSON") from None
        result = message.get("result") if isinstance(message, dict) else None
        if not isinstance(result, dict):
            raise RegistryUnavailableError(f"etcd sent a watch error: {line[:200]}")
        compacted = _int(result.get("compact_revision"), "compact_revision")
        if compacted:
            raise WatchCompactedError(compacted)
        if result.get("canceled"):
            raise RegistryUnavailableError("etcd cancelled the watch")
        if result.get("created") and on_created is not None:
            on_created()
        raw_events = result.get("events") or []
        if not isinstance(raw_events, list):
            raise RegistryUnavailableError("etcd sent watch events that are not a list")
        header = result.get("header")
        revision = _int(header.get("revision") if isinstance(header, dict) else None, "revision")
        if raw_events:
            on_events([_event(raw, revision) for raw in raw_events])
