"""The device that device-marked tests run on: ``ENCDISAGG_TEST_DEVICE`` (``cpu`` unless set).

``pytest -m device`` selects the tests that touch a device; with the variable set to
``cuda`` (as ``benchmarks/gpu_check.py`` sets it) the same tests run on the GPU. Asking for
an accelerator the machine lacks fails the test rather than skipping it: a run that was
meant for a GPU must not pass by running nothing.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE_ENV = "ENCDISAGG_TEST_DEVICE"


def chosen_device() -> torch.device:
    """The device named by ``ENCDISAGG_TEST_DEVICE`` (default ``cpu``)."""
    device = torch.device(os.environ.get(DEVICE_ENV, "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"{DEVICE_ENV}={device} but torch sees no CUDA device")
    return device
