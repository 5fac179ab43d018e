"""One access line per request, and the request's ``req_id`` on every record logged while it
is served (in the request's task and in the worker threads the model runs in), as text and
as JSON lines."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from quart import Quart

from encdisagg import BadRequestError, Encoder, Modality
from encdisagg._cli import build_parser
from encdisagg._cli._serve import UsageError, resolve
from encdisagg.models import NullVisionModel, Preprocessed
from encdisagg.server import ServerSettings
from encdisagg.server._logs import JsonFormatter, RequestIdFilter, TextFormatter

from ._helpers import fast_config, running

_model_log = logging.getLogger("tests.server.model")


class LoggingModel(NullVisionModel):
    """NullVisionModel that logs from preprocess and forward (both run in worker threads)."""

    def preprocess(self, items: Sequence[object], modality: Modality) -> Preprocessed:
        _model_log.info("preprocessing %d items", len(items))
        return super().preprocess(items, modality)

    def forward(self, batch: Sequence[Preprocessed]) -> list[torch.Tensor]:
        _model_log.info("forward of %d", len(batch))
        return super().forward(batch)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.addFilter(RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def collected() -> Iterator[_Collect]:
    handler = _Collect()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _ours(handler: _Collect) -> list[logging.LogRecord]:
    return [r for r in handler.records if r.name.startswith(("tests.", "encdisagg.server.access"))]


@pytest.mark.anyio
async def test_access_line_and_req_id_on_the_records_served(
    make_app: Callable[..., Quart], collected: _Collect
) -> None:
    app = make_app(Encoder(fast_config(model="null"), model=LoggingModel()))
    async with running(app) as client:
        response = await client.post("/encode", json={"req_id": "r-7", "mm_items": ["x"]})
        assert response.status_code == 200
        served = _ours(collected)
        collected.records.clear()
        assert (await client.get("/health/live")).status_code == 200
        assert (await client.get("/no/such/route")).status_code == 404
        bad = await client.post("/release", json={"req_id": "r-8", "extra": 1})
        assert bad.status_code == 400
        others = _ours(collected)

    assert [r.name for r in served] == [
        "tests.server.model",
        "tests.server.model",
        "encdisagg.server.access",
    ]
    assert [getattr(r, "req_id", None) for r in served] == ["r-7"] * 3
    access = served[-1]
    assert (access.method, access.route, access.status) == ("POST", "/encode", 200)  # type: ignore[attr-defined]
    assert access.duration_ms >= 0  # type: ignore[attr-defined]

    lines = [(r.route, r.status, r.req_id) for r in others]  # type: ignore[attr-defined]
    assert lines == [
        ("/health/live", 200, None),
        ("unmatched", 404, None),
        ("/release", 400, "r-8"),
    ]

    body = json.dumps({"req_id": "r-7", "mm_items": ["x"]}).encode()
    assert access.bytes_in == len(body)  # type: ignore[attr-defined]
    assert access.bytes_out == len(await response.get_data())  # type: ignore[attr-defined]
    assert access.client  # type: ignore[attr-defined]
    assert access.trace_id is None  # type: ignore[attr-defined]
    text = TextFormatter().format(access)
    assert re.search(
        rf"INFO encdisagg\.server\.access: \S+ POST /encode 200 [0-9.]+ms in={len(body)} out=\d+",
        text,
    ), text
    assert text.endswith(' req_id="r-7"')
    line = json.loads(JsonFormatter().format(access))
    assert line["req_id"] == "r-7"
    assert (line["method"], line["route"], line["status"]) == ("POST", "/encode", 200)
    assert (line["bytes_in"], line["client"]) == (len(body), access.client)  # type: ignore[attr-defined]
    assert line["logger"] == "encdisagg.server.access"
    model_line = json.loads(JsonFormatter().format(served[0]))
    assert (model_line["message"], model_line["req_id"]) == ("preprocessing 1 items", "r-7")
    assert "route" not in model_line


def test_a_record_outside_requests_has_no_req_id() -> None:
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "hello %s", ("you",), None)
    assert RequestIdFilter().filter(record)
    assert record.req_id is None  # type: ignore[attr-defined]
    assert TextFormatter().format(record).endswith("WARNING x: hello you")
    assert json.loads(JsonFormatter().format(record))["message"] == "hello you"


def test_log_format_flag_and_toml_key(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    assert resolve(parse(["serve"])).log_format == "text"
    options = resolve(parse(["serve", "--log-format", "json"]))
    assert options.log_format == "json"
    assert options.settings.worker_log_format == "json", "data-parallel workers follow"
    with pytest.raises(BadRequestError, match="worker_log_format"):
        ServerSettings(worker_log_format="xml")
    path = tmp_path / "serve.toml"
    path.write_text('[server]\nlog_format = "json"\n')
    assert resolve(parse(["serve", "--config", str(path)])).log_format == "json"
    path.write_text('[server]\nlog_format = "xml"\n')
    with pytest.raises(
        UsageError, match=r"server\.log_format must be one of text, json; got 'xml'"
    ):
        resolve(parse(["serve", "--config", str(path)]))
