"""The store behind the global tier: a small blocking protocol and its Mooncake Store client.

The encoder never hands the store a pointer into its own memory: puts pass Python buffers
(kept alive by reference for as long as the call runs) and gets land in the store client's
own transfer buffer, from which the rows are copied into a tensor the call allocates. So a
store call that is still running when its caller gave up can never write into memory the
encoder freed or reused; that is what lets requests stop waiting for a slow store.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, Protocol, final

import torch

from .._errors import TransferError

if TYPE_CHECKING:
    from ._store_url import GlobalCacheSettings

__all__ = [
    "EmbeddingStore",
    "MooncakeEmbeddingStore",
    "ensure_mooncake_store",
    "open_mooncake_store",
    "rc_name",
]

logger = logging.getLogger("encdisagg.cache")

_MIB: Final = 1024 * 1024

# Mooncake Store error codes (mooncake-store's ErrorCode) that this module names or handles.
_RC_NAMES: Final = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "HEARTBEAT_RPC_UNREACHABLE",
}
OBJECT_NOT_FOUND: Final = -704
OBJECT_ALREADY_EXISTS: Final = -705


def rc_name(rc: int) -> str:
    """``"-706 OBJECT_HAS_LEASE"`` for a known Mooncake Store code, else the number."""
    name = _RC_NAMES.get(rc)
    return f"{rc} {name}" if name else str(rc)


class EmbeddingStore(Protocol):
    """What the global tier needs from a store. Every call blocks and is thread-safe; the
    cache calls them from worker threads only."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored. :raises TransferError: if the lookup failed."""
        ...

    def fetch(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Each key's whole value as a fresh 1-D uint8 CPU tensor, or ``None`` where it could
        not be read (gone since the lookup, or a failed read).

        :raises TransferError: if the whole fetch failed.
        """
        ...

    def put(self, key: str, header: bytes, payload: memoryview) -> None:
        """Store ``header + payload`` under ``key``; a key that exists already is left as is.

        :raises TransferError: if the store refused or failed.
        """
        ...

    def remove(self, key: str) -> None:
        """Remove ``key`` (a missing key is fine). :raises TransferError: on failure."""
        ...

    def close(self) -> None:
        """Leave the store (unmount this client's memory). Called once, last."""
        ...


class _MooncakeStoreApi(Protocol):
    """The part of ``mooncake.store.MooncakeDistributedStore`` (pybind) used here."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
        /,
    ) -> int: ...
    def batch_is_exist(self, keys: list[str], /) -> list[int]: ...
    def batch_get_buffer(self, keys: list[str], /) -> list[_BufferHandle | None]: ...
    def put_parts(self, key: str, /, *parts: object) -> int: ...
    def remove(self, key: str, force: bool = False, /) -> int: ...
    def close(self) -> int: ...


class _BufferHandle(Protocol):
    def ptr(self) -> int: ...
    def size(self) -> int: ...


def _check_count(call: str, answers: Sequence[object], what: str, keys: Sequence[str]) -> None:
    """:raises TransferError: a batch call answered other than one ``what`` per key."""
    if len(answers) != len(keys):
        raise TransferError(
            f"mooncake store {call} answered {len(answers)} {what} for {len(keys)} keys"
        )


def _store_class() -> Callable[[], _MooncakeStoreApi]:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            "global_cache needs the Mooncake Store: install 'encdisagg[mooncake-cpu]' (and "
            "the system library libibverbs1) on CPU hosts, or 'encdisagg[mooncake]' on CUDA "
            f"hosts. Importing it failed: {exc}"
        ) from exc
    factory: Callable[[], _MooncakeStoreApi] = MooncakeDistributedStore
    return factory


def ensure_mooncake_store() -> None:
    """Import the Mooncake Store now. Blocks briefly (loads its library once).

    :raises ImportError: saying what to install, if it is missing.
    """
    _store_class()


@final
class MooncakeEmbeddingStore:
    """:class:`EmbeddingStore` over a set-up ``MooncakeDistributedStore``.

    Build it with :func:`open_mooncake_store`. Every failing Mooncake code raises
    :class:`~encdisagg.TransferError` naming the call and the code.
    """

    def __init__(self, api: _MooncakeStoreApi) -> None:
        self._api = api
        self._lock = threading.Lock()
        self._closed = False

    def _require(self, call: str) -> _MooncakeStoreApi:
        if self._closed:
            raise TransferError(f"mooncake store {call}: the client is closed")
        return self._api

    def exists(self, keys: Sequence[str]) -> list[bool]:
        api = self._require("batch_is_exist")
        codes = api.batch_is_exist(list(keys))
        _check_count("batch_is_exist", codes, "codes", keys)
        failed = [code for code in codes if code not in (0, 1)]
        if failed:
            raise TransferError(f"mooncake store batch_is_exist failed (rc={rc_name(failed[0])})")
        return [code == 1 for code in codes]

    def fetch(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        api = self._require("batch_get_buffer")
        handles = api.batch_get_buffer(list(keys))
        _check_count("batch_get_buffer", handles, "buffers", keys)
        values: list[torch.Tensor | None] = []
        try:
            for handle in handles:
                if handle is None:
                    values.append(None)
                    continue
                size = int(handle.size())
                value = torch.empty(size, dtype=torch.uint8)
                # The handle's memory is the client's own transfer buffer; the copy lands in
                # a tensor allocated here, so nothing outlives the handle.
                ctypes.memmove(value.data_ptr(), handle.ptr(), size)
                values.append(value)
        finally:
            # Dropping the handles returns their space to the client's transfer buffer.
            del handles
        return values

    def put(self, key: str, header: bytes, payload: memoryview) -> None:
        api = self._require("put_parts")
        rc = api.put_parts(key, header, payload)
        if rc not in (0, OBJECT_ALREADY_EXISTS):
            raise TransferError(f"mooncake store put of {key} failed (rc={rc_name(rc)})")

    def remove(self, key: str) -> None:
        api = self._require("remove")
        # force=True: the read that found the entry invalid holds a lease on it, and an
        # unforced remove answers OBJECT_HAS_LEASE (-706) until the lease runs out.
        rc = api.remove(key, True)
        if rc not in (0, OBJECT_NOT_FOUND):
            raise TransferError(f"mooncake store remove of {key} failed (rc={rc_name(rc)})")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        rc = self._api.close()
        if rc != 0:
            logger.warning("closing the mooncake store client answered rc=%s", rc_name(rc))


def open_mooncake_store(settings: GlobalCacheSettings) -> MooncakeEmbeddingStore:
    """Set up a Mooncake Store client as ``settings`` say. Blocks (a Mooncake setup talks to
    the master and the metadata server; against an unreachable master it can take minutes).

    :raises TransferError: if the setup answered a failing code.
    :raises ImportError: if Mooncake is not installed.
    """
    api = _store_class()()
    rc = api.setup(
        settings.host,
        settings.metadata,
        settings.segment_mb * _MIB,
        settings.buffer_mb * _MIB,
        settings.protocol,
        settings.device,
        settings.master,
    )
    if rc != 0:
        # A failed setup may still have started threads; close what there is.
        try:
            api.close()
        except Exception:  # pragma: no cover - best effort on an already failed client
            logger.debug("closing a store client whose setup failed raised", exc_info=True)
        raise TransferError(
            f"mooncake store setup against master {settings.master} and metadata "
            f"{settings.metadata} failed (rc={rc_name(rc)})"
        )
    return MooncakeEmbeddingStore(api)
