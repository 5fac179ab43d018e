"""The building blocks of the ownership tree.

Free of torch, ZMQ and HTTP; each block is tested on its own, on asyncio and on Trio.

- :func:`run_thread_to_completion`: a worker-thread call that is never abandoned.
- :class:`KeyedRendezvous`: bounded waits for a key to be published, built on
  :class:`KeyedWakeups` (tasks parked per key until synchronous code wakes it).
- :class:`ServiceTaskGroup`: background tasks whose failures are always observed.
- :func:`loop_clock` / :func:`loop_checkpoint`: the running loop's clock (to inject) and
  checkpoint, each looked up once.
- :class:`ThreadSafeEvent`: an event any thread sets without blocking, awaited on the loop.
- :func:`sole_error` / :func:`collapse_single_error`: an exception group holding one error
  leaves as that error, cause and traceback intact (:func:`leaf_exceptions` flattens groups).
"""

from .._exports import claim_exports
from ._clock import loop_checkpoint as loop_checkpoint, loop_clock as loop_clock
from ._exception_groups import (
    collapse_single_error as collapse_single_error,
    leaf_exceptions as leaf_exceptions,
    sole_error as sole_error,
)
from ._rendezvous import KeyedRendezvous as KeyedRendezvous, KeyRemovedError as KeyRemovedError
from ._services import FailurePolicy as FailurePolicy, ServiceTaskGroup as ServiceTaskGroup
from ._thread_event import ThreadSafeEvent as ThreadSafeEvent
from ._threads import run_thread_to_completion as run_thread_to_completion
from ._wakeups import KeyedWakeups as KeyedWakeups

__all__ = (
    "run_thread_to_completion",
    "ThreadSafeEvent",
    "loop_clock",
    "loop_checkpoint",
    "KeyedRendezvous",
    "KeyRemovedError",
    "KeyedWakeups",
    "ServiceTaskGroup",
    "FailurePolicy",
    "sole_error",
    "collapse_single_error",
    "leaf_exceptions",
)

claim_exports(globals())
