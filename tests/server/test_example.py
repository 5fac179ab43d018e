"""``examples/embed_in_quart.py --once`` serves, checks its routes over HTTP, and exits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "embed_in_quart.py"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the example's app is a Quart app
async def test_embedding_example_runs_once(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("embed_in_quart", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert await module.main(["--once"]) == 0
    out = capsys.readouterr().out
    assert "serving on http://127.0.0.1:" in out
    assert "GET /encoder/health {'status': 'ok', 'probed': True}" in out
    assert "'embedding_len': 64" in out
    assert "POST /encoder/release None" in out
