"""``encdisagg serve`` fixes glibc's mmap threshold, for itself and the workers it starts."""

from __future__ import annotations

import os
import platform

import pytest

from encdisagg.server._serve._malloc import MMAP_THRESHOLD_BYTES, return_large_frees_to_the_os

ENV = "MALLOC_MMAP_THRESHOLD_"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_fixes_the_threshold_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert return_large_frees_to_the_os() is True
    assert os.environ[ENV] == str(MMAP_THRESHOLD_BYTES)
    # Set already (here by the first call; elsewhere by the operator): left alone.
    assert return_large_frees_to_the_os() is False


def test_an_operator_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "65536")
    assert return_large_frees_to_the_os() is False
    assert os.environ[ENV] == "65536"
