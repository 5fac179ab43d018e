"""JSON log mode: native writes to descriptor 2 become JSON records (in a child process,
since the test moves its descriptor 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os
    from encdisagg.server import configure_logging
    from encdisagg.server._serve._stderr_lines import stderr_lines_to_logging

    configure_logging("info", "json")
    with stderr_lines_to_logging():
        os.write(2, b"E1203 12:00:00.000001 42 transfer_engine.cpp:7] the peer is gone\\n")
        os.write(2, b'{"level": "INFO", "message": "a worker record"}\\n')
        os.write(2, b"a native library says hi\\n")
        import logging
        logging.getLogger("x").info("a Python record")
    os.write(2, b"after the block: as it is\\n")
    """
)


def test_native_lines_become_json_records() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    lines = done.stderr.splitlines()
    assert lines[-1] == "after the block: as it is"
    records = [json.loads(line) for line in lines[:-1]]
    by_message = {record["message"]: record for record in records}
    glog = by_message["E1203 12:00:00.000001 42 transfer_engine.cpp:7] the peer is gone"]
    assert (glog["level"], glog["logger"]) == ("ERROR", "encdisagg.transfer.mooncake_native")
    other = by_message["a native library says hi"]
    assert (other["level"], other["logger"]) == ("WARNING", "encdisagg.stderr")
    assert by_message["a worker record"] == {"level": "INFO", "message": "a worker record"}
    assert by_message["a Python record"]["logger"] == "x"
