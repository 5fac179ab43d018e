"""The public module of the names a package re-exports, and names that load on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
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


def lazy_exports(
    namespace: MutableMapping[str, Any], lazy: Mapping[str, str], *, claim: bool
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of a package whose names in ``lazy`` (name
    -> module, absolute or relative to the package) are imported on first use, then kept in
    ``namespace`` (its ``globals()``); with ``claim``, each names the package as its module
    (see :func:`claim_exports`). The first use of a name blocks while its module imports.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = lazy.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        if claim and isinstance(value, (type, FunctionType)):
            value.__module__ = package
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace["__all__"]))

    return __getattr__, __dir__
