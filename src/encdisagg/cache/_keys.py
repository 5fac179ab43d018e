"""Content-addressed keys of the embedding cache, one per media item.

A key is a sha256 over a namespace (the format version, the model's identity, its
embedding width and dtype, and the modality) and the item's content digest, so two models
never share an entry, nor do an image and a video with the same bytes. Content digests come
from one of three sources, kept apart so one can never collide with (or poison) another:

- ``"hash"``: a caller-supplied hash (``EncodeRequest.hashes``), trusted as given;
- ``"content"``: the item's own bytes, when the item *is* its content (bytes, a ``data:``
  URL, an RGB-convertible PIL image, or ``{"url", "content_hash"}``), digested without
  decoding it;
- ``"model"``: the model's ``Preprocessed.cache_key`` of the item alone, for items that name
  their content elsewhere (file paths, http URLs), which must be read and preprocessed first.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .._errors import BadRequestError
from ..models._protocol import ModelOptions
from ..transfer import dtype_name

if TYPE_CHECKING:
    from ..models import VisionModel

__all__ = ["KEY_PREFIX", "KeySpace", "ModalityKeys", "content_digest"]

#: Every key starts with this (the format version is part of it).
KEY_PREFIX: Final = "encdisagg-emb-v1-"
_HEX_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def _sha256(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        # Length-prefixed, so no two different part lists hash the same bytes.
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def _pil_digest(item: object) -> str | None:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - PIL comes with the models' dependencies
        return None
    if not isinstance(item, Image.Image):
        return None
    if getattr(item, "n_frames", 1) != 1:
        return None  # animated: which frames the model uses is the loader's business
    try:
        pixels = item.tobytes()
    except Exception:  # undecodable lazily-loaded image: let preprocessing report it
        return None
    return "pil:" + _sha256(item.mode.encode(), repr(item.size).encode(), pixels)


def content_digest(item: object, *, max_media_bytes: int) -> str | None:
    """A digest of ``item``'s content if the item carries it, else ``None``. Blocks briefly
    (hashes the bytes; never reads files or the network, never decodes).

    ``None`` also for items over ``max_media_bytes``, so preprocessing rejects them exactly
    as it would without the cache.
    """
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
        if len(data) > max_media_bytes:
            return None
        return "bytes:" + _sha256(data)
    if isinstance(item, str):
        if not item.startswith("data:") or len(item) * 3 // 4 > max_media_bytes:
            return None
        return "data-url:" + _sha256(item.encode())
    if isinstance(item, Mapping):
        if set(item) != {"url", "content_hash"}:
            return None
        url, expected = item.get("url"), item.get("content_hash")
        if not isinstance(url, str) or not isinstance(expected, str):
            return None
        if not _HEX_SHA256.fullmatch(expected):
            return None
        # The loader checks the hash against the bytes before a miss is encoded, so a false
        # claim fails that request and never reaches the cache.
        return "sha256:" + expected.lower()
    return _pil_digest(item)


@dataclass(frozen=True, slots=True)
class ModalityKeys:
    """Key builder for one model and one modality."""

    namespace: str

    def _key(self, source: str, digest: str) -> str:
        return KEY_PREFIX + _sha256(self.namespace.encode(), source.encode(), digest.encode())

    def for_hash(self, value: str) -> str:
        """The key of a caller-supplied item hash."""
        return self._key("hash", value)

    def for_content(self, item: object, *, max_media_bytes: int) -> str | None:
        """The key of an item that carries its content, or ``None`` (see :func:`content_digest`)."""
        digest = content_digest(item, max_media_bytes=max_media_bytes)
        return None if digest is None else self.for_digest(digest)

    def for_digest(self, digest: str) -> str:
        """The key of an item whose :func:`content_digest` is ``digest`` (already computed)."""
        return self._key("content", digest)

    def for_model_key(self, cache_key: str) -> str:
        """The key of an item the model preprocessed alone (its ``Preprocessed.cache_key``)."""
        return self._key("model", cache_key)


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The part of every key that names the model: identity, width and dtype."""

    identity: str
    hidden_size: int
    dtype: str

    @classmethod
    def for_model(cls, model: VisionModel) -> KeySpace:
        """The key space of ``model``, which must expose an ``identity`` string.

        :raises BadRequestError: naming ``global_cache`` if the model has no identity (its
            embeddings could then not be told apart from another model's).
        """
        identity = ModelOptions.of(model).identity
        if identity is None:
            raise BadRequestError(
                f"global_cache needs a model with an 'identity' (a digest of its weights and "
                f"preprocessing settings), so that different models never share entries; "
                f"{type(model).__name__} has none"
            )
        return cls(
            identity=identity, hidden_size=int(model.hidden_size), dtype=dtype_name(model.dtype)
        )

    def for_modality(self, modality: str) -> ModalityKeys:
        """The key builder for ``modality`` (``"image"``, ``"video"``, ``"audio"``)."""
        namespace = _sha256(
            KEY_PREFIX.encode(),
            self.identity.encode(),
            str(self.hidden_size).encode(),
            self.dtype.encode(),
            modality.encode(),
        )
        return ModalityKeys(namespace)
