"""A Mooncake receiver in a process of its own, driven line by line by test_mooncake.py.

It registers a zeroed buffer, announces ``{"session_id", "ptr"}`` as one JSON line, then
answers ``digest`` with the buffer's SHA-256 and leaves on ``exit`` (or end of input).
"""

from __future__ import annotations

import hashlib
import json
import sys

import anyio
import anyio.to_thread
import torch

from encdisagg.transfer import MooncakeEngine


def _say(message: dict[str, object]) -> None:
    print(json.dumps(message), flush=True)


async def main(nbytes: int) -> None:
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    async with MooncakeEngine() as engine:
        engine.register(buffer.data_ptr(), nbytes)
        _say({"session_id": engine.session_id, "ptr": buffer.data_ptr()})
        while True:
            command = (await anyio.to_thread.run_sync(sys.stdin.readline)).strip()
            if command == "digest":
                _say({"sha256": hashlib.sha256(buffer.numpy().tobytes()).hexdigest()})
            else:
                break
        engine.deregister(buffer.data_ptr())
    _say({"regions_after_exit": engine.registered_regions()})


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]))
