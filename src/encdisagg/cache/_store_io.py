"""The global tier's store I/O: the calls made in worker threads, and the bounded wait.

:func:`lookup_entries` and :func:`put_entry` run in a worker thread and talk to the store.
:func:`ask_bounded` runs such a call in a task of the cache's group and waits for its answer
at most the lookup timeout; a late call is never abandoned, it finishes on its own inside the
group and its answer is dropped. Deciding what the answers mean is the cache's business.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import anyio

from ..nurseries import run_thread_to_completion
from ..transfer import payload_view
from ._entry import CachedItem, InvalidEntryError, entry_header, read_entry

if TYPE_CHECKING:
    import torch

    from ..nurseries import ServiceTaskGroup
    from ._store import EmbeddingStore

__all__ = ["LookupReport", "NoAnswer", "ask_bounded", "lookup_entries", "put_entry"]

logger = logging.getLogger("encdisagg.cache")

T = TypeVar("T")


class NoAnswer(Exception):
    """A store call failed, or did not answer in time."""


@dataclass(eq=False)
class _Answer(Generic[T]):
    """The result box of one store call; written by its task, read by the waiting request."""

    done: anyio.Event = field(default_factory=anyio.Event)
    #: ``(value,)`` once the call returned.
    value: tuple[T] | None = None
    error: Exception | None = None
    #: False once the request stopped waiting (timed out): the answer is then dropped.
    waited_for: bool = True


@dataclass(eq=False)
class LookupReport:
    """What one lookup found, per key (built in the worker thread)."""

    found: dict[str, CachedItem] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    invalid: dict[str, str] = field(default_factory=dict)
    fetch_error: Exception | None = None


def lookup_entries(
    store: EmbeddingStore, keys: list[str], *, hidden_size: int, dtype: torch.dtype
) -> LookupReport:
    """Existence first, then one batched read of the hits. Blocking: a worker thread.

    :raises Exception: whatever the existence check raised (a fetch error is reported).
    """
    report = LookupReport()
    present = store.exists(keys)
    hits = [key for key, there in zip(keys, present, strict=True) if there]
    report.absent = [key for key, there in zip(keys, present, strict=True) if not there]
    if not hits:
        return report
    try:
        values = store.fetch(hits)
    except Exception as exc:
        report.fetch_error = exc
        report.failed = hits
        return report
    for key, raw in zip(hits, values, strict=True):
        if raw is None:
            report.failed.append(key)
            continue
        try:
            report.found[key] = read_entry(raw, hidden=hidden_size, dtype=dtype)
        except InvalidEntryError as exc:
            report.invalid[key] = str(exc)
    return report


def put_entry(
    store: EmbeddingStore, key: str, item: CachedItem, *, hidden_size: int, dtype: torch.dtype
) -> None:
    """Store ``item`` under ``key``. Blocking: a worker thread."""
    # The payload view references `rows`, which keeps the memory alive for as long as the
    # store reads it.
    rows = item.rows.detach().to("cpu").contiguous()
    header = entry_header(item.tokens, hidden_size, dtype, item.grid)
    store.put(key, header, payload_view(rows))


async def ask_bounded(
    group: ServiceTaskGroup | None,
    func: Callable[..., T],
    *args: object,
    limiter: anyio.CapacityLimiter,
    timeout_ms: int,
) -> T:
    """Run ``func(*args)`` in a worker thread as a task of ``group``; wait for its answer
    at most ``timeout_ms``. The call itself is never abandoned.

    :raises NoAnswer: if it raised, did not answer in time, or ``group`` is ``None`` (the
        cache is closing).
    """
    if group is None:
        raise NoAnswer("the cache is closing")
    answer: _Answer[T] = _Answer()
    group.start_soon(_answer, answer, func, args, limiter, name="global cache lookup")
    with anyio.move_on_after(timeout_ms / 1000):
        await answer.done.wait()
    if not answer.done.is_set():
        answer.waited_for = False
        raise NoAnswer(f"no answer within {timeout_ms} ms")
    if answer.value is None:
        error = answer.error
        raise NoAnswer((str(error) or repr(error)) if error else "no answer") from error
    return answer.value[0]


async def _answer(
    answer: _Answer[T],
    func: Callable[..., T],
    args: tuple[object, ...],
    limiter: anyio.CapacityLimiter,
) -> None:
    try:
        answer.value = (await run_thread_to_completion(func, *args, limiter=limiter),)
    except Exception as exc:
        answer.error = exc
        if not answer.waited_for:
            logger.info("a late global cache lookup failed too: %s", exc)
    finally:
        answer.done.set()
