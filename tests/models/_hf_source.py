"""transformers' own code for processors this machine cannot import.

Some processors (Kimi-K2.5's) import torchvision at module level, which cannot be installed
beside a CPU torch. Their arithmetic (resize rules, patch counts) is plain Python, so the
tests compile just those functions out of the installed transformers source and compare our
results with them: the reference is upstream's code, never a copy of it.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers

_MODELS = Path(transformers.__file__).parent / "models"


def upstream_function(module: str, name: str, *, owner: str | None = None) -> Callable[..., Any]:
    """The function ``name`` (a method of class ``owner`` if given) of
    ``transformers/models/<module>.py``, compiled on its own with ``math`` in scope.
    Module-level functions of the same file are in scope too, so methods may call them."""
    path = _MODELS / f"{module}.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    scope: dict[str, Any] = {"math": math}
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    for node in functions:
        exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), scope)
    if owner is None:
        return scope[name]  # type: ignore[no-any-return]
    (klass,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner)
    (method,) = (n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)
    method.decorator_list = []
    method.args.args[0].annotation = None
    for argument in method.args.args:
        argument.annotation = None
    method.returns = None
    exec(compile(ast.Module([method], type_ignores=[]), str(path), "exec"), scope)
    return scope[name]  # type: ignore[no-any-return]
