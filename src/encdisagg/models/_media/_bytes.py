"""The encoded bytes a request item names: raw bytes, files, data URLs, base64, allow-listed URLs.

Every function here blocks (file reads and, when enabled, remote fetches) and raises
:class:`~encdisagg.BadRequestError` naming the item for anything it cannot use. Sizes are
checked against ``max_media_bytes`` before anything large is read or decoded.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPMessage
from pathlib import Path
from typing import IO

from ..._errors import BadRequestError
from ._policy import MediaPolicy

__all__ = ["item_bytes"]

_HEX_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_DICT_KEYS = frozenset({"url", "content_hash"})


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


def item_bytes(item: object, label: str, policy: MediaPolicy) -> bytes:
    """The encoded bytes an item names, with its ``content_hash`` checked when it has one.
    Blocks on file reads and fetches.

    :raises BadRequestError: naming ``label`` for an item it cannot read, an oversized one,
        or one without any bytes (an empty data URL, an empty file).
    """
    data = _named_bytes(item, label, policy)
    if not data:
        raise BadRequestError(f"{label}: the item is empty (no media bytes)")
    return data


def _named_bytes(item: object, label: str, policy: MediaPolicy) -> bytes:
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
