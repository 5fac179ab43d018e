"""Helpers of the SGLang-wire tests: SGLang's request bodies and a receiver's PULL socket.

The bodies are written from SGLang 0.5.20's protocol (its tokenizer's ``/encode`` and its
scheduler ranks' ``/scheduler_receive_url`` and ``/send``), as our own fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio.to_thread
import zmq

from ..transfer._sglang_unpickle import read_header
from ._helpers import png_data_url


def sglang_encode_body(
    rid: str,
    *,
    part_idx: int = 0,
    num_parts: int = 1,
    embedding_port: int | list[int] | None = None,
    items: list[Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``/encode`` exactly as SGLang's tokenizer sends it: all ten fields."""
    body: dict[str, Any] = {
        "encoder_idx": 0,
        "encoder_url": "http://127.0.0.1:30001",
        "mm_items": items if items is not None else [png_data_url(seed=part_idx)],
        "num_parts": num_parts,
        "part_idx": part_idx,
        "req_id": f"{rid}_local_part_{part_idx}",
        "modality": "IMAGE",
        "prefill_host": "127.0.0.1",
        "embedding_port": embedding_port,
        "time_stats_json": None,
    }
    body.update(extra)
    return body


class SglangPull:
    """A receiver's PULL socket (what SGLang's tokenizer or a scheduler rank binds)."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVTIMEO, 20_000)  # a bound, never a pause
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.host_port = f"127.0.0.1:{self.port}"

    async def receive(self) -> tuple[dict[str, Any], list[bytes]]:
        """The next message: its header's fields, and all its frames."""
        frames: list[bytes] = await anyio.to_thread.run_sync(self.socket.recv_multipart)
        return read_header(frames[0]), frames

    def close(self) -> None:
        self.socket.close(linger=0)


@contextmanager
def pull_sockets(count: int) -> Iterator[list[SglangPull]]:
    context: zmq.Context[Any] = zmq.Context()
    pulls = [SglangPull(context) for _ in range(count)]
    try:
        yield pulls
    finally:
        for pull in pulls:
            pull.close()
        context.term()
