"""Opening the parts an Encoder runs on: its model, its transfer engine, its global tier."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

from .._config import EncoderConfig
from ..cache import (
    GlobalCache,
    GlobalCacheSettings,
    KeySpace,
    ensure_mooncake_store,
    parse_global_cache_url,
)
from ..models import VisionModel, load_model
from ..nurseries import run_thread_to_completion
from ..transfer import TransferEngine
from ._events import EncoderEvents

__all__ = ["global_cache_settings", "load_configured_model", "open_engine", "open_global_cache"]

# Startup progress: a large model takes a while, and the server logs each step.
_log = logging.getLogger("encdisagg.encoder")


async def global_cache_settings(config: EncoderConfig) -> GlobalCacheSettings | None:
    """The parsed ``global_cache`` URL (None when unset), after checking that the Mooncake
    Store client imports. A checkpoint when set.

    :raises BadRequestError: the URL is malformed.
    """
    if config.global_cache is None:
        return None
    settings = parse_global_cache_url(config.global_cache, default_host=config.mooncake_host)
    await run_thread_to_completion(ensure_mooncake_store)
    return settings


async def load_configured_model(config: EncoderConfig) -> VisionModel:
    """Load ``config.model`` in a worker thread (never abandoned). A checkpoint."""

    def load() -> VisionModel:
        return load_model(
            config.model,
            dtype=config.dtype,
            device=config.device,
            max_media_bytes=config.max_media_bytes,
            remote_media_domains=config.remote_media_domains,
            allow_local_files=config.allow_local_files,
            preprocess=config.preprocess,
        )

    _log.info("loading model %s on %s", config.model, config.device)
    model = await run_thread_to_completion(load)
    _log.info("model %s loaded", config.model)
    return model


async def open_engine(config: EncoderConfig, stack: AsyncExitStack) -> TransferEngine | None:
    """The engine ``config.transfer`` names, closed by ``stack`` (None for ZMQ only)."""
    if config.transfer == "mooncake":
        from ..transfer import MooncakeEngine

        _log.info("opening the Mooncake transfer engine (%s)", config.mooncake_protocol)
        engine: TransferEngine = await stack.enter_async_context(
            MooncakeEngine(
                hostname=config.mooncake_host,
                metadata_server=config.mooncake_metadata,
                protocol=config.mooncake_protocol,
                device_name=config.mooncake_device,
                poll_on_loop_s=config.mooncake_poll_on_loop_s,
            )
        )
        return engine
    if config.transfer == "loopback":
        from ..transfer import LoopbackEngine

        return LoopbackEngine()
    return None


async def open_global_cache(
    config: EncoderConfig,
    settings: GlobalCacheSettings,
    model: VisionModel,
    events: EncoderEvents,
    stack: AsyncExitStack,
) -> tuple[GlobalCache, KeySpace]:
    """The global embedding tier and its key space, closed by ``stack``."""
    cache = await stack.enter_async_context(
        GlobalCache(
            settings,
            hidden_size=model.hidden_size,
            dtype=model.dtype,
            on_event=events.on_global_cache,
            on_breaker=events.on_breaker,
            close_timeout_s=config.cleanup_timeout_s,
        )
    )
    return cache, KeySpace.for_model(model)
