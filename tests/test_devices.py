"""Device and dtype names: refused when the config is built; one device per DP worker."""

from __future__ import annotations

import pytest
import torch

from encdisagg import BadRequestError, EncoderConfig
from encdisagg._devices import check_device, check_device_present, check_dtype, worker_devices

pytestmark = pytest.mark.device


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with two CUDA devices, as far as torch's answers go."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "mps", "xpu:0", "cpu:0"])
def test_device_names_torch_places_models_on(device: str) -> None:
    assert check_device(device) == device
    assert EncoderConfig(device=device).device == device


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "CUDA", "cuda:", "cpu:1", "", "cuda:0:1"])
def test_other_devices_are_refused_when_the_config_is_built(device: str) -> None:
    with pytest.raises(BadRequestError, match=r"^device"):
        EncoderConfig(device=device)


@pytest.mark.parametrize("dtype", [None, "auto", "bfloat16", "BF16", "torch.float16", "fp32"])
def test_floating_dtypes_are_accepted(dtype: str | None) -> None:
    check_dtype(dtype)
    assert EncoderConfig(dtype=dtype).dtype == dtype


@pytest.mark.parametrize("dtype", ["int8", "float8", "bfloat", ""])
def test_other_dtypes_are_refused_when_the_config_is_built(dtype: str) -> None:
    with pytest.raises(BadRequestError, match=r"^dtype must be one of"):
        EncoderConfig(dtype=dtype)


def test_the_mapping_names_the_field() -> None:
    with pytest.raises(BadRequestError, match=r"device must be one of .* got 'tpu'"):
        EncoderConfig.from_mapping({"device": "tpu"})


@pytest.mark.usefixtures("no_gpu")
def test_cuda_on_a_machine_without_it_is_refused_naming_the_field() -> None:
    with pytest.raises(BadRequestError, match=r"^device: 'cuda' .* no CUDA device"):
        check_device_present("cuda")
    check_device_present("cpu")
    check_device_present("mps")  # left to the model's loading


@pytest.mark.usefixtures("two_gpus")
def test_a_cuda_index_past_the_visible_devices_is_refused() -> None:
    check_device_present("cuda:1")
    with pytest.raises(BadRequestError, match=r"sees 2 CUDA device\(s\) \(cuda:0\.\.cuda:1\)"):
        check_device_present("cuda:2")


@pytest.mark.usefixtures("two_gpus")
def test_each_worker_gets_its_own_gpu_by_default_on_cuda() -> None:
    assert worker_devices("cuda", 2, None) == ("cuda:0", "cuda:1")
    assert worker_devices("cuda", 1, None) == ("cuda",)
    # A device with an index, and the CPU, are shared on purpose.
    assert worker_devices("cuda:1", 2, None) == ("cuda:1", "cuda:1")
    assert worker_devices("cpu", 3, None) == ("cpu", "cpu", "cpu")


@pytest.mark.usefixtures("two_gpus")
def test_more_workers_than_gpus_asks_for_devices() -> None:
    with pytest.raises(BadRequestError, match=r"^devices: 3 data-parallel workers .* sees 2"):
        worker_devices("cuda", 3, None)


@pytest.mark.usefixtures("two_gpus")
def test_listed_devices_are_indexes_of_the_device_type_or_names() -> None:
    assert worker_devices("cuda", 2, ["1", "0"]) == ("cuda:1", "cuda:0")
    # Bare indexes mean CUDA when the default device (the CPU) has none.
    assert worker_devices("cpu", 4, ["0", "0", "1", "cpu"]) == ("cuda:0", "cuda:0", "cuda:1", "cpu")
    with pytest.raises(BadRequestError, match=r"^devices lists 1 device\(s\) for 2"):
        worker_devices("cuda", 2, ["0"])
    with pytest.raises(BadRequestError, match=r"^devices must be one of"):
        worker_devices("cuda", 2, ["0", "tpu"])
    with pytest.raises(BadRequestError, match=r"^devices: 'cuda:5'"):
        worker_devices("cuda", 2, ["0", "5"])


@pytest.mark.usefixtures("no_gpu")
def test_listed_gpus_on_a_machine_without_cuda_are_refused() -> None:
    with pytest.raises(BadRequestError, match=r"^devices: 'cuda:0' .* no CUDA"):
        worker_devices("cpu", 2, ["0", "1"])
