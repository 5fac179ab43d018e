"""Wire an E->P->D pipeline by hand: one encoder server, a prefill and a decode worker.

What ``encdisagg demo`` does, for one request, without the bookkeeping: an encoder server over
HTTP, embeddings over ZMQ, KV over two Loopback engines, and the tokens compared with the same
model run colocated. Runs on asyncio by default; pass ``--backend trio`` for Trio.

    python examples/pipeline_demo.py [--backend trio]
"""

from __future__ import annotations

import argparse
from typing import Literal

import anyio
import sniffio

from encdisagg import Encoder, EncoderConfig
from encdisagg.pipeline import (
    DecodeWorker,
    LanguageModel,
    PipelineRequest,
    PrefillWorker,
    demo_images,
    serve_asgi,
)
from encdisagg.receiver import EmbeddingReceiver, EncoderClient
from encdisagg.server import create_app
from encdisagg.transfer import LoopbackEngine, LoopbackFabric


async def main() -> None:
    flavour: Literal["asyncio", "trio"] = (
        "trio" if sniffio.current_async_library() == "trio" else "asyncio"
    )
    images = demo_images(2, seed=1)
    request = PipelineRequest(
        rid="hello",
        room=1,
        prompt="What is in these pictures?",
        images=tuple(image.data_url for image in images),
        max_new_tokens=8,
    )
    # Each side gets its own model instance; "tiny"'s tower comes from the same seeded model.
    lm_prefill, lm_decode, lm_reference = (LanguageModel.tiny() for _ in range(3))
    fabric = LoopbackFabric()
    encoder = Encoder(EncoderConfig(model="tiny", transfer="zmq"))
    async with (
        serve_asgi(create_app(encoder, flavour=flavour)) as url,
        LoopbackEngine(fabric, name="prefill") as prefill_engine,
        LoopbackEngine(fabric, name="decode") as decode_engine,
        EncoderClient([url]) as client,
        EmbeddingReceiver(
            transport="zmq", hidden_size=lm_prefill.hidden_size, dtype=lm_prefill.dtype
        ) as receiver,
    ):
        decode = DecodeWorker(lm_decode, engine=decode_engine)
        prefill = PrefillWorker(
            lm_prefill,
            client=client,
            receiver=receiver,
            engine=prefill_engine,
            page_bytes=decode.page_bytes,
        )
        prefill.connect(decode.deliver)
        decode.connect(prefill.deliver)
        async with decode, prefill:
            handle = decode.admit(request.rid, request.room, max_new_tokens=8)
            report = await prefill.prefill(request)
            result = await handle.wait()
    expected = lm_reference.generate_colocated(
        request.prompt, [image.image for image in images], max_new_tokens=8
    )
    print(f"prefill: {report.status.value}, {report.seq_len} prompt tokens {report.image_tokens}")
    print(f"decode:  {result.status.value}, tokens {list(result.tokens)}")
    print(f"colocated tokens {expected}: {'same' if list(result.tokens) == expected else 'DIFFER'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    anyio.run(main, backend=parser.parse_args().backend)
