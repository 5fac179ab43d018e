"""Step ``transfer``: embeddings made on the device leave it through encdisagg's own path,
byte for byte.

One :class:`~encdisagg.Encoder` (Mooncake TCP, its own engine) whose model makes rows of
known values on the device, so the staging arena lives there too. Each case encodes one
request, sends it, and compares what landed with the rows made on the host:

- Mooncake TCP into a registered host buffer of a second engine in this process (a receiver
  on the same host), from the arena, and from a request's own registration (bigger than the
  arena);
- ZMQ to a :class:`~encdisagg.transfer.ZmqReceiver` (the device-to-host copy before the
  push), from the arena and from an own registration.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

from _gpu_common import Row, device_name, row

#: Qwen2.5-VL-7B's embedding width (the tower's out_hidden_size), in bfloat16.
HIDDEN: Final = 3584
#: A 1280x720 image's tokens.
IMAGE_TOKENS: Final = 1196
ARENA_MB: Final = 16
#: (label, transport, tokens): one image fits the arena; three do not.
CASES: Final = (
    ("mooncake from the arena", "mooncake", IMAGE_TOKENS),
    ("mooncake from an own registration", "mooncake", 3 * IMAGE_TOKENS),
    ("zmq from the arena", "zmq", IMAGE_TOKENS),
    ("zmq from an own registration", "zmq", 3 * IMAGE_TOKENS),
)


def pattern(tokens: int, seed: int) -> Any:
    """``[tokens, HIDDEN]`` bfloat16 rows of small integers (exact in bfloat16), on the host."""
    import torch

    values = (torch.arange(tokens * HIDDEN, dtype=torch.int64) * 7919 + seed * 104729) % 255
    return (values - 127).to(torch.bfloat16).reshape(tokens, HIDDEN)


class PatternModel:
    """A vision model whose embeddings are :func:`pattern` rows copied onto ``device``: what
    lands anywhere can be compared with the host's rows exactly. An item is a token count."""

    def __init__(self, device: str) -> None:
        import torch

        self.device = torch.device(device)
        self.name = "pattern"

    @property
    def hidden_size(self) -> int:
        return HIDDEN

    @property
    def dtype(self) -> Any:
        import torch

        return torch.bfloat16

    def preprocess(self, items: Sequence[object], modality: Any) -> Any:
        from encdisagg.models import Preprocessed

        counts = tuple(int(item) for item in items)  # type: ignore[call-overload]
        return Preprocessed(
            token_counts=counts,
            grid=tuple((1, 2, 2 * count) for count in counts),
            features={"seed": counts[0]},
        )

    def forward(self, batch: Sequence[Any]) -> list[Any]:
        return [
            pattern(pre.num_tokens, pre.features["seed"]).to(self.device, non_blocking=True)
            for pre in batch
        ]


async def _cases(device: str) -> list[dict[str, Any]]:
    import anyio
    import torch

    from encdisagg import (
        Encoder,
        EncoderConfig,
        EncodeRequest,
        MooncakeDestination,
        ZmqDestination,
    )
    from encdisagg.transfer import MooncakeEngine, ZmqReceiver

    config = EncoderConfig.from_mapping(
        {"model": "null", "transfer": "mooncake", "staging_arena_mb": ARENA_MB}
    )
    largest = max(tokens for _, _, tokens in CASES) * HIDDEN * 2
    landing = torch.zeros(largest, dtype=torch.uint8)
    results = []
    async with (
        MooncakeEngine() as receiver_engine,
        ZmqReceiver() as zmq_receiver,
        Encoder(config, model=PatternModel(device)) as encoder,
    ):
        receiver_engine.register(landing.data_ptr(), largest)
        for index, (label, transport, tokens) in enumerate(CASES):
            req_id = f"case-{index}"
            result = await encoder.encode(EncodeRequest(req_id, [tokens]))
            staged_regions = encoder.stats().registered_regions
            landing.zero_()
            got: Any = None
            started = time.perf_counter()
            if transport == "mooncake":
                destination: Any = MooncakeDestination(
                    receiver_engine.session_id, landing.data_ptr(), "receiver:1"
                )
                await encoder.send(req_id, destination)
                got = landing[: result.nbytes].view(torch.bfloat16).reshape(tokens, HIDDEN)
            else:
                await encoder.send(req_id, ZmqDestination(zmq_receiver.url))
                with anyio.fail_after(60):
                    part = await zmq_receiver.receive()
                got = part.tensor
            seconds = time.perf_counter() - started
            expected = pattern(tokens, tokens)
            results.append(
                {
                    "case": label,
                    "bytes": result.nbytes,
                    "bytes_equal": got is not None and torch.equal(got, expected),
                    "send_ms": round(seconds * 1e3, 2),
                    "gb_per_s": round(result.nbytes / seconds / 1e9, 3),
                    # The arena is one registration; an own registration adds one.
                    "registered_regions_while_staged": staged_regions,
                }
            )
        receiver_engine.deregister(landing.data_ptr())
        left = encoder.stats()
    if left.live_requests or left.staged_bytes:
        raise RuntimeError(f"the encoder still holds requests after the sends: {left}")
    return results


def transfer_step(device: str) -> Row:
    """Run every case on ``device``; failed if any case's bytes differ."""
    import anyio

    started = time.perf_counter()
    cases = anyio.run(_cases, device)
    figures = {
        "device": device,
        "device_name": device_name(device),
        "arena_mb": ARENA_MB,
        "hidden": HIDDEN,
        "dtype": "bfloat16",
        "cases": cases,
        "bytes_equal": all(case["bytes_equal"] for case in cases),
    }
    differ = [case["case"] for case in cases if not case["bytes_equal"]]
    elapsed = time.perf_counter() - started
    if differ:
        return row(
            "transfer",
            "failed",
            reason=f"bytes differ: {', '.join(differ)}",
            seconds=elapsed,
            figures=figures,
        )
    return row("transfer", "ok", seconds=elapsed, figures=figures)
