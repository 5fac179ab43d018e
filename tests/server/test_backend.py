from __future__ import annotations

import pytest

from encdisagg import Encoder
from encdisagg.models import NullVisionModel
from encdisagg.server import LocalBackend

from ._helpers import fast_config

pytestmark = pytest.mark.anyio


def _raise_with_cause() -> None:
    try:
        raise KeyError("the cause")
    except KeyError as exc:
        raise ValueError("raised in the block") from exc


async def _fail_inside(backend: LocalBackend) -> None:
    async with backend:
        _raise_with_cause()


async def test_a_lone_error_in_the_block_leaves_as_itself_with_its_cause() -> None:
    # The Encoder is open already, so the backend's own task group is the only one the
    # error crosses before it leaves the backend.
    async with Encoder(fast_config(model="null"), model=NullVisionModel()) as encoder:
        with pytest.raises(ValueError, match="raised in the block") as caught:
            await _fail_inside(LocalBackend(encoder))
    assert isinstance(caught.value.__cause__, KeyError)
    assert not isinstance(caught.value.__context__, BaseExceptionGroup)


async def test_a_lone_error_in_the_block_of_a_backend_built_from_a_config() -> None:
    # Here the error also crosses the Encoder the backend opens (and its task group).
    with pytest.raises(ValueError, match="raised in the block") as caught:
        await _fail_inside(LocalBackend(fast_config(model="null")))
    assert isinstance(caught.value.__cause__, KeyError)
    assert not isinstance(caught.value.__context__, BaseExceptionGroup)
