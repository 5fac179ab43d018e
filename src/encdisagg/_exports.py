"""The public module of the names a package re-exports."""

from __future__ import annotations

from collections.abc import Mapping
from types import FunctionType
from typing import Any


def claim_exports(namespace: Mapping[str, Any]) -> None:
    """Name the package as the module of each class and function in its ``__all__``.

    ``namespace`` is the package's ``globals()``. Reprs, pickles and the documentation then
    show the public module, never the private one a name is defined in. Constants, type
    aliases and names not loaded yet (a lazy export) keep theirs. Not async.
    """
    for name in namespace["__all__"]:
        value = namespace.get(name)
        if isinstance(value, (type, FunctionType)):
            value.__module__ = namespace["__name__"]
