"""The Encoder's shutdown: every request released, every job waited for.

Whatever owns an engine, an arena or a registration must outlive every job that uses it,
so closing waits for the last job: the ones still running after ``shutdown_grace_s`` are
cancelled, and each leaves once its transfer stopped touching memory or its engine gave up
on it (its memory is then held). The Encoder closes the region owner and the engine only
after this returns.
"""

from __future__ import annotations

import logging

import anyio

from ._lifecycle import RequestLifecycle

__all__ = ["drain"]

_log = logging.getLogger("encdisagg.encoder")


async def drain(lifecycle: RequestLifecycle) -> None:
    """Release every live request; after ``shutdown_grace_s`` cancel what still runs, and
    wait until every job left. Shielded: cancelling the caller changes nothing.

    Every wait here ends (each job's transfer is bounded by its engine); each
    ``cleanup_timeout_s`` of waiting is logged with what is still running.
    """
    config, table = lifecycle.config, lifecycle.table
    all_freed = lifecycle.all_freed = anyio.Event()
    for record in list(table.live.values()):
        lifecycle.request_release(record)
    with anyio.CancelScope(shield=True):
        if table.live:
            with anyio.move_on_after(config.shutdown_grace_s):
                await all_freed.wait()
        for record in list(table.live.values()):
            record.cancel_jobs()
        while table.live:
            with anyio.move_on_after(config.cleanup_timeout_s):
                await all_freed.wait()
            for record in table.live.values():
                _log.error(
                    "closing: req_id %r still has %d job(s) running (a transfer the engine "
                    "has not given up on yet); waiting for it",
                    record.req_id,
                    record.jobs,
                )
