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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(commands)
    return parser


# --- serve ---------------------------------------------------------------------------------


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve",
        help="run an encoder server (SGLang-style HTTP routes)",
        description=(
            "Serve an Encoder over HTTP (Quart on Hypercorn). Options come from --config "
            "(TOML: an [encoder] table of EncoderConfig keys and a [server] table of host, "
            "port, dp, worker_class, log_level, max_body_mb, health_timeout_s); flags win. "
            "SIGINT or SIGTERM shuts down gracefully."
        ),
    )
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind; 0 picks a free one (default 8000)")
    parser.add_argument("--model", help="built-in model name (tiny, ...), 'null', or a folder")
    parser.add_argument("--transfer", choices=("zmq", "mooncake", "loopback"))
    parser.add_argument("--mooncake-protocol", choices=("tcp", "rdma"))
    parser.add_argument("--mooncake-metadata", metavar="URL", help="P2PHANDSHAKE or a URL")
    parser.add_argument("--dp", type=int, help="data-parallel worker processes (default 1)")
    parser.add_argument("--max-batch-size", type=int)
    parser.add_argument("--request-timeout", type=float, metavar="SECONDS")
    parser.add_argument("--send-timeout", type=float, metavar="SECONDS")
    parser.add_argument("--prefix-cache-mb", type=int)
    parser.add_argument("--staged-memory-limit-mb", type=int)
    parser.add_argument("--max-body-mb", type=int, help="largest request body (default 256)")
    parser.add_argument("--health-timeout", type=float, metavar="SECONDS")
    parser.add_argument("--worker-class", choices=("asyncio", "trio"), help="event loop")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error", "critical"))
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from .server._command import run_serve

    return run_serve(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    handler = args.handler
    result: int = handler(args)
    return result
