"""The transfer benchmark's receivers, each a child process of its own.

Run as ``python _transfer_peers.py mooncake CAPACITY`` (a Mooncake engine holding one
registered buffer) or ``python _transfer_peers.py zmq ACK_URL`` (a PULL socket that
acknowledges each message on ``ACK_URL``). Each prints one JSON line saying where to send,
then serves until its stdin closes (Mooncake) or a ``quit`` message comes (ZMQ).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from typing import Any

from _common import child, tempfile_log


def mooncake_peer(capacity: int) -> None:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"mooncake initialize failed (rc={rc})")
    buffer = (ctypes.c_uint8 * capacity)()
    ptr = ctypes.addressof(buffer)
    rc = engine.register_memory(ptr, capacity)
    if rc != 0:
        raise SystemExit(f"mooncake register_memory failed (rc={rc})")
    print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}", "ptr": ptr}), flush=True)
    sys.stdin.readline()
    engine.unregister_memory(ptr)


def zmq_peer(ack_url: str) -> None:
    import zmq

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ack = context.socket(zmq.PUSH)
    ack.setsockopt(zmq.LINGER, 0)
    ack.connect(ack_url)
    print(json.dumps({"url": f"tcp://127.0.0.1:{port}"}), flush=True)
    while True:
        frames = pull.recv_multipart(copy=False)
        if len(frames) == 1 and bytes(frames[0].buffer) == b"quit":
            break
        ack.send(str(len(frames[-1].buffer)).encode())
    pull.close()
    ack.close()
    context.term()


def start_peer(kind: str, arg: str) -> tuple[subprocess.Popen[str], dict[str, Any], Any]:
    """Start the ``kind`` receiver; its process, what it printed, and its stderr log."""
    errors = tempfile_log()
    process = child([__file__, kind, arg], stderr=errors)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait(10)
        errors.seek(0)
        raise RuntimeError(f"the {kind} receiver did not start:\n{errors.read()[-2000:]}")
    return process, json.loads(line), errors


def stop_peer(process: subprocess.Popen[str], errors: Any) -> None:
    try:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(15)
    except (OSError, subprocess.TimeoutExpired):
        process.kill()
        process.wait(5)
    errors.close()


def ack_wait(ack: Any, n: int) -> None:
    """Wait for ``n`` acknowledgments of the ZMQ receiver (at most 2 min each)."""
    import zmq

    for _ in range(n):
        if not ack.poll(120_000, zmq.POLLIN):
            raise RuntimeError("the ZMQ receiver stopped acknowledging")
        ack.recv()


if __name__ == "__main__":
    if sys.argv[1] == "mooncake":
        mooncake_peer(int(sys.argv[2]))
    else:
        zmq_peer(sys.argv[2])
