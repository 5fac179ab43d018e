"""Turning request items into pixels: images and video frames from bytes, files and URLs.

Every function here blocks (file reads, decoding, and remote fetches when enabled) and raises
:class:`~encdisagg.BadRequestError` naming the item, as ``mm_items[i]``, for anything it
cannot use. Nothing here touches request state; the limits come from a :class:`MediaPolicy`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.util
import io
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.client import HTTPMessage
from pathlib import Path
from typing import IO

from PIL import Image, ImageSequence

from .._errors import BadRequestError

__all__ = [
    "DEFAULT_MAX_MEDIA_BYTES",
    "DEFAULT_MAX_VIDEO_FRAMES",
    "MediaPolicy",
    "item_label",
    "load_image",
    "load_video",
]

DEFAULT_MAX_MEDIA_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_VIDEO_FRAMES = 768
# Frames per second kept from a video file, as SGLang's encoder samples by default.
VIDEO_FILE_FPS = 2.0

_HEX_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_DICT_KEYS = frozenset({"url", "content_hash"})


@dataclass(frozen=True)
class MediaPolicy:
    """What media a model accepts, and from where.

    :param max_media_bytes: largest encoded item (file, data URL, download) in bytes.
    :param remote_media_domains: domains ``http(s)://`` items may come from (subdomains
        included); empty, the default, refuses every remote URL.
    :param remote_timeout_s: socket timeout of each remote fetch step.
    :param allow_local_files: whether string items may name files on this machine. A server
        exposed to untrusted clients should turn this off.
    :param max_video_frames: most frames one video item may have (files are sampled down to
        it; frame lists above it are rejected).
    :raises BadRequestError: naming the field, for a value out of range.
    """

    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    remote_media_domains: tuple[str, ...] = field(default=())
    remote_timeout_s: float = 10.0
    allow_local_files: bool = True
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES

    def __post_init__(self) -> None:
        for name in ("max_media_bytes", "max_video_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadRequestError(f"{name} must be a positive integer; got {value!r}")
        if not self.remote_timeout_s > 0:
            raise BadRequestError(
                f"remote_timeout_s must be positive; got {self.remote_timeout_s!r}"
            )
        given: object = self.remote_media_domains
        if isinstance(given, str):
            raise BadRequestError("remote_media_domains must be a list of domains, not a string")
        domains = []
        for domain in self.remote_media_domains:
            if not isinstance(domain, str) or not domain.strip(".").strip():
                raise BadRequestError(f"remote_media_domains has an invalid domain {domain!r}")
            domains.append(domain.strip().strip(".").lower())
        object.__setattr__(self, "remote_media_domains", tuple(domains))

    def allows_domain(self, host: str) -> bool:
        """Whether ``host`` is an allow-listed domain or one of its subdomains."""
        host = host.lower().rstrip(".")
        return any(
            host == domain or host.endswith("." + domain) for domain in self.remote_media_domains
        )


def item_label(index: int) -> str:
    """How errors name the ``index``-th item of a request."""
    return f"mm_items[{index}]"


# --- raw bytes --------------------------------------------------------------------------


def _check_size(size: int, label: str, policy: MediaPolicy) -> None:
    if size > policy.max_media_bytes:
        raise BadRequestError(
            f"{label}: media is larger than max_media_bytes ({policy.max_media_bytes})"
        )


def _read_file(path: Path, label: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_local_files:
        raise BadRequestError(f"{label}: local file paths are not allowed")
    try:
        if not path.is_file():  # devices and pipes could stream forever
            raise BadRequestError(f"{label}: cannot read file: not a regular file")
        _check_size(path.stat().st_size, label, policy)
        with path.open("rb") as file:
            # One byte past the cap, in case the file grew since stat().
            data = file.read(policy.max_media_bytes + 1)
    except OSError as exc:
        raise BadRequestError(f"{label}: cannot read file: {exc.strerror or exc}") from exc
    _check_size(len(data), label, policy)
    return data


def _decode_data_url(url: str, label: str, policy: MediaPolicy) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise BadRequestError(f"{label}: only base64 data URLs are supported")
    # base64 grows data by 4/3; refuse before decoding anything too large.
    _check_size(len(payload) * 3 // 4, label, policy)
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise BadRequestError(f"{label}: invalid base64 in data URL: {exc}") from exc


class _AllowListRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allow-listed domain, so a redirect cannot escape it."""

    def __init__(self, policy: MediaPolicy, label: str) -> None:
        self._policy = policy
        self._label = label

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        _check_remote_url(newurl, self._label, self._policy)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_remote_url(url: str, label: str, policy: MediaPolicy) -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequestError(f"{label}: not an http(s) URL: {url[:100]!r}")
    if not policy.remote_media_domains:
        raise BadRequestError(
            f"{label}: remote media URLs are disabled (remote_media_domains is empty)"
        )
    if not policy.allows_domain(parts.hostname):
        raise BadRequestError(f"{label}: domain {parts.hostname!r} is not in remote_media_domains")


def _fetch_remote(url: str, label: str, policy: MediaPolicy) -> bytes:
    _check_remote_url(url, label, policy)
    opener = urllib.request.build_opener(_AllowListRedirects(policy, label))
    try:
        with opener.open(url, timeout=policy.remote_timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit():
                _check_size(int(declared), label, policy)
            # Read one byte past the cap: a server may send more than it declared.
            data: bytes = response.read(policy.max_media_bytes + 1)
    except BadRequestError:
        raise
    except (OSError, ValueError) as exc:
        # URLError, HTTPError and socket timeouts are OSErrors; malformed URLs ValueErrors.
        raise BadRequestError(f"{label}: cannot fetch {url[:100]!r}: {exc}") from exc
    _check_size(len(data), label, policy)
    return data


def _string_bytes(text: str, label: str, policy: MediaPolicy) -> bytes:
    if text.startswith("data:"):
        return _decode_data_url(text, label, policy)
    if text.startswith(("http://", "https://")):
        return _fetch_remote(text, label, policy)
    if text.startswith("file://"):
        return _read_file(Path(urllib.parse.unquote(text.removeprefix("file://"))), label, policy)
    if policy.allow_local_files and len(text) < 4096:
        try:
            is_file = Path(text).is_file()
        except (OSError, ValueError):
            is_file = False
        if is_file:
            return _read_file(Path(text), label, policy)
    # SGLang's clients also send bare base64; accept it when it decodes strictly.
    _check_size(len(text) * 3 // 4, label, policy)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        pass
    # Base64 never holds "." or "\\"; a string with them was most likely meant as a path.
    if "." in text or "\\" in text or text.startswith("/"):
        if not policy.allow_local_files:
            raise BadRequestError(f"{label}: local file paths are not allowed")
        raise BadRequestError(f"{label}: no such file: {text[:200]!r}")
    raise BadRequestError(
        f"{label}: not a file, a data URL, an http(s) URL or base64 data: {text[:100]!r}"
    )


def _item_bytes(item: object, label: str, policy: MediaPolicy) -> bytes:
    """The encoded bytes an item names, with its ``content_hash`` checked when it has one."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
        _check_size(len(data), label, policy)
        return data
    if isinstance(item, Path):
        return _read_file(item, label, policy)
    if isinstance(item, str):
        return _string_bytes(item, label, policy)
    if isinstance(item, dict):
        unknown = sorted(str(key) for key in item if key not in _DICT_KEYS)
        if unknown:
            raise BadRequestError(f"{label}: unknown key {unknown[0]!r}")
        url = item.get("url")
        if not isinstance(url, str):
            raise BadRequestError(f"{label}.url must be a string")
        expected = item.get("content_hash")
        if expected is not None and (
            not isinstance(expected, str) or not _HEX_SHA256.fullmatch(expected)
        ):
            raise BadRequestError(f"{label}.content_hash must be a sha256 hex digest")
        data = _string_bytes(url, label, policy)
        if expected is not None and hashlib.sha256(data).hexdigest() != expected.lower():
            raise BadRequestError(f"{label}.content_hash does not match the media's bytes")
        return data
    raise BadRequestError(f"{label}: unsupported item type {type(item).__name__}")


# --- images -----------------------------------------------------------------------------


def _rgb(image: Image.Image, label: str) -> Image.Image:
    try:
        return image.convert("RGB")
    except Exception as exc:  # PIL's decoders raise many types; all mean bad media here.
        raise BadRequestError(f"{label}: cannot decode image: {exc}") from exc


def load_image(
    item: object, index: int, policy: MediaPolicy, *, label: str | None = None
) -> Image.Image:
    """Decode one image item into an RGB PIL image. Blocks on reads, decoding and fetches.

    ``item`` is a PIL image, bytes, a file path (``str`` or ``Path``), a ``data:`` URL, bare
    base64, an allow-listed ``http(s)`` URL, or ``{"url": ..., "content_hash": sha256hex}``.

    :raises BadRequestError: naming ``mm_items[index]`` for anything it cannot decode, an
        oversized item, a refused URL or a ``content_hash`` that does not match.
    """
    label = label or item_label(index)
    if isinstance(item, Image.Image):
        return _rgb(item, label)
    data = _item_bytes(item, label, policy)
    try:
        with Image.open(io.BytesIO(data)) as image:
            return _rgb(image, label)
    except BadRequestError:
        raise
    except Exception as exc:  # UnidentifiedImageError, DecompressionBombError, truncation...
        raise BadRequestError(f"{label}: cannot decode image: {exc}") from exc


# --- videos -----------------------------------------------------------------------------


def _sample_evenly(frames: list[Image.Image], limit: int) -> list[Image.Image]:
    if len(frames) <= limit:
        return frames
    step = len(frames) / limit
    return [frames[int(i * step)] for i in range(limit)]


def _pil_frames(image: Image.Image, label: str) -> list[Image.Image]:
    return [_rgb(frame, label) for frame in ImageSequence.Iterator(image)]


def _pyav_frames(data: bytes, label: str, policy: MediaPolicy) -> list[Image.Image]:
    import av  # type: ignore[import-not-found,unused-ignore]  # optional dependency

    frames: list[Image.Image] = []
    interval = 1.0 / VIDEO_FILE_FPS
    next_time = 0.0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            for frame in container.decode(container.streams.video[0]):
                when = float(frame.time) if frame.time is not None else next_time
                if when + 1e-9 < next_time:
                    continue
                image = frame.to_image()  # type: ignore[no-untyped-call,unused-ignore]
                frames.append(image.convert("RGB"))
                next_time = when + interval
                if len(frames) >= 2 * policy.max_video_frames:
                    # Bound memory on long videos: keep every other frame and sample half
                    # as often from here on, so the kept frames stay evenly spaced.
                    frames = frames[::2]
                    interval *= 2
    except Exception as exc:  # PyAV raises its own error tree for bad containers and codecs.
        raise BadRequestError(f"{label}: cannot decode video: {exc}") from exc
    return frames


def _file_frames(data: bytes, label: str, policy: MediaPolicy) -> list[Image.Image]:
    try:
        with Image.open(io.BytesIO(data)) as image:
            return _pil_frames(image, label)
    except BadRequestError:
        raise
    except Exception as exc:
        pil_error: Exception = exc
    if importlib.util.find_spec("av") is not None:
        return _pyav_frames(data, label, policy)
    raise BadRequestError(
        f"{label}: cannot decode video: not an animated image ({pil_error}), and video files "
        "need PyAV, which is not installed; send a list of frames instead"
    )


def load_video(item: object, index: int, policy: MediaPolicy) -> list[Image.Image]:
    """Decode one video item into its RGB frames. Blocks on reads, decoding and fetches.

    A video is a list (or tuple) of frames, each in any form :func:`load_image` accepts; or an
    animated image (GIF, APNG, WebP); or, with PyAV installed, a video file, sampled at
    2 frames per second. Files with more than ``max_video_frames`` frames are sampled evenly
    down to it.

    :raises BadRequestError: naming ``mm_items[index]`` (and the frame) for anything it
        cannot decode, an empty video, or a frame list longer than ``max_video_frames``.
    """
    label = item_label(index)
    if isinstance(item, (list, tuple)):
        if len(item) > policy.max_video_frames:
            raise BadRequestError(
                f"{label}: video has {len(item)} frames, more than max_video_frames "
                f"({policy.max_video_frames})"
            )
        frames = [
            load_image(frame, index, policy, label=f"{label}[{number}]")
            for number, frame in enumerate(item)
        ]
    elif isinstance(item, Image.Image):
        frames = _pil_frames(item, label)
    else:
        frames = _file_frames(_item_bytes(item, label, policy), label, policy)
    if not frames:
        raise BadRequestError(f"{label}: video has no frames")
    return _sample_evenly(frames, policy.max_video_frames)
