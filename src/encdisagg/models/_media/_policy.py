"""What media a model accepts and from where (:class:`MediaPolicy`); how errors name items
and describe what a decoder refused."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..._errors import BadRequestError
from ..._numbers import real, whole

__all__ = [
    "DEFAULT_MAX_MEDIA_BYTES",
    "DEFAULT_MAX_VIDEO_FRAMES",
    "VIDEO_FILE_FPS",
    "MediaPolicy",
    "decoder_error",
    "item_label",
]

DEFAULT_MAX_MEDIA_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_VIDEO_FRAMES = 768
# Frames per second kept from a video file, as SGLang's encoder samples by default.
VIDEO_FILE_FPS = 2.0
# Decoders name the file object they could not read ("<_io.BytesIO object at 0x7f...>"); a
# client must never see an address of ours.
_OBJECT_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>")


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
            whole(name, getattr(self, name), least=1, error=BadRequestError)
        timeout = self.remote_timeout_s
        real("remote_timeout_s", timeout, above=0, finite=False, error=BadRequestError)
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


def decoder_error(exc: BaseException) -> str:
    """What a decoder's ``exc`` says, for a client: no addresses, at most 300 characters."""
    text = _OBJECT_REPR.sub("the item", str(exc)).strip() or type(exc).__name__
    return text[:300]
