"""Keys: content-addressed per item, naming the model; caller hashes kept apart."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from PIL import Image

from encdisagg import BadRequestError
from encdisagg.cache import KeySpace, ModalityKeys, content_digest
from encdisagg.models import NullVisionModel

LIMIT = 1 << 20


class Identified:
    def __init__(
        self, identity: str, hidden_size: int = 8, dtype: torch.dtype = torch.float16
    ) -> None:
        self.identity = identity
        self.hidden_size = hidden_size
        self.dtype = dtype


def keys(identity: str = "model-a", modality: str = "image", **kwargs: Any) -> ModalityKeys:
    model: Any = Identified(identity, **kwargs)
    return KeySpace.for_model(model).for_modality(modality)


def test_same_content_same_key_and_the_model_is_part_of_it() -> None:
    a = keys().for_content(b"pixels", max_media_bytes=LIMIT)
    assert a is not None
    assert a == keys().for_content(bytearray(b"pixels"), max_media_bytes=LIMIT)
    assert a == keys().for_content(memoryview(b"pixels"), max_media_bytes=LIMIT)
    assert a != keys().for_content(b"pixels!", max_media_bytes=LIMIT)
    assert a != keys("model-b").for_content(b"pixels", max_media_bytes=LIMIT)
    assert a != keys(hidden_size=16).for_content(b"pixels", max_media_bytes=LIMIT)
    assert a != keys(dtype=torch.bfloat16).for_content(b"pixels", max_media_bytes=LIMIT)
    assert a != keys(modality="video").for_content(b"pixels", max_media_bytes=LIMIT)
    assert a.startswith("encdisagg-emb-v1-")


def test_sources_never_collide() -> None:
    builder = keys()
    digest = content_digest(b"x", max_media_bytes=LIMIT)
    assert digest is not None
    keys_made = {
        builder.for_content(b"x", max_media_bytes=LIMIT),
        builder.for_hash(digest),
        builder.for_model_key(digest),
    }
    assert len(keys_made) == 3


def test_which_items_carry_their_content() -> None:
    image = Image.new("RGB", (4, 3), (1, 2, 3))
    sha = hashlib.sha256(b"abc").hexdigest()
    assert content_digest("data:image/png;base64,AAAA", max_media_bytes=LIMIT) is not None
    assert content_digest(image, max_media_bytes=LIMIT) == content_digest(
        Image.new("RGB", (4, 3), (1, 2, 3)), max_media_bytes=LIMIT
    )
    assert content_digest(image, max_media_bytes=LIMIT) != content_digest(
        Image.new("RGB", (4, 3), (1, 2, 4)), max_media_bytes=LIMIT
    )
    assert content_digest(
        {"url": "/x.png", "content_hash": sha.upper()}, max_media_bytes=LIMIT
    ) == ("sha256:" + sha)
    # Items that name content elsewhere, or break the media rules, are not keyed by content.
    for item in (
        "/some/file.png",
        "https://example.com/a.png",
        "QUJD",
        {"url": "/x.png"},
        {"url": "/x.png", "content_hash": "nothex"},
        {"url": 1, "content_hash": sha},
        {"url": "/x.png", "content_hash": sha, "extra": 1},
        b"x" * (LIMIT + 1),
        "data:" + "A" * (2 * LIMIT),
        [b"frame"],
        42,
    ):
        assert content_digest(item, max_media_bytes=LIMIT) is None, item


def test_a_model_without_identity_is_refused_by_name() -> None:
    with pytest.raises(BadRequestError, match="global_cache needs a model with an 'identity'"):
        KeySpace.for_model(NullVisionModel())
