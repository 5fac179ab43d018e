"""Models named by Hugging Face id (``ORG/NAME``), found in the local Hub cache, offline.

Nothing here reaches the network: the id is looked up in the cache folder
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``, read when
called), the same layout ``hf download`` and ``snapshot_download`` write.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Final

from ._errors import BadRequestError

__all__ = ["hub_cache_dir", "looks_like_hub_id", "resolve_hub_model"]

#: ``ORG/NAME``, optionally ``@REVISION``, in the Hub's id alphabet.
_HUB_ID: Final = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w./-]{1,128}))?"
)


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache folder the environment names now. Not async."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` reads as ``ORG/NAME[@REVISION]`` and is no existing path. Not async."""
    return _HUB_ID.fullmatch(name) is not None and not Path(name).expanduser().exists()


def resolve_hub_model(name: str, builtins: Collection[str] = ()) -> str:
    """``name`` itself, unless it is a Hub id (see :func:`looks_like_hub_id`): then the folder
    of its snapshot in the local cache (``revision`` after ``@``, else ``main``). Blocks on a
    few file reads; never touches the network.

    :raises BadRequestError: naming ``model``, the id and the cache folder, when the cache
        holds no snapshot of it.
    """
    if name in builtins or not looks_like_hub_id(name):
        return name
    match = _HUB_ID.fullmatch(name)
    assert match is not None
    cache = hub_cache_dir()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            match["repo"],
            revision=match["revision"],
            cache_dir=cache,
            local_files_only=True,
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, OSError) as exc:
        raise BadRequestError(
            f"model: {name!r} is not in the local Hugging Face cache {cache} (offline, nothing "
            f"is downloaded); fetch it there first (hf download {match['repo']}), set "
            "HF_HUB_CACHE to the cache that has it, or pass a checkpoint folder"
        ) from exc
    if not isinstance(folder, str):  # a dry run's answer; not asked for
        raise BadRequestError(f"model: {name!r}: unexpected answer from the Hub cache")
    return folder
