"""vLLM's encoder call served by our Encoder (or data-parallel workers), transport-neutral.

One request of vLLM's proxy holds one or more media items. Each distinct uuid is encoded as
its own part (so each item's embedding is its own tensor, as vLLM's consumer takes it; the
Encoder still batches parts that arrive together), then handed to the PD:

- ``example`` (shared storage): the staged bytes come out through the Encoder's own push to
  a loopback socket (``_relay``, so one Encoder and data-parallel workers alike), are
  cast to the PD's dtype and written as the item's safetensors file before the answer.
- ``mooncake``: the item is pushed to every TP shard of the PD named in the body
  (``_push``); each write is the Encoder's own Mooncake delivery from its registered memory,
  so a write whose outcome is unknown keeps its memory held.

The answer maps each uuid to its ``modality``, ``item_indices``, placeholder ``metadata``
(``_metadata``) and, when pushed, ``transfer_id``. Every part is released (shielded, bounded)
whatever the outcome.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Final

import anyio
import torch

from ..._config import EncoderConfig
from ..._errors import BadRequestError, ConfigError, EncdisaggError, InternalError, TransferError
from ...encoder import EncodeResult, MooncakeDestination
from ...models._checkpoint import model_type_of
from ...nurseries import ServiceTaskGroup, run_thread_to_completion
from .._access import PeerAllowList
from .._backend import Backend, release_within
from .._messages import EncodeBody, SendBody
from .._settings import ServerSettings, canonical_dtype
from ._bodies import ChatBody, MediaItem
from ._control import ControlChannel
from ._metadata import Family, check_family, family_of, item_metadata
from ._push import PushSpec, Shard, push_item
from ._relay import relay_staged
from ._storage import EmbeddingStore

__all__ = ["VllmService", "check_connector"]

_log = logging.getLogger("encdisagg.server.vllm")

#: How often the store is swept for age, at most (and at least a quarter of the age bound).
_SWEEP_PERIOD_S: Final = 60.0
#: Where the Encoder's own pushes reach this service: loopback, a free port per part.
_RELAY_BIND: Final = "tcp://127.0.0.1:0"


def check_connector(config: EncoderConfig, settings: ServerSettings) -> None:
    """Refuse an Encoder configuration the chosen connector cannot serve. Not async.

    :raises ConfigError: naming the setting.
    """
    if settings.vllm_connector == "mooncake":
        if config.transfer == "zmq":
            raise ConfigError("vllm_connector='mooncake' needs transfer='mooncake'")
        if settings.vllm_dtype is not None:
            raise ConfigError(
                "vllm_dtype applies to the example connector; with mooncake the PD takes "
                "the Encoder's dtype (set dtype to the PD's)"
            )
    if config.zmq_curve_server_key is not None or config.zmq_curve_server_keys:
        # The loopback relay holds no secret key.
        raise ConfigError("the vllm wire cannot be combined with ZMQ CURVE keys")


class VllmService(anyio.AsyncContextManagerMixin):
    """vLLM's ``/v1/chat/completions`` encoder call over a running backend.

    ``async with VllmService(backend, config, settings) as vllm:`` learns the model family,
    and opens the connector's side: the store (swept for age in the background) or the
    control channel. The backend must stay open meanwhile; this service never closes it.

    :param peers: when given, the hosts a consumer or Mooncake session may be (403 otherwise).
    """

    def __init__(
        self,
        backend: Backend,
        config: EncoderConfig,
        settings: ServerSettings,
        *,
        peers: PeerAllowList | None = None,
    ) -> None:
        self._backend = backend
        self._config = config
        self._settings = settings
        self._peers = peers
        check_connector(config, settings)
        self._mooncake = settings.vllm_connector == "mooncake"
        self._dtype: torch.dtype | None = None
        if settings.vllm_dtype is not None:
            self._dtype = getattr(torch, canonical_dtype(settings.vllm_dtype))
        self.family: Family | None = None
        self.store: EmbeddingStore | None = None
        self._channel: ControlChannel | None = None

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[VllmService]:
        model_type = await run_thread_to_completion(model_type_of, self._config.model)
        self.family = family_of(self._config.model, model_type)
        settings = self._settings
        async with AsyncExitStack() as stack:
            if self._mooncake:
                timeout = settings.vllm_control_timeout_s
                self._channel = await stack.enter_async_context(ControlChannel(timeout))
            else:
                assert settings.vllm_storage_path is not None
                store = EmbeddingStore(
                    settings.vllm_storage_path,
                    max_bytes=settings.vllm_store_max_bytes,
                    max_age_s=settings.vllm_store_max_age_s,
                )
                await store.adopt()
                await store.sweep()
                self.store = store
                # Leaving the group cancels the sweeper; a failure of it is logged.
                group = await stack.enter_async_context(
                    ServiceTaskGroup("vllm store sweeper", logger=_log)
                )
                group.start_soon(self._sweep_forever, store, name="vllm store sweeper")
            try:
                yield self
            finally:
                self.store = None
                self._channel = None

    async def _sweep_forever(self, store: EmbeddingStore) -> None:
        period = min(_SWEEP_PERIOD_S, self._settings.vllm_store_max_age_s / 4)
        while True:
            await anyio.sleep(period)  # a period, not a wait for something
            await store.sweep()

    async def chat(self, body: object) -> dict[str, Any]:
        """Encode the body's media items and hand them to the PD; the proxy's answer.

        A checkpoint. Returns once every item is in place (its file renamed, or every shard
        completed). Cancelled, pushes cancel their reservations and parts are released
        (both shielded) before the cancellation goes on.

        :raises BadRequestError: the body or a modality is refused (400), naming why.
        :raises InternalError: a push failed (500; its reservations were cancelled).
        :raises EncdisaggError: the Encoder's own errors, with their status.
        """
        message = ChatBody.from_json(body)
        for item in message.items:
            check_family(self.family, item.modality, self._config.model)
        self._check_destination(message)
        groups: dict[str, list[MediaItem]] = {}
        for item in message.items:
            group = groups.setdefault(item.uuid, [])
            if group and group[0].modality is not item.modality:
                raise BadRequestError(
                    f"uuid {item.uuid!r} names a {group[0].modality.value} and a "
                    f"{item.modality.value} item"
                )
            group.append(item)
        token = secrets.token_hex(6)
        entries: dict[str, dict[str, Any]] = {}
        failures: list[EncdisaggError] = []

        async def one(number: int, items: list[MediaItem]) -> None:
            try:
                entries[items[0].uuid] = await self._item(f"vllm-{token}-{number}", message, items)
            except EncdisaggError as exc:
                failures.append(exc)
                # The answer is this error: the other items' work is given up (their pushes
                # cancel their reservations).
                tasks.cancel_scope.cancel()

        async with anyio.create_task_group() as tasks:
            for number, items in enumerate(groups.values()):
                tasks.start_soon(one, number, items)
        if failures:
            raise failures[0]
        return {
            "id": f"chatcmpl-{token}",
            "object": "chat.completion",
            "model": message.model,
            "choices": [],
            "ec_transfer_params": {uuid: entries[uuid] for uuid in groups},
        }

    def _check_destination(self, message: ChatBody) -> None:
        if self._mooncake and message.consumer_zmq is None:
            raise BadRequestError(
                "ec_transfer_params is missing: this encoder pushes to a Mooncake consumer "
                "(--vllm-connector mooncake) and needs its consumer_zmq and ec_items"
            )
        if not self._mooncake and message.consumer_zmq is not None:
            raise BadRequestError(
                "ec_transfer_params names a Mooncake consumer, but this encoder writes shared "
                "storage (--vllm-connector example)"
            )
        if self._peers is not None and message.consumer_zmq is not None:
            self._peers.check("ec_transfer_params.consumer_zmq", message.consumer_zmq)

    async def _item(self, req_id: str, message: ChatBody, items: list[MediaItem]) -> dict[str, Any]:
        first = items[0]
        request = EncodeBody(req_id, (first.source,), modality=first.modality.value)
        try:
            try:
                result = await self._backend.encode(request)
            except BadRequestError as exc:
                # The Encoder names the part's only item ``mm_items[0]``: name the proxy's.
                why = exc.message.removeprefix("mm_items[0]").lstrip(": ")
                raise BadRequestError(
                    f"media item {first.index} (uuid {first.uuid!r}): {why}"
                ) from None
            assert self.family is not None
            entry: dict[str, Any] = {
                "modality": first.modality.value,
                "item_indices": [item.index for item in items],
                "metadata": item_metadata(self.family, first.modality, result),
            }
            if message.transfer_ids is None:
                await self._store(req_id, first.uuid)
            else:
                transfer_id = message.transfer_ids[first.index]
                await self._push(req_id, message, first, transfer_id, result)
                entry["transfer_id"] = transfer_id
            return entry
        finally:
            with anyio.CancelScope(shield=True):
                await release_within(self._backend, req_id, self._config.cleanup_timeout_s, _log)

    async def _store(self, req_id: str, uuid: str) -> None:
        store = self.store
        if store is None:
            raise TransferError("the vLLM wire is not running", req_id=req_id)
        part = await relay_staged(
            self._backend,
            req_id,
            bind=_RELAY_BIND,
            timeout_s=self._config.zmq_send_timeout_s,
        )
        tensor = part.tensor
        assert tensor is not None
        if self._dtype is not None:
            tensor = tensor.to(self._dtype)
        await store.put(uuid, tensor)

    async def _push(
        self,
        req_id: str,
        message: ChatBody,
        item: MediaItem,
        transfer_id: str,
        result: EncodeResult,
    ) -> None:
        channel = self._channel
        if channel is None:
            raise TransferError("the vLLM wire is not running", req_id=req_id)
        assert message.consumer_zmq is not None
        spec = PushSpec(
            consumer_zmq=message.consumer_zmq,
            transfer_id=transfer_id,
            mm_hash=item.uuid,
            nbytes=result.nbytes,
            shape=(result.num_tokens, result.hidden_size),
            dtype=canonical_dtype(result.dtype),
        )

        async def write(shard: Shard, count: int) -> None:
            if self._peers is not None:
                self._peers.check("dst_session", shard.dst_session, req_id=req_id)
            destination = MooncakeDestination(shard.dst_session, shard.dst_ptr, shard.address)
            await self._backend.send(SendBody(req_id, destination, count))

        try:
            await push_item(
                channel,
                spec,
                write,
                clock=anyio.current_time,
                refresh_after_s=self._settings.vllm_refresh_after_s,
            )
        except TransferError as exc:
            # vLLM's proxy passes the status on: 500 says "not there", as its producer does.
            raise InternalError(exc.message, req_id=req_id) from None
