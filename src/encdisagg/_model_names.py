"""The names ``model`` may take besides a folder or a Hub id, known without importing torch.

``encdisagg serve`` checks ``--model`` before the model code loads; the loaders keep their
own tables (``encdisagg.models.BUILTIN_MODELS``), and a test holds the two equal.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from ._suggest import did_you_mean

__all__ = ["BUILTIN_MODEL_NAMES", "SERVER_MODEL_NAMES", "not_a_model", "unknown_name_problem"]

#: The embedded tiny models ``load_model`` builds by name.
BUILTIN_MODEL_NAMES: Final = (
    "tiny",
    "tiny-qwen2.5-vl",
    "tiny-qwen3-vl",
    "tiny-kimi-k25",
    "tiny-qwen2-audio",
    "tiny-qwen2.5-omni-audio",
)
#: Names only the server knows (``null``: ``NullVisionModel``).
SERVER_MODEL_NAMES: Final = ("null",)


def not_a_model(model: str) -> str:
    """What to say of a ``model`` that names no model (the caller names the field)."""
    known = (*BUILTIN_MODEL_NAMES, *SERVER_MODEL_NAMES)
    return (
        f"{model!r} is neither a built-in model ({', '.join(known)}), a checkpoint folder, "
        f"nor a Hugging Face id (ORG/NAME) in the local cache{did_you_mean(model, known)}"
    )


def unknown_name_problem(model: str) -> str | None:
    """Why ``model`` names no model, for a bare name (no path separator) that is neither a
    known name nor an existing file or folder; ``None`` otherwise (paths and Hub ids are read
    when the model loads). Reads the file system once; not async."""
    if model in BUILTIN_MODEL_NAMES or model in SERVER_MODEL_NAMES:
        return None
    if "/" in model or os.sep in model or Path(model).expanduser().exists():
        return None
    return f"model {not_a_model(model)}"
