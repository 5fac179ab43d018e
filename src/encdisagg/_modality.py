"""Media modalities."""

from __future__ import annotations

import enum

from ._errors import BadRequestError

__all__ = ["Modality"]


class Modality(enum.Enum):
    """The kind of media a request carries."""

    IMAGE = "image"
    VIDEO = "video"
    AUDIO = "audio"

    @classmethod
    def parse(cls, value: Modality | str, *, field: str = "modality") -> Modality:
        """``Modality.parse("Image")`` → ``Modality.IMAGE``; case-insensitive.

        :raises BadRequestError: naming ``field`` if ``value`` is no known modality.
        """
        if isinstance(value, Modality):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        known = ", ".join(m.value for m in cls)
        raise BadRequestError(f"{field} must be one of {known}; got {value!r}")
