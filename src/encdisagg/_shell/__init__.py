"""``encdisagg encode``, ``receive`` and ``loadgen``: the data path, tried from a shell.

Each command parses its own flags here (no heavy import); the module doing the work, with
torch and the clients, is imported only when the command runs.
"""

from __future__ import annotations

import argparse

from ._flags import add_encode, add_loadgen, add_receive

__all__ = ["add_commands"]


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the three commands; each sets ``handler`` to a function of its namespace."""
    add_encode(commands)
    add_receive(commands)
    add_loadgen(commands)
