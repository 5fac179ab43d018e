"""``encdisagg serve``: option resolution, and the real command in a subprocess."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

from encdisagg import Encoder, EncodeRequest, ZmqDestination
from encdisagg._cli import build_parser, main
from encdisagg._cli._serve import resolve
from encdisagg.transfer import ZmqReceiver

from ._helpers import fast_config, png_bytes, png_data_url


def resolved(*argv: str):  # type: ignore[no-untyped-def]
    return resolve(build_parser().parse_args(["serve", *argv]))


def test_defaults_and_flags() -> None:
    options = resolved()
    assert (options.host, options.port, options.worker_class) == ("127.0.0.1", 8000, "asyncio")
    assert options.settings.dp == 1
    options = resolved(
        "--port", "0", "--model", "null", "--dp", "2", "--max-batch-size", "4",
        "--request-timeout", "7.5", "--send-timeout", "9", "--prefix-cache-mb", "16",
        "--staged-memory-limit-mb", "64", "--transfer", "loopback", "--worker-class", "trio",
        "--max-body-mb", "3", "--health-timeout", "2.5", "--log-level", "debug",
    )  # fmt: skip
    config = options.config
    assert (config.model, config.max_batch_size, config.transfer) == ("null", 4, "loopback")
    assert (config.request_timeout_s, config.send_timeout_s) == (7.5, 9.0)
    assert (config.prefix_cache_mb, config.staged_memory_limit_mb) == (16, 64)
    assert options.settings.dp == 2
    assert options.settings.max_body_bytes == 3 * 1024 * 1024
    assert options.settings.health_timeout_s == 2.5
    assert (options.port, options.worker_class, options.log_level) == (0, "trio", "debug")


def test_serve_freezes_the_heap_unless_told_not_to(tmp_path: Path) -> None:
    assert resolved().settings.freeze_heap is True
    assert resolved("--no-freeze-heap").settings.freeze_heap is False
    path = tmp_path / "encoder.toml"
    path.write_text("[server]\nfreeze_heap = false\n")
    assert resolved("--config", str(path)).settings.freeze_heap is False
    assert resolved("--config", str(path), "--freeze-heap").settings.freeze_heap is True, (
        "the flag wins"
    )


def test_api_key_and_allowed_peers_flags_win_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ENCDISAGG_API_KEY", "from-env")
    assert resolved().settings.api_key == "from-env"
    options = resolved("--api-key", "from-flag", "--allowed-peers", "127.0.0.1, 10.0.0.0/8")
    assert options.settings.api_key == "from-flag"
    assert options.settings.allowed_peers is not None
    assert len(options.settings.allowed_peers) == 2
    monkeypatch.delenv("ENCDISAGG_API_KEY")
    assert resolved().settings.api_key is None


def test_toml_file_and_flags_over_it(tmp_path: Path) -> None:
    path = tmp_path / "encoder.toml"
    path.write_text(
        '[encoder]\nmodel = "null"\nmax_batch_size = 3\nsend_timeout_s = 12.0\n'
        '[server]\nport = 9123\ndp = 2\nworker_class = "trio"\n'
    )
    options = resolved("--config", str(path), "--max-batch-size", "5")
    assert options.config.max_batch_size == 5, "the flag wins"
    assert options.config.send_timeout_s == 12.0
    assert (options.port, options.settings.dp, options.worker_class) == (9123, 2, "trio")


@pytest.mark.parametrize(
    ("argv", "toml", "needle"),
    [
        (["--max-batch-size", "0"], None, "--max-batch-size"),
        (["--request-timeout", "-1"], None, "--request-timeout"),
        (["--staged-memory-limit-mb", "0"], None, "--staged-memory-limit-mb"),
        (["--port", "70000"], None, "--port"),
        (["--dp", "0"], None, "--dp"),
        (["--max-body-mb", "0"], None, "--max-body-mb"),
        (["--model", "no-such-model"], None, "--model"),
        ([], "[encoder]\nmax_batch_sise = 3\n", "max_batch_sise"),
        ([], '[encoder]\nmax_batch_size = "3"\n', "max_batch_size"),
        ([], '[server]\ndp = "two"\n', "server.dp"),
        ([], "[server]\nprot = 1\n", "server.prot"),
        ([], "[server]\nfreeze_heap = 1\n", "server.freeze_heap"),
        ([], "[server]\nport = true\n", "server.port"),
        ([], "not toml [", "--config"),
    ],
)
def test_invalid_options_exit_2_naming_them(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    toml: str | None,
    needle: str,
) -> None:
    if toml is not None:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
        argv = ["--config", str(path), *argv]
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("encdisagg serve: error:")
    assert needle in err


def test_non_numbers_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "eighty"]) == 2
    err = capsys.readouterr().err
    assert err == "encdisagg serve: error: --port: expected an integer; got 'eighty'\n"


async def scrape(client: httpx.AsyncClient) -> str:
    return (await client.get("/metrics")).text


@pytest.mark.anyio
async def test_serve_subprocess_end_to_end(anyio_backend_name: str) -> None:
    """``python -m encdisagg serve --port 0`` on the tiny model, driven over HTTP, pushing
    to a real ZmqReceiver; SIGTERM ends it with exit 0."""
    command = [
        sys.executable, "-m", "encdisagg", "serve", "--port", "0", "--model", "tiny",
        "--worker-class", anyio_backend_name, "--log-level", "warning",
    ]  # fmt: skip
    process = await anyio.open_process(command, stdin=subprocess.DEVNULL, stderr=None)
    try:
        assert process.stdout is not None
        with anyio.fail_after(60):
            line = await BufferedByteReceiveStream(process.stdout).receive_until(b"\n", 4096)
        prefix = b"encdisagg serving on "
        assert line.startswith(prefix), line
        url = line[len(prefix) :].decode().strip()
        assert not url.endswith(":0")

        images = [png_data_url(448, 448, seed=1), png_data_url(320, 240, seed=2)]
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as client,
            ZmqReceiver() as receiver,
            Encoder(fast_config()) as local,
        ):
            assert (await client.get("/health")).status_code == 200

            response = await client.post(
                "/encode", json={"req_id": "sub-1", "mm_items": images, "modality": "image"}
            )
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["grid"] == [[1, 32, 32], [1, 18, 22]]
            assert answer["token_counts"] == [256, 99]
            response = await client.post(
                "/send", json={"req_id": "sub-1", "receive_url": receiver.url}
            )
            assert response.status_code == 200
            assert response.json() is None
            with anyio.fail_after(30):
                part = await receiver.receive()
            assert part.header.req_id == "sub-1"
            assert part.tensor is not None
            # The same seeded tiny tower, in this process, gives the same embedding.
            items = [png_bytes(448, 448, 1), png_bytes(320, 240, 2)]
            expected = await local.encode(EncodeRequest("local", items))
            assert expected.num_tokens == part.tensor.shape[0] == 355
            await local.send("local", ZmqDestination(receiver.url))
            with anyio.fail_after(30):
                mine = await receiver.receive()
            assert mine.tensor is not None
            torch.testing.assert_close(part.tensor, mine.tensor)

            # Push mode, with the destination registered first.
            async with anyio.create_task_group() as group:
                registered: list[int] = []

                async def register() -> None:
                    reply = await client.post(
                        "/scheduler_receive_url",
                        json={"req_id": "sub-2", "receive_count": 1, "receive_url": receiver.url},
                    )
                    registered.append(reply.status_code)

                group.start_soon(register)
                await anyio.sleep(0.1)
                response = await client.post(
                    "/encode", json={"req_id": "sub-2", "mm_items": [images[1]]}
                )
                assert response.status_code == 200
            assert registered == [200]
            with anyio.fail_after(30):
                pushed = await receiver.receive()
            assert pushed.header.req_id == "sub-2"
            assert pushed.tensor is not None
            assert torch.isfinite(pushed.tensor).all()

            with anyio.fail_after(10):  # the last push's release may trail its arrival
                while "encdisagg_live_requests 0.0" not in (metrics := await scrape(client)):
                    await anyio.sleep(0.05)
            assert 'encdisagg_requests_total{modality="image",status="ok"} 2.0' in metrics

        process.send_signal(signal.SIGTERM)
        with anyio.fail_after(20):
            code = await process.wait()
        assert code == 0
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            await process.aclose()
