"""Shared storage for vLLM's ``ECExampleConnector``: one safetensors file per item, bounded.

vLLM's consumer looks for ``{path}/{identifier}/encoder_cache.safetensors`` (its scheduler
checks that the file exists, its worker loads the tensor named ``ec_cache``). Each file is
written under a temporary name in the item's folder and renamed into place, so a PD never
sees half a file; the rename happens before the proxy gets its answer.

vLLM never deletes these files, so this store bounds what it wrote: a byte budget and a
maximum age, swept oldest first (the file just written is never swept by its own write).
A PD may read a file any time after the answer, so a bound too tight for the time between
the encoder's answer and the PD's load makes that PD encode the media itself, or fail.

The safetensors format is small enough to write here: an 8-byte little-endian header length,
a JSON header (padded with spaces to 8 bytes) naming each tensor's dtype, shape and byte
range, then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio
import torch

from ...nurseries import run_thread_to_completion

__all__ = ["FILE_NAME", "TENSOR_NAME", "EmbeddingStore", "safetensors_header"]

_log = logging.getLogger("encdisagg.server.vllm")

FILE_NAME: Final = "encoder_cache.safetensors"
TENSOR_NAME: Final = "ec_cache"
#: torch dtype -> safetensors' dtype name.
_DTYPES: Final = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
#: A temporary file's name starts with this (never the consumer's name).
_TEMP_PREFIX: Final = ".encdisagg-"


def safetensors_header(tensor: torch.Tensor) -> bytes:
    """The bytes before a lone tensor's data in a safetensors file named ``ec_cache``.

    :raises ValueError: for a dtype safetensors names otherwise than we write.
    """
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot write a {tensor.dtype} tensor")
    nbytes = tensor.numel() * tensor.element_size()
    entry = {
        "dtype": _DTYPES[tensor.dtype],
        "shape": list(tensor.shape),
        "data_offsets": [0, nbytes],
    }
    header = json.dumps({TENSOR_NAME: entry}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def _write(folder: Path, tensor: torch.Tensor) -> None:
    """Write ``tensor`` as ``folder/encoder_cache.safetensors`` atomically. Blocks."""
    folder.mkdir(parents=True, exist_ok=True)
    data = tensor.detach().to("cpu").contiguous()
    header = safetensors_header(data)
    temp = folder / f"{_TEMP_PREFIX}{secrets.token_hex(8)}.tmp"
    try:
        with open(temp, "wb") as file:
            file.write(header)
            data.view(torch.uint8).reshape(-1).numpy().tofile(file)
        os.replace(temp, folder / FILE_NAME)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _remove(folders: list[Path]) -> None:
    """Delete each folder's file and the folder itself (if then empty). Blocks; logs."""
    for folder in folders:
        try:
            (folder / FILE_NAME).unlink(missing_ok=True)
            folder.rmdir()
        except OSError as exc:
            _log.debug("sweeping %s: %s", folder, exc)


@dataclass(eq=False, slots=True)
class _Entry:
    nbytes: int
    written_at: float


class EmbeddingStore:
    """The files this server wrote beneath ``root``, and their bounds.

    Decisions (what to sweep) are synchronous; file I/O runs in worker threads that are
    never abandoned. Used from one event loop.

    :param max_bytes: the byte budget of the files written (the newest is always kept).
    :param max_age_s: files older than this are swept.
    :param clock: the wall clock (seconds); files found at startup are aged by their mtime.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        max_bytes: int,
        max_age_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = Path(root)
        self._max_bytes = max_bytes
        self._max_age_s = max_age_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        # Items whose files a sweep is deleting: a new write of one waits for it, so the
        # sweep never deletes the fresh file.
        self._removing: dict[str, anyio.Event] = {}

    @property
    def total_bytes(self) -> int:
        """Bytes of the files the store holds now."""
        return self._bytes

    def __contains__(self, uuid: object) -> bool:
        return uuid in self._entries

    async def adopt(self) -> None:
        """Count the files already beneath ``root`` (an earlier run's) in the bounds, oldest
        first. A checkpoint (one thread call)."""
        found = await run_thread_to_completion(self._scan)
        for uuid, nbytes, mtime in sorted(found, key=lambda entry: entry[2]):
            self._record(uuid, nbytes, mtime)

    def _scan(self) -> list[tuple[str, int, float]]:
        found: list[tuple[str, int, float]] = []
        if not self.root.is_dir():
            return found
        for path in self.root.glob(f"*/{FILE_NAME}"):
            try:
                stat = path.stat()
            except OSError:
                continue
            found.append((path.parent.name, stat.st_size, stat.st_mtime))
        return found

    async def put(self, uuid: str, tensor: torch.Tensor) -> None:
        """Write the item's file (atomically), then sweep what the bounds no longer allow.

        A checkpoint. Returns once the file is in place. Cancelled, it returns once the
        thread writing it ended (the temporary file is removed if the rename did not
        happen); the item stays counted, as its file may be in place.

        :raises ValueError: for a dtype this store does not write.
        """
        nbytes = len(safetensors_header(tensor)) + tensor.numel() * tensor.element_size()
        while (removing := self._removing.get(uuid)) is not None:
            await removing.wait()
        # Counted before the write: a cancellation that lands as the thread returns must not
        # leave a file in place that the bounds do not know of.
        self._record(uuid, nbytes, self._clock())
        try:
            await run_thread_to_completion(_write, self.root / uuid, tensor)
        except Exception:
            self._forget(uuid)
            raise
        await self._remove(self.due(keep=uuid))

    async def sweep(self) -> None:
        """Remove what the bounds no longer allow. A checkpoint."""
        await self._remove(self.due())

    def due(self, keep: str | None = None) -> list[str]:
        """Forget and return the items to sweep now, oldest first: those older than
        ``max_age_s``, then the oldest until the rest fit the budget; never ``keep``."""
        now = self._clock()
        victims: list[str] = []
        for uuid, entry in list(self._entries.items()):
            if uuid == keep:
                continue
            if now - entry.written_at <= self._max_age_s and self._bytes <= self._max_bytes:
                break
            del self._entries[uuid]
            self._bytes -= entry.nbytes
            victims.append(uuid)
        return victims

    def _record(self, uuid: str, nbytes: int, written_at: float) -> None:
        self._forget(uuid)
        self._entries[uuid] = _Entry(nbytes, written_at)
        self._bytes += nbytes

    def _forget(self, uuid: str) -> None:
        old = self._entries.pop(uuid, None)
        if old is not None:
            self._bytes -= old.nbytes

    async def _remove(self, uuids: list[str]) -> None:
        if not uuids:
            return
        done = anyio.Event()
        for uuid in uuids:
            self._removing[uuid] = done
        try:
            await run_thread_to_completion(_remove, [self.root / uuid for uuid in uuids])
        finally:
            for uuid in uuids:
                if self._removing.get(uuid) is done:
                    del self._removing[uuid]
            done.set()
