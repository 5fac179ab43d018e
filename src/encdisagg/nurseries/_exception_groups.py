"""Turning a task group's exception group back into the one error that was raised.

A task group wraps whatever crosses it in an exception group, also a single error raised in
the ``async with`` body of a context manager that yields inside one. At an API boundary a
group holding exactly one error is unwrapped, so callers catch what was raised. Only an
:class:`Exception` is unwrapped: a cancellation (or another ``BaseException``) stays inside
its group, where the cancel scopes that own it still recognise it.

The leaf is re-raised as itself: its ``__cause__``, ``__context__`` and traceback are the ones
it was raised with (``raise leaf from None`` would drop the cause), and the group it came out
of is not attached to it as ``__context__``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from types import TracebackType
from typing import Literal, final

__all__ = ["collapse_single_error", "leaf_exceptions", "sole_error"]


def leaf_exceptions(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``, nested groups flattened, in depth-first order.

    Not a group: ``[exc]``.
    """
    leaves: list[BaseException] = []
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if isinstance(current, BaseExceptionGroup):
            # Reversed onto the stack, so they come off in their own order.
            pending.extend(reversed(current.exceptions))
        else:
            leaves.append(current)
    return leaves


def sole_error(exc: BaseException) -> BaseException:
    """The error to raise for ``exc``: its only leaf, if that leaf is an :class:`Exception`.

    A group (nested groups flattened) holding exactly one leaf that is an ``Exception`` gives
    that leaf; anything else (not a group, several leaves, a lone cancellation) gives ``exc``.

    Raise the result *outside* the ``except`` block that caught ``exc``; raised inside it,
    the group would become the leaf's ``__context__``::

        failure = None
        try:
            ...
        except BaseExceptionGroup as group:
            failure = sole_error(group)
            if failure is group:
                raise
        if failure is not None:
            raise failure
    """
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = leaf_exceptions(exc)
    if len(leaves) == 1 and isinstance(leaves[0], Exception):
        return leaves[0]
    return exc


@final
class _CollapseSingleError:
    """The context manager behind :func:`collapse_single_error` (stateless, so shared)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        if exc is None:
            return False
        failure = sole_error(exc)
        _forget_own_wrapper(failure)
        if failure is exc:
            return False
        # ``__exit__`` runs while the group is being handled, so raising here makes the group
        # the leaf's ``__context__``; put back the context the leaf had (trio's nursery does
        # the same). The locals go too: the traceback holds this frame, and the frame holding
        # the leaf and its group would be a reference cycle.
        saved_context = failure.__context__
        try:
            raise failure
        finally:
            failure.__context__ = saved_context
            del failure, saved_context, exc, traceback


def _forget_own_wrapper(error: BaseException) -> None:
    """Drop ``error.__context__`` if it is a group wrapping ``error`` itself.

    Such a context says nothing about where the error came from: on asyncio, a task group
    whose child task was still running when an error crossed it can leave the error with the
    group it was wrapped in (further out) as its context. Its ``__cause__`` is untouched.
    """
    context = error.__context__
    if isinstance(context, BaseExceptionGroup) and any(
        leaf is error for leaf in leaf_exceptions(context)
    ):
        error.__context__ = None


_COLLAPSE_SINGLE_ERROR = _CollapseSingleError()


def collapse_single_error() -> AbstractContextManager[None]:
    """A context manager that lets an exception group of one error leave as that error.

    ``with collapse_single_error(): ...`` re-raises :func:`sole_error` of whatever leaves the
    block: the lone :class:`Exception` inside a group, with its own ``__cause__``,
    ``__context__`` and traceback; groups of several errors, groups holding a cancellation,
    and exceptions that are not groups pass unchanged. Not a checkpoint (it is synchronous).
    """
    return _COLLAPSE_SINGLE_ERROR
