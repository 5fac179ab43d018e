"""``--device``, ``--dtype`` and ``--devices``: resolved into the config and each worker's
device; the data-parallel front hands every worker its own (CUDA faked, no GPU needed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from encdisagg._cli import build_parser, main
from encdisagg._cli._serve import ServeOptions, resolve

from ._helpers import start_and_stop_recording_workers

pytestmark = pytest.mark.device


def resolved(*argv: str) -> ServeOptions:
    return resolve(build_parser().parse_args(["serve", "--model", "null", *argv]))


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_device_and_dtype_flags_reach_the_config() -> None:
    options = resolved("--device", "cpu", "--dtype", "bfloat16")
    assert (options.config.device, options.config.dtype) == ("cpu", "bfloat16")
    assert options.settings.worker_devices is None


@pytest.mark.usefixtures("two_gpus")
def test_dp_on_cuda_gives_each_worker_its_own_gpu() -> None:
    assert resolved("--dp", "2", "--device", "cuda").settings.worker_devices == (
        "cuda:0",
        "cuda:1",
    )
    assert resolved("--dp", "2", "--devices", "1,0").settings.worker_devices == (
        "cuda:1",
        "cuda:0",
    )
    # One worker: its device is the config's.
    single = resolved("--devices", "1")
    assert (single.config.device, single.settings.worker_devices) == ("cuda:1", None)


@pytest.mark.usefixtures("two_gpus")
def test_devices_from_the_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[encoder]\ndevice = "cuda"\n[server]\ndp = 2\ndevices = ["cuda:1", "1"]\n')
    options = resolve(build_parser().parse_args(["serve", "--config", str(path)]))
    assert options.settings.worker_devices == ("cuda:1", "cuda:1")


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--device", "tpu"], "--device: device must be one of cpu, cuda, mps, xpu"),
        (["--dtype", "int8"], "--dtype: dtype must be one of"),
        (["--device", "cuda"], "--device: 'cuda' asked for, but torch sees no CUDA device"),
        (["--dp", "2", "--devices", "0"], "--devices: devices lists 1 device(s) for 2"),
        (["--dp", "2", "--devices", "0,1"], "--devices: 'cuda:0' asked for, but torch sees no"),
    ],
)
def test_bad_device_options_exit_2_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    assert main(["serve", "--model", "null", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("encdisagg serve: error:")
    assert err.count("\n") == 1
    assert needle in err


@pytest.mark.usefixtures("two_gpus")
@pytest.mark.anyio
async def test_the_front_hands_each_worker_its_device(tmp_path: Path) -> None:
    options = resolved("--dp", "2", "--device", "cuda", "--devices", "1,0", "--dtype", "fp16")
    settings = dataclasses.replace(
        options.settings, worker_start_timeout_s=20, worker_stop_timeout_s=2
    )
    await start_and_stop_recording_workers(options.config, settings, tmp_path)
    seen = [json.loads((tmp_path / f"config-{rank}.json").read_text()) for rank in (0, 1)]
    assert [config["device"] for config in seen] == ["cuda:1", "cuda:0"]
    assert {config["dtype"] for config in seen} == {"fp16"}
