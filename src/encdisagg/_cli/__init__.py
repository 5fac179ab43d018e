"""The ``encdisagg`` command line: the top parser and its dispatch.

Each subcommand registers itself (``_parsers``); the heavy imports (torch, servers) happen
inside the subcommand, so ``encdisagg --help`` stays fast. ``serve``'s options are read by
``_flag_table``, ``_config_file`` and ``_resolve`` before ``_serve`` hands them to the server;
``demo`` runs in ``_demo``; ``encode``, ``receive`` and ``loadgen`` try the data path from a
shell.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._suggest import did_you_mean
from .._version import __version__
from ._parsers import add_commands

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="encdisagg",
        allow_abbrev=False,
        description=(
            "Encoder disaggregation for multimodal LLM serving: run vision encoders as their "
            "own service and ship embeddings to prefill instances."
        ),
    )
    parser.add_argument("--version", action="version", version=f"encdisagg {__version__}")
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return parser


def _unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> None:
    """Exit 2 naming each unrecognised argument, with the closest flag of its command."""
    command = parser
    if args.command is not None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                command = action.choices[args.command]
    known = [flag for action in command._actions for flag in action.option_strings]
    problems = [
        f"unrecognized argument {word}{did_you_mean(word.partition('=')[0], known)}"
        for word in extra
        if word.startswith("-")
    ] or [f"unrecognized arguments: {' '.join(extra)}"]
    command.error("; ".join(problems))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unknown(parser, args, extra)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    result: int = args.handler(args)
    return result
