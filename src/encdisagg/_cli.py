"""The ``encdisagg`` command line.

Each subcommand registers itself in :func:`build_parser`; the heavy imports (torch, servers)
happen inside the subcommand, so ``encdisagg --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._shell import add_commands as add_shell_commands
from ._suggest import did_you_mean
from ._version import __version__

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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(commands)
    _add_demo(commands)
    _add_bench(commands)
    add_shell_commands(commands)
    return parser


# --- serve ---------------------------------------------------------------------------------


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve",
        allow_abbrev=False,
        help="run an encoder server (SGLang-style HTTP routes)",
        description=(
            "Serve an Encoder over HTTP (Quart on Hypercorn). Options come from --config "
            "(TOML: an [encoder] table of EncoderConfig keys and a [server] table of host, "
            "port, dp, worker_class, log_level, log_format, max_body_mb, health_timeout_s, "
            "freeze_heap); "
            "every flag is also an ENCDISAGG_<FLAG> environment variable (ENCDISAGG_PORT, "
            "ENCDISAGG_MAX_BATCH_SIZE); a flag wins over the variable, the variable over the "
            "file. Every invalid option is reported at once, before anything loads. "
            "SIGINT or SIGTERM shuts down gracefully."
        ),
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the flags, the environment and the config file, print what would serve, "
        "and exit (0: valid; 2: every error)",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", help="port to bind; 0 picks a free one (default 8000)")
    parser.add_argument("--model", help="built-in model name (tiny, ...), 'null', or a folder")
    parser.add_argument("--transfer", metavar="{zmq,mooncake,loopback}")
    parser.add_argument("--mooncake-protocol", metavar="{tcp,rdma}")
    parser.add_argument("--mooncake-metadata", metavar="URL", help="P2PHANDSHAKE or a URL")
    parser.add_argument("--dp", help="data-parallel worker processes (default 1)")
    parser.add_argument(
        "--device", help="where the model runs: cpu (default), cuda, cuda:1, mps, xpu..."
    )
    parser.add_argument(
        "--dtype", help="model dtype: bfloat16, float16, float32 or auto (the checkpoint's)"
    )
    parser.add_argument(
        "--devices",
        metavar="LIST",
        help="one device per --dp worker, comma-separated: 0,1 (indexes of --device's type, "
        "CUDA by default) or cuda:0,cuda:1; default with --device cuda: cuda:RANK",
    )
    parser.add_argument("--max-batch-size")
    parser.add_argument("--request-timeout", metavar="SECONDS")
    parser.add_argument("--send-timeout", metavar="SECONDS")
    parser.add_argument("--prefix-cache-mb")
    parser.add_argument("--staged-memory-limit-mb")
    parser.add_argument(
        "--global-cache",
        metavar="URL",
        help="global embedding cache: mooncake://MASTER:PORT?metadata=URL[&...] (docs/cache.md)",
    )
    parser.add_argument("--max-body-mb", help="largest request body (default 256)")
    parser.add_argument("--health-timeout", metavar="SECONDS")
    parser.add_argument(
        "--freeze-heap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="once the model is loaded, freeze what is alive (gc.freeze) so the garbage "
        "collector's full passes skip it (default on)",
    )
    parser.add_argument("--worker-class", metavar="{asyncio,trio}", help="event loop")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: $ENCDISAGG_API_KEY, else none)",
    )
    parser.add_argument(
        "--allowed-peers",
        metavar="HOSTS",
        help="comma-separated hosts and networks a /send or receive URL may name (403 otherwise)",
    )
    parser.add_argument("--log-level", metavar="{debug,info,warning,error,critical}")
    parser.add_argument(
        "--log-format",
        metavar="{text,json}",
        help="log lines as text or one JSON object each (default text); both carry req_id",
    )
    parser.add_argument(
        "--registry",
        metavar="URL",
        help="register in an encoder fleet: etcd://HOST:PORT/PREFIX (docs/scaling.md)",
    )
    parser.add_argument(
        "--registry-lease-ttl",
        metavar="SECONDS",
        help="the registry lease: how long a dead server stays routable at most (default 5)",
    )
    parser.add_argument(
        "--grpc-port",
        metavar="PORT",
        help="also serve SGLang's SglangEncoder gRPC service (with health and reflection) on "
        "--host:PORT; 0 picks a free one (needs the grpc extra; docs/sglang.md)",
    )
    parser.add_argument(
        "--wire",
        metavar="{encdisagg,sglang,vllm}",
        help="the routes' protocol: ours (default), or sglang: SGLang 0.5.20's language side "
        "uses this server as its encoder (--encoder-urls; docs/sglang.md), or vllm: vLLM's "
        "disaggregated-encoder proxy does (docs/vllm.md)",
    )
    parser.add_argument(
        "--register-with",
        metavar="URL",
        help="with --wire sglang: register with SGLang's encoder bootstrap at URL at startup "
        "(retried) and unregister on shutdown",
    )
    parser.add_argument(
        "--advertise-url",
        metavar="URL",
        help="the URL --register-with registers (default http://HOST:PORT of this server)",
    )
    parser.add_argument(
        "--drain-delay",
        metavar="SECONDS",
        help="on SIGTERM: keep serving (readiness 503) this long before refusing new encodes "
        "(default 5; 0 allowed)",
    )
    parser.add_argument(
        "--drain-timeout",
        metavar="SECONDS",
        help="on SIGTERM: after the delay, wait at most this long for admitted requests to be "
        "delivered, released or expired (default 30)",
    )
    parser.add_argument(
        "--ready-min-workers",
        metavar="N",
        help="with --dp: /health/ready answers 200 while at least N workers serve (default 1)",
    )
    parser.add_argument(
        "--vllm-connector",
        metavar="{example,mooncake}",
        help="with --wire vllm: the PD's EC connector: example (shared storage, default) or "
        "mooncake (push into the PD's buffers; needs --transfer mooncake)",
    )
    parser.add_argument(
        "--vllm-storage-path",
        metavar="DIR",
        help="with --vllm-connector example: the PD's shared_storage_path",
    )
    parser.add_argument(
        "--vllm-store-max-bytes",
        metavar="BYTES",
        help="with --vllm-connector example: sweep the oldest files beyond this many bytes "
        "(default 8 GiB)",
    )
    parser.add_argument(
        "--vllm-store-max-age",
        metavar="SECONDS",
        help="with --vllm-connector example: sweep files older than this (default 3600)",
    )
    parser.add_argument(
        "--vllm-dtype",
        metavar="DTYPE",
        help="with --vllm-connector example: the files' dtype, the PD's (default: --dtype's)",
    )
    parser.add_argument(
        "--vllm-control-timeout",
        metavar="SECONDS",
        help="with --vllm-connector mooncake: bound on each control exchange (default 30)",
    )
    parser.add_argument(
        "--vllm-refresh-after",
        metavar="SECONDS",
        help="with --vllm-connector mooncake: refresh reservations older than this before "
        "writing (default 150)",
    )
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from .server._serve._command import run_serve

    return run_serve(args)


# --- demo ----------------------------------------------------------------------------------


def _add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "demo",
        help="run an E->P->D pipeline on this machine and check it against a colocated run",
        description=(
            "Start encoder servers, a prefill and a decode worker, send requests with real "
            "images, print time-to-first-token and time-per-output-token per request, and end "
            "with a summary line: parity=ok when every request that was not aborted produced "
            "the tokens of the same model run colocated (exit 0), else parity=FAILED naming "
            "the request (exit 1)."
        ),
    )
    parser.add_argument("--requests", type=int, metavar="K", help="requests to send (default 8)")
    parser.add_argument(
        "--transfer",
        choices=("zmq", "mooncake"),
        help="zmq: embeddings over ZMQ, KV over in-process engines; mooncake: Mooncake TCP for "
        "both hops (default zmq)",
    )
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="'tiny' (built in, the default), 'tiny-qwen3-vl' (built in, with deepstack "
        "features) or a local full Qwen2-VL / Qwen3-VL checkpoint folder",
    )
    parser.add_argument(
        "--abort-rate",
        type=float,
        metavar="P",
        help="chance that a request is aborted at a random decode phase (default 0)",
    )
    parser.add_argument("--new-tokens", type=int, metavar="N", help="tokens per request (8)")
    parser.add_argument("--seed", type=int, help="seed of images, prompts and aborts (0)")
    parser.add_argument("--encoders", type=int, help="encoder servers to start (2)")
    parser.add_argument(
        "--device",
        help="where the encoder servers' vision towers run: cpu (default), cuda, cuda:1...; "
        "the language models stay on the CPU",
    )
    parser.add_argument("--concurrency", type=int, help="requests in flight at once (4)")
    parser.add_argument("--max-images", type=int, help="most images per request (3)")
    parser.add_argument(
        "--kv-pages",
        type=int,
        metavar="N",
        help="pages of the decode side's KV pool (512); a few force retractions",
    )
    parser.add_argument(
        "--max-running", type=int, metavar="N", help="requests decoding in one batch at most (64)"
    )
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--quiet", action="store_true", help="no per-request lines")
    parser.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error")
    )
    parser.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    from .pipeline._command import run_demo_command

    return run_demo_command(args)


# --- bench ---------------------------------------------------------------------------------


def _add_bench(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "bench",
        help="run the benchmark suite of a source checkout (python -m benchmarks)",
        description=(
            "Run the benchmarks in the 'benchmarks' folder of the source checkout in the "
            "current directory (or a parent) with 'python -m benchmarks'; results land in "
            "benchmarks/results/ and the table of docs/benchmarks.md is rewritten."
        ),
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated benchmarks to run")
    parser.add_argument("--skip", metavar="NAMES", help="comma-separated benchmarks to leave out")
    parser.add_argument("--out", metavar="DIR", help="results folder")
    parser.add_argument("--soak", action="store_true", help="also run the reliability soak")
    parser.add_argument("--list", action="store_true", help="list the benchmarks")
    parser.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    import subprocess
    from pathlib import Path

    for folder in (Path.cwd(), *Path.cwd().parents):
        if (folder / "benchmarks" / "__main__.py").is_file():
            break
    else:
        print(
            "encdisagg bench: error: no benchmarks/ folder here or above; run it from a "
            "source checkout of encdisagg",
            file=sys.stderr,
        )
        return 2
    command = [sys.executable, "-m", "benchmarks"]
    command += [f"--{flag}" for flag in ("quick", "soak", "list") if getattr(args, flag)]
    for option in ("only", "skip"):
        if getattr(args, option) is not None:
            command += [f"--{option}", getattr(args, option)]
    if args.out is not None:
        command += ["--out", str(Path(args.out).resolve())]
    return subprocess.call(command, cwd=folder)


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
    handler = args.handler
    result: int = handler(args)
    return result
