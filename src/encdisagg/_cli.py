"""The ``encdisagg`` command line.

Each subcommand registers itself in :func:`build_parser`; the heavy imports (torch, servers)
happen inside the subcommand, so ``encdisagg --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._version import __version__

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="encdisagg",
        description=(
            "Encoder disaggregation for multimodal LLM serving: run vision encoders as their "
            "own service and ship embeddings to prefill instances."
        ),
    )
    parser.add_argument("--version", action="version", version=f"encdisagg {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    handler = args.handler
    result: int = handler(args)
    return result
