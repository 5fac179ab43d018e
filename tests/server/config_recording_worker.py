"""A stand-in data-parallel worker that keeps a copy of the config file the front gave it
(as ``--log DIR/config-RANK.json``) and its arguments (``DIR/argv-RANK.json``), then answers
as ``scripted_worker.py``'s script does."""

from __future__ import annotations

import json
import runpy
import shutil
import sys
from pathlib import Path


def _option(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


if __name__ == "__main__":
    folder = Path(_option("--log"))
    shutil.copy(_option("--config-file"), folder / f"config-{_option('--rank')}.json")
    (folder / f"argv-{_option('--rank')}.json").write_text(json.dumps(sys.argv[1:]))
    runpy.run_path(str(Path(__file__).with_name("scripted_worker.py")), run_name="__main__")
