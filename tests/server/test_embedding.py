"""Mounting the encoder routes on an application's own Quart app, and the lifespan order."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from quart import Quart
from quart.testing.app import LifespanError

from encdisagg import Encoder, EncoderConfig
from encdisagg.server import EncoderMetrics, LocalBackend, ServerSettings, mount_encoder

from ._helpers import fast_config, png_data_url, running

pytestmark = pytest.mark.anyio


def own_app(flavour: str) -> Quart:
    if flavour == "trio":
        from quart_trio import QuartTrio

        return QuartTrio("users-app")
    return Quart("users-app")


async def test_mount_under_a_prefix_beside_own_routes(flavour: str) -> None:
    app = own_app(flavour)
    events: list[str] = []

    @app.get("/hello")
    async def hello() -> str:
        return "hi"

    service = mount_encoder(app, fast_config(), url_prefix="/vision")

    @app.before_serving
    async def startup() -> None:
        # The user's startup runs with the encoder up already...
        events.append(f"startup:{service.backend is not None}")

    @app.after_serving
    async def shutdown() -> None:
        # ...and their shutdown before it goes down.
        events.append(f"shutdown:{service.backend is not None}")

    assert app.extensions["encdisagg"] is service
    async with running(app) as client:
        assert (await client.get("/hello")).status_code == 200
        response = await client.post(
            "/vision/encode", json={"req_id": "u1", "mm_items": [png_data_url()]}
        )
        assert response.status_code == 200
        assert (await response.get_json())["embedding_len"] == 64
        assert (await client.post("/vision/release", json={"req_id": "u1"})).status_code == 200
        assert (await client.get("/vision/health")).status_code == 200
        assert (await client.get("/encode")).status_code == 404
        backend = service.backend
        assert isinstance(backend, LocalBackend)
    assert events == ["startup:True", "shutdown:True"]
    assert service.backend is None
    assert not backend.encoder.is_open


async def test_the_service_reads_no_local_files(flavour: str) -> None:
    app = own_app(flavour)
    service = mount_encoder(app, EncoderConfig(model="tiny", allow_local_files=True))
    assert service.config.allow_local_files is False


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_startup_failure_is_reported_to_the_test_client(flavour: str) -> None:
    # Asyncio only: QuartTrio's test app drives its nursery by hand and corrupts Trio's
    # nursery stack when startup fails. test_runner covers both flavours on real Hypercorn.
    app = own_app(flavour)
    # A folder that is not there: the config takes a path; loading it fails at startup.
    mount_encoder(app, EncoderConfig(model="./no-such-model"))
    with pytest.raises(LifespanError, match="no-such-model"):
        async with running(app):
            pass


async def test_mounting_twice_is_refused(flavour: str) -> None:
    app = own_app(flavour)
    mount_encoder(app, fast_config())
    with pytest.raises(RuntimeError, match="mounted already"):
        mount_encoder(app, fast_config())


async def test_dp_needs_a_config() -> None:
    with pytest.raises(Exception, match="dp"):
        mount_encoder(Quart("x"), Encoder(fast_config()), settings=ServerSettings(dp=2))


async def test_given_encoder_with_the_services_metrics(flavour: str) -> None:
    metrics = EncoderMetrics()
    encoder = Encoder(fast_config(), events=metrics.events())
    app = own_app(flavour)
    mount_encoder(app, encoder, encoder_metrics=metrics)
    async with running(app) as client:
        await client.post("/encode", json={"req_id": "m", "mm_items": [png_data_url()]})
        text = (await (await client.get("/metrics")).get_data()).decode()
    assert 'encdisagg_requests_total{modality="image",status="ok"} 1.0' in text
    assert not encoder.is_open, "the lifespan opened it, so the lifespan closed it"


async def test_settings_are_validated() -> None:
    for bad in (
        {"dp": 0},
        {"dp": True},
        {"max_body_bytes": 0},
        {"health_timeout_s": 0},
        {"worker_backend": "curio"},
        {"worker_log_level": "loud"},
    ):
        with pytest.raises(Exception, match=next(iter(bad))):
            ServerSettings(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [lambda: None])
async def test_app_factory_flavours(
    make_app: Callable[..., Quart], flavour: str, make: object
) -> None:
    app = make_app()
    assert type(app).__name__ == ("QuartTrio" if flavour == "trio" else "Quart")
