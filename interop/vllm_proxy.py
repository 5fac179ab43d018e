"""The proxy's half of vLLM's disaggregated encoder, as its proxy example documents it.

vLLM ships no proxy command; its example proxy is the only thing that calls encoders. This
module does what that proxy does with a chat request before the PD sees it:

1. every media item in message order gets ``uuid = item.get("uuid") or sha256(url)`` and,
   for a Mooncake consumer, a fresh ``transfer_id``;
2. items go to the encoders round-robin (a cursor shared across requests); the images bound
   for one encoder travel in one request, other media one per request;
3. each encoder gets ``POST /v1/chat/completions`` (``x-request-id``, no ``max_tokens``;
   Mooncake: ``ec_transfer_params`` with ``consumer_zmq`` and ``ec_items``), all at once;
4. any answer other than 200 is the client's answer; otherwise each answered entry (keyed by
   the identifier, ``item_indices`` into that encoder request) rewrites its item into
   ``{"type": "<modality>_embeds", "<modality>_embeds": <metadata>, "uuid": ...}`` and joins
   the PD's ``ec_transfer_params`` (``ec_items`` in item order, plus each entry by key).
   An entry without metadata leaves the original media in place (the PD then encodes it).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import secrets
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests

MEDIA_TYPES = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
#: The proxy's aiohttp timeout is effectively none; bound ours so a hung row fails.
ENCODER_TIMEOUT_S = 120.0


@dataclass
class Proxied:
    """What the proxy made of one chat request."""

    #: The body the PD gets (``None`` when an encoder failed the request).
    pd_body: dict[str, Any] | None
    #: (status, text) of the first failing encoder answer, or of a transport error (502).
    error: tuple[int, str] | None = None
    #: Per media item, in message order: the identifier the encoder reported, and the
    #: transfer id given to the encoder (empty without a Mooncake consumer).
    keys: list[str] = field(default_factory=list)
    transfer_ids: list[str] = field(default_factory=list)
    encoder_requests: int = 0


def _url(part: dict[str, Any]) -> str | None:
    value = part.get(part["type"])
    if isinstance(value, dict):
        url = value.get("url")
        return url if isinstance(url, str) else None
    return None


def _flatten(metadata: dict[str, Any]) -> dict[str, Any]:
    """One item's metadata with nested lists flattened, as the proxy sends it on."""
    flat = {}
    for name, value in metadata.items():
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            value = [x for inner in value for x in inner]
        flat[name] = value
    return flat


class Proxy:
    """Round-robin over ``encoders``; ``consumer_zmq`` set for a Mooncake consumer."""

    def __init__(self, encoders: list[str], consumer_zmq: str | None, model: str) -> None:
        self.encoders = encoders
        self.consumer_zmq = consumer_zmq
        self.model = model
        self._cursor = itertools.count()

    def handle(self, body: dict[str, Any]) -> Proxied:
        """Encode a chat body's media and rewrite it for the PD (blocking)."""
        request_id = uuid.uuid4().hex
        content: list[dict[str, Any]] = body["messages"][-1]["content"]
        media = [i for i, part in enumerate(content) if part.get("type") in MEDIA_TYPES]
        uuids, tids = [], []
        for index in media:
            part = content[index]
            url = _url(part) or json.dumps(part, sort_keys=True)
            uuids.append(part.get("uuid") or hashlib.sha256(url.encode()).hexdigest())
            tids.append(uuid.uuid4().hex if self.consumer_zmq else "")
        # Grouped by encoder instance (its place in the list), not by URL.
        groups: dict[int, list[int]] = {}
        singles: list[tuple[int, list[int]]] = []
        for position, index in enumerate(media):
            encoder = next(self._cursor) % len(self.encoders)
            if MEDIA_TYPES[content[index]["type"]] == "image":
                groups.setdefault(encoder, []).append(position)
            else:
                singles.append((encoder, [position]))
        calls = [(self.encoders[e], ps) for e, ps in [*groups.items(), *singles]]
        with ThreadPoolExecutor(max(1, len(calls))) as pool:
            answers = list(
                pool.map(
                    lambda call: self._call(request_id, content, media, uuids, tids, *call),
                    calls,
                )
            )
        result = Proxied(None, transfer_ids=tids, encoder_requests=len(calls))
        keys: dict[int, tuple[str, dict[str, Any]]] = {}
        for (_encoder, positions), (status, answer) in zip(calls, answers, strict=True):
            if status != 200:
                result.error = result.error or (status, answer)
                continue
            for key, entry in json.loads(answer)["ec_transfer_params"].items():
                for at in entry["item_indices"]:
                    keys[positions[at]] = (key, entry)
        if result.error is not None:
            return result
        rewritten = list(content)
        params: dict[str, Any] = {"ec_items": []}
        for position, index in enumerate(media):
            key, entry = keys[position]
            modality = entry.get("modality", MEDIA_TYPES[content[index]["type"]])
            if entry.get("metadata") is not None:
                kind = f"{modality}_embeds"
                rewritten[index] = {
                    "type": kind,
                    kind: _flatten(entry["metadata"]),
                    "uuid": uuids[position],
                }
            item = {"mm_hash": key}
            if tids[position]:
                item["transfer_id"] = tids[position]
            params["ec_items"].append(item)
            params[key] = entry
            result.keys.append(key)
        messages = [*body["messages"][:-1], {**body["messages"][-1], "content": rewritten}]
        result.pd_body = {**body, "messages": messages, "ec_transfer_params": params}
        return result

    def _call(
        self,
        request_id: str,
        content: list[dict[str, Any]],
        media: list[int],
        uuids: list[str],
        tids: list[str],
        encoder: str,
        positions: list[int],
    ) -> tuple[int, str]:
        parts = [{**content[media[p]], "uuid": uuids[p]} for p in positions]
        body: dict[str, Any] = {
            "model": self.model,
            "stream": False,
            "messages": [{"role": "user", "content": parts}],
        }
        if self.consumer_zmq:
            body["ec_transfer_params"] = {
                "consumer_zmq": self.consumer_zmq,
                "ec_items": [{"transfer_id": tids[p]} for p in positions],
            }
        headers = {
            "x-request-id": f"{request_id}:{positions[0]}:{secrets.token_hex(3)}",
            "Content-Type": "application/json",
        }
        try:
            answer = requests.post(
                f"{encoder}/v1/chat/completions",
                data=json.dumps(body),
                headers=headers,
                timeout=ENCODER_TIMEOUT_S,
            )
        except requests.RequestException as exc:
            return 502, f"{type(exc).__name__}: {exc}"
        return answer.status_code, answer.text
