"""``did you mean`` for a mistyped flag or configuration key."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``" (did you mean X?)"`` naming the entry of ``known`` closest to ``word``, or ``""``
    when none is close. Not async."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
