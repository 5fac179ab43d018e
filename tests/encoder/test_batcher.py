"""The Batcher driven directly: what becomes of the jobs it holds when it stops."""

from __future__ import annotations

import anyio
import pytest

from encdisagg import Modality, ServiceUnavailableError
from encdisagg.encoder._compute._batcher import Batcher, ForwardJob

from .fakes import ScriptedModel

pytestmark = pytest.mark.anyio


def forward_job(model: ScriptedModel, req_id: str, finished: list[str]) -> ForwardJob:
    """A one-item job of ``req_id`` that notes its ``on_finish`` in ``finished``."""
    return ForwardJob(
        req_id,
        Modality.IMAGE,
        model.preprocess([4], Modality.IMAGE),
        on_finish=lambda: finished.append(req_id),
    )


async def test_stopping_fails_every_queued_job_and_runs_its_on_finish() -> None:
    model = ScriptedModel()
    gate, started = model.block_forward()
    batcher = Batcher(model, max_batch_size=1, max_queued_jobs=8)
    finished: list[str] = []
    running = forward_job(model, "running", finished)
    queued = [forward_job(model, f"queued-{index}", finished) for index in range(3)]
    async with anyio.create_task_group() as group:
        try:
            await group.start(batcher.run)
            await batcher.submit(running)
            await started.wait()  # the batcher is in running's forward
            for job in queued:
                await batcher.submit(job)
            group.cancel_scope.cancel()
        finally:
            # The forward's thread is waited for, never abandoned: let it end.
            gate.set()
    for job in (running, *queued):
        assert job.done.is_set(), job.req_id
        assert isinstance(job.error, ServiceUnavailableError), (job.req_id, job.error)
        assert job.output is None
    assert sorted(finished) == sorted(job.req_id for job in (running, *queued))
    assert model.forward_batches == [1]
    # Stopped for good: a new job is refused, not queued for nobody.
    with pytest.raises(ServiceUnavailableError, match="shutting down"):
        await batcher.submit(forward_job(model, "late", finished))
