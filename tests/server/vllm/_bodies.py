"""Bodies as vLLM's disaggregated-encoder proxy sends them, written from the observed wire."""

from __future__ import annotations

from typing import Any

from .._helpers import png_data_url


def image_item(uuid: str | None, seed: int = 0, **extra: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "image_url", "image_url": {"url": png_data_url(seed=seed)}}
    if uuid is not None:
        item["uuid"] = uuid
    item.update(extra)
    return item


def chat_body(*items: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The proxy's encoder request: one user message holding only media items."""
    body: dict[str, Any] = {
        "model": "Qwen/Qwen2-VL-2B-Instruct",
        "stream": False,
        "messages": [{"role": "user", "content": list(items)}],
    }
    body.update(extra)
    return body


def mooncake_params(consumer_zmq: str, *transfer_ids: str) -> dict[str, Any]:
    return {
        "consumer_zmq": consumer_zmq,
        "ec_items": [{"transfer_id": transfer_id} for transfer_id in transfer_ids],
    }
