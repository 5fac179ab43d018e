"""``/metrics`` for operators: the process collector, the build info, and HTTP latency by
route template and status (a bounded label set); data-parallel workers' processes counted
once each, under their rank."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from quart import Quart

from encdisagg import __version__
from encdisagg.server import DataParallelBackend, ServerSettings
from encdisagg.server._dp._process_metrics import read_process_stats
from encdisagg.server._metrics import (
    MetricsSnapshot,
    ServerMetrics,
    ServiceSnapshot,
    WorkerStatus,
)

from ._helpers import fast_config, running

SCRIPT = str(Path(__file__).with_name("scripted_worker.py"))


def _samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of the samples of ``name`` in a Prometheus text exposition."""
    found = {}
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        found[match[1] or ""] = float(match[2])
    return found


@pytest.mark.anyio
async def test_process_info_and_http_latency_by_route_and_status(
    make_app: Callable[..., Quart], anyio_backend_name: str
) -> None:
    async with running(make_app(fast_config(model="null"))) as client:
        assert (
            await client.post("/encode", json={"req_id": "m1", "mm_items": ["x"]})
        ).status_code == 200
        assert (await client.post("/release", json={"req_id": "m1", "extra": 1})).status_code == 400
        for path in ("/no/such/1", "/no/such/2", "/metrics?x=1", "/encode"):
            await client.get(path)
        text = (await (await client.get("/metrics")).get_data()).decode()

    assert len(_samples(text, "process_cpu_seconds_total")) == 1, "this process, once"
    assert _samples(text, "process_resident_memory_bytes")[""] > 0
    info = _samples(text, "encdisagg_build_info")
    assert info == {
        f'{{dp="1",model="null",transfer="zmq",version="{__version__}",'
        f'worker_class="{anyio_backend_name}"}}': 1.0
    }
    counts = _samples(text, "encdisagg_http_request_duration_seconds_count")
    assert counts['{code="200",route="/encode"}'] == 1
    assert counts['{code="400",route="/release"}'] == 1
    # Raw paths never become labels: every unknown path is one "unmatched" route.
    assert counts['{code="404",route="unmatched"}'] == 2
    assert counts['{code="405",route="/encode"}'] == 1, "a wrong method is answered too"
    assert counts['{code="200",route="/metrics"}'] == 1, "the query string is no route"
    assert not any("/no/such" in labels for labels in counts)
    # The counter counts every answer the histogram timed, under the same labels.
    assert _samples(text, "encdisagg_http_requests_total") == counts
    sums = _samples(text, "encdisagg_http_request_duration_seconds_sum")
    assert sums['{code="200",route="/encode"}'] > 0
    buckets = _samples(text, "encdisagg_http_request_duration_seconds_bucket")
    assert buckets['{code="200",le="+Inf",route="/encode"}'] == 1


def test_the_info_outside_an_event_loop_and_without_workers() -> None:
    metrics = ServerMetrics()
    metrics.set_info(model="tiny", transfer="mooncake")
    text = metrics.render().decode()
    assert 'model="tiny"' in text
    assert 'worker_class="none"' in text
    assert "encdisagg_dp_worker_cpu_seconds" not in text


def test_process_stats_of_this_process_and_of_a_gone_one(tmp_path: Path) -> None:
    stats = read_process_stats(os.getpid())
    if sys.platform != "linux":
        assert stats is None
        return
    assert stats is not None
    assert stats.cpu_seconds > 0
    assert stats.resident_bytes > 0
    assert read_process_stats(2**31 - 1) is None
    # A command name with spaces and parentheses: fields are read after its closing one.
    (tmp_path / "7").mkdir()
    fields = ["S", *["0"] * 10, "250", "150", *["0"] * 8, "3"]
    (tmp_path / "7" / "stat").write_text("7 (a) b (c) " + " ".join(fields) + " 0 0\n")
    odd = read_process_stats(7, proc=str(tmp_path))
    assert odd is not None
    assert odd.cpu_seconds == pytest.approx(400 / os.sysconf("SC_CLK_TCK"))
    assert odd.resident_bytes == 3 * os.sysconf("SC_PAGE_SIZE")
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "stat").write_text("garbage")
    assert read_process_stats(8, proc=str(tmp_path)) is None


@pytest.mark.anyio
@pytest.mark.skipif(sys.platform != "linux", reason="worker processes are read from /proc")
async def test_each_worker_process_is_reported_once_under_its_rank(tmp_path: Path) -> None:
    backend = DataParallelBackend(
        fast_config(model="null"),
        workers=2,
        settings=ServerSettings(dp=2, worker_start_timeout_s=20, worker_stop_timeout_s=2),
        worker_command=[sys.executable, SCRIPT, "--script", "echo", "--log", str(tmp_path)],
    )
    metrics = ServerMetrics()
    async with backend:
        metrics.update(await backend.snapshot())
        text = metrics.render().decode()
    memory = _samples(text, "encdisagg_dp_worker_resident_memory_bytes")
    assert set(memory) == {'{rank="0"}', '{rank="1"}'}
    assert all(value > 0 for value in memory.values())
    assert set(_samples(text, "encdisagg_dp_worker_cpu_seconds_total")) == set(memory)
    assert len(_samples(text, "process_cpu_seconds_total")) == 1, "the front alone"
    # A worker that is gone (or not started) is left out, not reported as zero.
    assert read_process_stats(None) is None
    assert read_process_stats(2**31 - 1) is None
    metrics.update(ServiceSnapshot(MetricsSnapshot.merge(()), (WorkerStatus(0, False, 0),)))
    text = metrics.render().decode()
    assert 'encdisagg_dp_worker_up{rank="0"} 0.0' in text
    assert not _samples(text, "encdisagg_dp_worker_resident_memory_bytes")
    assert not _samples(text, "encdisagg_dp_worker_cpu_seconds_total")


def _documented_families() -> set[str]:
    """The metric names of docs/server.md's table, ``{a,b}`` alternatives spelled out."""
    docs = Path(__file__).parents[2] / "docs" / "server.md"
    names: set[str] = set()
    for cell in re.findall(
        r"^\| `(encdisagg_[^`{]*(?:\{[a-z_,]+\}[^`{]*)?)", docs.read_text(), re.M
    ):
        head, brace, rest = cell.partition("{")
        if not brace:
            names.add(head)
            continue
        options, _, tail = rest.partition("}")
        if tail:  # `cache_{hits,misses}_total`: alternatives of the name
            names.update(head + option + tail for option in options.split(","))
        else:  # `requests_total{route,code}`: the name and its labels
            names.add(head)
    return names


def test_the_docs_table_lists_exactly_the_families_served() -> None:
    metrics = ServerMetrics()
    metrics.update(
        ServiceSnapshot(MetricsSnapshot.merge([]), (WorkerStatus(0, True, 0, pid=os.getpid()),), 0)
    )
    text = metrics.render().decode()
    served = {
        name.removesuffix("_total") if kind == "counter" else name
        for name, kind in re.findall(r"^# TYPE (encdisagg_\S+) (\S+)$", text, re.M)
    }
    documented = {name.removesuffix("_total") for name in _documented_families()}
    assert served == documented
