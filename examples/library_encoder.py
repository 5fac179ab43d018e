"""Use the Encoder as a library: encode two images and deliver them twice.

Once over ZMQ (a PULL receiver in this process) and once over the Mooncake transfer engine
over TCP (a second Mooncake engine in this process plays the prefill side and registers the
landing buffer). Runs on asyncio by default; pass ``--backend trio`` for Trio.

    python examples/library_encoder.py [--backend trio]
"""

from __future__ import annotations

import argparse
import io
import time

import anyio
import torch
from PIL import Image, ImageDraw

from encdisagg import (
    Encoder,
    EncoderConfig,
    EncodeRequest,
    MooncakeDestination,
    ZmqDestination,
)
from encdisagg.transfer import MooncakeEngine, ZmqReceiver


def make_image(width: int, height: int, hue: int) -> bytes:
    image = Image.new("RGB", (width, height), (hue, 120, 255 - hue))
    draw = ImageDraw.Draw(image)
    for x in range(0, width, 64):
        draw.line([(x, 0), (width - x, height)], fill=(255, 255, 255), width=3)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


async def main() -> None:
    images = [make_image(448, 448, 30), make_image(1280, 720, 200)]
    config = EncoderConfig(model="tiny", transfer="mooncake", max_batch_size=8)

    async with Encoder(config) as encoder:
        # Over ZMQ: pull mode, the receiver asks for the staged embedding.
        async with ZmqReceiver() as receiver:
            started = time.perf_counter()
            result = await encoder.encode(EncodeRequest("zmq-demo", images))
            encoded = time.perf_counter()
            await encoder.send("zmq-demo", ZmqDestination(receiver.url))
            part = await receiver.receive()
            done = time.perf_counter()
            assert part.tensor is not None
            print(
                f"zmq:      tokens per image {result.token_counts}, grids {result.grid}, "
                f"received {tuple(part.tensor.shape)} {part.header.dtype}; "
                f"encode {1e3 * (encoded - started):.1f} ms, "
                f"deliver {1e3 * (done - encoded):.1f} ms"
            )

        # Over Mooncake TCP: the receiver registers a landing buffer and hands out its
        # session and address; the encoder writes straight into it.
        async with MooncakeEngine() as prefill_engine:
            started = time.perf_counter()
            result = await encoder.encode(EncodeRequest("mooncake-demo", images))
            encoded = time.perf_counter()
            landing = torch.zeros(result.nbytes, dtype=torch.uint8)
            prefill_engine.register(landing.data_ptr(), result.nbytes)
            try:
                destination = MooncakeDestination(
                    session_id=prefill_engine.session_id,
                    buffer_address=landing.data_ptr(),
                    endpoint="prefill-0:1",
                )
                await encoder.send("mooncake-demo", destination)
            finally:
                prefill_engine.deregister(landing.data_ptr())
            done = time.perf_counter()
            embedding = landing.view(getattr(torch, result.dtype)).reshape(
                result.num_tokens, result.hidden_size
            )
            print(
                f"mooncake: received {tuple(embedding.shape)} {result.dtype} "
                f"({result.nbytes} bytes); encode {1e3 * (encoded - started):.1f} ms, "
                f"deliver {1e3 * (done - encoded):.1f} ms"
            )
        print(f"idle afterwards: {encoder.stats()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    anyio.run(main, backend=parser.parse_args().backend)
