"""No code path in src/ unpickles anything: no call to a pickle loader exists there.

The SGLang wire's header frames are pickles we only ever write (by hand, in
``transfer/_sglang_frames``); this scan keeps it that way.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "encdisagg"
#: Modules whose loaders unpickle (``torch.load`` does, unless told otherwise).
_PICKLE_MODULES = frozenset({"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib"})
_LOADERS = frozenset({"load", "loads", "Unpickler", "_load", "_loads"})


def _offences(tree: ast.AST) -> list[str]:
    found = []
    aliases: dict[str, str] = {}  # a local name -> "module.attr" for from-imports
    modules: set[str] = set()  # local names bound to a pickle module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _PICKLE_MODULES:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            root = node.module.split(".")[0]
            for alias in node.names:
                if root in _PICKLE_MODULES and alias.name in _LOADERS:
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in _LOADERS | {"load"}:
            continue
        base = node.value
        if isinstance(base, ast.Name) and (
            base.id in modules or aliases.get(base.id, "").split(".")[0] in _PICKLE_MODULES
        ):
            found.append(f"line {node.lineno}: {base.id}.{node.attr}")
        if isinstance(base, ast.Name) and base.id == "torch" and node.attr == "load":
            found.append(f"line {node.lineno}: torch.load")
    return found


def test_no_pickle_loader_is_called_in_src() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50
    offences = {
        str(path.relative_to(SRC)): found
        for path in files
        if (found := _offences(ast.parse(path.read_text(), str(path))))
    }
    assert offences == {}


def test_the_scan_finds_each_kind_of_loader() -> None:
    samples = [
        "import pickle\npickle.loads(b'')",
        "import pickle as p\np.Unpickler(f).load()",
        "from pickle import loads\n",
        "import _pickle\n_pickle.load(f)",
        "import torch\ntorch.load('x')",
    ]
    for sample in samples:
        assert _offences(ast.parse(sample)), sample
    assert _offences(ast.parse("import json\njson.loads('1')")) == []
