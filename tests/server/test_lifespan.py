"""An app served by the other event loop than its class runs on is refused at start."""

from __future__ import annotations

import logging

import pytest
from hypercorn.config import Config
from hypercorn.utils import LifespanFailureError

from encdisagg.server import create_app

from ._helpers import fast_config

pytestmark = pytest.mark.anyio


async def test_an_app_for_the_other_event_loop_fails_to_start_in_one_line(
    anyio_backend_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    other = "asyncio" if anyio_backend_name == "trio" else "trio"
    app = create_app(fast_config(model="null"), flavour=other)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    if anyio_backend_name == "trio":
        from hypercorn.trio import serve
    else:
        from hypercorn.asyncio import serve  # type: ignore[assignment]
    with (
        caplog.at_level(logging.ERROR, logger="encdisagg.server"),
        pytest.raises((LifespanFailureError, BaseExceptionGroup)) as caught,
    ):
        await serve(app, config)  # type: ignore[arg-type]
    failure = caught.value
    while isinstance(failure, BaseExceptionGroup):  # Trio's nursery wraps it
        (failure,) = failure.exceptions
    assert isinstance(failure, LifespanFailureError)
    built = "QuartTrio" if other == "trio" else "Quart"
    article = "an" if anyio_backend_name == "asyncio" else "a"
    said = f"a {built} app cannot be served by {article} {anyio_backend_name} worker"
    assert said in str(failure)
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith(said)
    assert "\n" not in line
    assert app.extensions["encdisagg"].draining is False, "the service never opened"
