"""The shared-storage files: vLLM's name and tensor, written atomically, and the store's bounds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from encdisagg.server._vllm._storage import FILE_NAME, EmbeddingStore

pytestmark = pytest.mark.anyio


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _tensor(rows: int, width: int = 8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(rows * width, dtype=torch.float32).reshape(rows, width).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
async def test_the_file_is_what_vllms_consumer_loads(tmp_path: Path, dtype: torch.dtype) -> None:
    store = EmbeddingStore(tmp_path, max_bytes=1 << 30, max_age_s=60)
    tensor = _tensor(5, 3, dtype)
    await store.put("item", tensor)
    # Only the final name: the temporary file was renamed into place.
    assert [p.name for p in (tmp_path / "item").iterdir()] == [FILE_NAME]
    loaded = load_file(str(tmp_path / "item" / FILE_NAME))
    assert list(loaded) == ["ec_cache"]
    assert loaded["ec_cache"].dtype == dtype
    assert torch.equal(loaded["ec_cache"], tensor)


async def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    store = EmbeddingStore(tmp_path, max_bytes=1 << 30, max_age_s=60)
    with pytest.raises(ValueError, match="cannot write"):
        await store.put("item", torch.zeros(2, 2, dtype=torch.int64))
    assert not (tmp_path / "item").exists()
    assert "item" not in store
    assert store.total_bytes == 0


async def test_the_budget_sweeps_the_oldest_first_and_keeps_the_newest(tmp_path: Path) -> None:
    clock = Clock()
    one = 8 + 80 + 4 * 8 * 4  # header bound + 4 rows of 8 float32 columns
    store = EmbeddingStore(tmp_path, max_bytes=2 * one, max_age_s=3600, clock=clock)
    for uuid in ("a", "b", "c"):
        await store.put(uuid, _tensor(4))
        clock.now += 1
    assert [uuid in store for uuid in "abc"] == [False, True, True]
    assert not (tmp_path / "a").exists()
    assert (tmp_path / "c" / FILE_NAME).exists()
    # One file larger than the whole budget is still kept: it was just answered.
    await store.put("big", _tensor(400))
    assert [uuid in store for uuid in ("b", "c", "big")] == [False, False, True]
    assert store.total_bytes == (tmp_path / "big" / FILE_NAME).stat().st_size


async def test_age_sweeps_files_older_than_the_bound(tmp_path: Path) -> None:
    clock = Clock()
    store = EmbeddingStore(tmp_path, max_bytes=1 << 30, max_age_s=60, clock=clock)
    await store.put("old", _tensor(2))
    clock.now += 30
    await store.put("young", _tensor(2))
    clock.now += 31
    await store.sweep()
    assert ("old" in store, "young" in store) == (False, True)
    assert not (tmp_path / "old").exists()
    clock.now += 30
    await store.sweep()
    assert store.total_bytes == 0


async def test_rewriting_an_item_counts_it_once_and_as_new(tmp_path: Path) -> None:
    clock = Clock()
    store = EmbeddingStore(tmp_path, max_bytes=1 << 30, max_age_s=60, clock=clock)
    await store.put("a", _tensor(2))
    clock.now += 50
    await store.put("a", _tensor(2))
    clock.now += 20
    await store.sweep()
    assert "a" in store
    assert store.total_bytes == (tmp_path / "a" / FILE_NAME).stat().st_size


async def test_files_of_an_earlier_run_are_counted_and_aged_by_mtime(tmp_path: Path) -> None:
    clock = Clock()
    first = EmbeddingStore(tmp_path, max_bytes=1 << 30, max_age_s=60, clock=clock)
    await first.put("earlier", _tensor(2))
    os.utime(tmp_path / "earlier" / FILE_NAME, (clock.now - 100, clock.now - 100))
    second = EmbeddingStore(tmp_path, max_bytes=1 << 30, max_age_s=60, clock=clock)
    await second.adopt()
    assert "earlier" in second
    await second.sweep()
    assert not (tmp_path / "earlier").exists()


async def test_a_write_that_fails_on_disk_is_not_counted(tmp_path: Path) -> None:
    root = tmp_path / "not-a-folder"
    root.write_bytes(b"")
    store = EmbeddingStore(root, max_bytes=1 << 30, max_age_s=60)
    with pytest.raises(OSError):
        await store.put("item", _tensor(2))
    assert "item" not in store
    assert store.total_bytes == 0
