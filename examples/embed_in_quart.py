"""Embed the encoder routes in your own Quart app, served by Hypercorn.

``mount_encoder`` adds the encoder's routes under a prefix and wraps the app's lifespan, so
the Encoder opens before your ``before_serving`` hooks run and closes after your
``after_serving`` hooks ran. Nothing else changes: serve the app however you serve it.

Run it::

    python examples/embed_in_quart.py                 # serves on 127.0.0.1:8080; Ctrl-C stops
    python examples/embed_in_quart.py --once          # serves on a free port, checks, exits
    hypercorn examples.embed_in_quart:app             # the module-level app works as well

then, for example::

    curl -s localhost:8080/
    curl -s localhost:8080/encoder/health
"""

from __future__ import annotations

import argparse
import base64
import io
import signal
import sys

import anyio
import anyio.abc
import httpx
from PIL import Image
from quart import Quart

from encdisagg import EncoderConfig
from encdisagg.server import EncoderService, mount_encoder, serve


def build_app() -> Quart:
    """Your application, with the encoder mounted under ``/encoder``."""
    app = Quart("my-app")

    @app.get("/")
    async def index() -> dict[str, str]:
        return {"service": "my-app", "encoder": "/encoder"}

    encoder: EncoderService = mount_encoder(app, EncoderConfig(model="tiny"), url_prefix="/encoder")

    @app.get("/stats")
    async def stats() -> dict[str, object]:
        # Your own routes may look at the encoder service too.
        return {"encoder_running": encoder.backend is not None}

    return app


#: ``hypercorn examples.embed_in_quart:app`` serves this.
app = build_app()


def sample_image() -> str:
    """A 224x224 PNG as a data URL."""
    image = Image.new("RGB", (224, 224), (40, 120, 200))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def self_check(url: str) -> None:
    """Call the app's own route and the mounted encoder routes once."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        print("GET /", (await client.get("/")).json())
        print("GET /encoder/health", (await client.get("/encoder/health")).json())
        encoded = await client.post(
            "/encoder/encode", json={"req_id": "example-1", "mm_items": [sample_image()]}
        )
        encoded.raise_for_status()
        print("POST /encoder/encode", encoded.json())
        released = await client.post("/encoder/release", json={"req_id": "example-1"})
        released.raise_for_status()
        print("POST /encoder/release", released.json())


async def stop_on_signal(
    stop: anyio.Event, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            stop.set()


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--once", action="store_true", help="check the routes, then exit")
    args = parser.parse_args(argv)
    port = args.port if args.port is not None else (0 if args.once else 8080)

    stop = anyio.Event()
    serving = anyio.Event()
    urls: list[str] = []

    def on_serving(url: str) -> None:
        print(f"serving on {url}", flush=True)
        urls.append(url)
        serving.set()

    async with anyio.create_task_group() as group:
        if not args.once:
            await group.start(stop_on_signal, stop)

        async def run_server() -> None:
            await serve(
                app, host=args.host, port=port, shutdown_trigger=stop.wait, on_serving=on_serving
            )
            group.cancel_scope.cancel()

        group.start_soon(run_server)
        if args.once:
            await serving.wait()
            try:
                await self_check(urls[0])
            finally:
                stop.set()
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main))
