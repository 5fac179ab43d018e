"""Fixtures for the model tests: the tiny model, built once, and real generated images."""

from __future__ import annotations

import pytest

from encdisagg.models import QwenVisionModel, load_model


@pytest.fixture(scope="session")
def tiny() -> QwenVisionModel:
    return load_model("tiny")


@pytest.fixture(scope="session")
def tiny25() -> QwenVisionModel:
    return load_model("tiny-qwen2.5-vl")
