"""``encdisagg demo --device``: the encoder servers' towers on a device; a name torch cannot
place a model on, or a GPU the machine lacks, exits 2 in one line before anything starts."""

from __future__ import annotations

import pytest
import torch

from encdisagg import BadRequestError
from encdisagg._cli import main
from encdisagg.pipeline import DemoOptions

pytestmark = pytest.mark.device


def test_the_device_defaults_to_the_cpu_and_is_checked() -> None:
    assert DemoOptions().device == "cpu"
    assert DemoOptions(device="cuda:1").device == "cuda:1"
    with pytest.raises(BadRequestError, match=r"^device must be one of"):
        DemoOptions(device="tpu")


@pytest.mark.parametrize(
    ("device", "needle"),
    [
        ("tpu", "device must be one of"),
        ("cuda", "'cuda' asked for, but torch sees no CUDA device"),
    ],
)
def test_a_bad_or_missing_device_exits_2_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], device: str, needle: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["demo", "--device", device, "--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("encdisagg demo: ")
    assert err.count("\n") == 1
    assert needle in err
