"""The subcommands and their flags: ``serve`` (declared by its option table), ``demo``,
``bench``, and the data path tried from a shell: ``encode``, ``receive`` and ``loadgen``.

No heavy import here: each command's handler imports the module doing the work (torch, the
servers, the clients) only when that command runs, so ``--help`` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TypeAlias

from ._flag_table import FLAGS

__all__ = ["add_commands"]

Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Handler: TypeAlias = Callable[[argparse.Namespace], int]

_BACKENDS = ("asyncio", "trio")


def _number(kind: type[float] | type[int], low: float, high: float | None = None) -> Any:
    """An argparse type: ``kind`` parsed from the text, at least ``low`` (above it for a
    float with no ``high``: a duration), below ``high`` when given."""
    name = "an integer" if kind is int else "a number"
    if kind is int:
        rule = f"must be at least {low:g}"
    elif high is None:
        rule = "must be positive" if low == 0 else f"must be more than {low:g}"
    else:
        rule = f"must be in [{low:g}, {high:g})"

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {name}: {text!r}") from None
        inside = low <= value if kind is int or high is not None else low < value
        if not inside or (high is not None and not value < high):
            raise argparse.ArgumentTypeError(f"{rule}; got {text!r}")
        return value

    return parse


_positive_float = _number(float, 0)
_positive_int = _number(int, 1)
_fraction = _number(float, 0, 1)


def _size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) * int(height) < 1:
        raise argparse.ArgumentTypeError(f"a size is WIDTHxHEIGHT, e.g. 448x448; got {text!r}")
    return int(width), int(height)


def _command(
    commands: Commands,
    name: str,
    handler: Handler,
    summary: str,
    about: str,
    *,
    abbrev: bool = False,
) -> argparse.ArgumentParser:
    """A subcommand running ``handler``; ``summary`` is its line in ``encdisagg --help``,
    ``abbrev`` whether its flags may be shortened (``demo`` and ``bench`` always allowed it)."""
    parser = commands.add_parser(name, allow_abbrev=abbrev, help=summary, description=about)
    parser.set_defaults(handler=handler)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=_BACKENDS, default="asyncio", help="event loop")
    parser.add_argument("--api-key", help="sent as a Bearer token (servers run with --api-key)")


def add_commands(commands: Commands) -> None:
    """Register every subcommand, in the order ``encdisagg --help`` lists them; each sets
    ``handler`` to a function of its namespace returning the exit status."""
    for add in (_add_serve, _add_demo, _add_bench, _add_encode, _add_receive, _add_loadgen):
        add(commands)


def _add_serve(commands: Commands) -> None:
    parser = _command(
        commands,
        "serve",
        _run_serve,
        "run an encoder server (SGLang-style HTTP routes)",
        "Serve an Encoder over HTTP (Quart on Hypercorn). Options come from --config "
        "(TOML: an [encoder] table of EncoderConfig keys and a [server] table of host, "
        "port, dp, worker_class, log_level, log_format, max_body_mb, health_timeout_s, "
        "freeze_heap); "
        "every flag is also an ENCDISAGG_<FLAG> environment variable (ENCDISAGG_PORT, "
        "ENCDISAGG_MAX_BATCH_SIZE); a flag wins over the variable, the variable over the "
        "file. Every invalid option is reported at once, before anything loads. "
        "SIGINT or SIGTERM shuts down gracefully.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the flags, the environment and the config file, print what would serve, "
        "and exit (0: valid; 2: every error)",
    )
    for flag in FLAGS:
        flag.add_to(parser)


def _add_demo(commands: Commands) -> None:
    parser = _command(
        commands,
        "demo",
        _run_demo,
        "run an E->P->D pipeline on this machine and check it against a colocated run",
        "Start encoder servers, a prefill and a decode worker, send requests with real "
        "images, print time-to-first-token and time-per-output-token per request, and end "
        "with a summary line: parity=ok when every request that was not aborted produced "
        "the tokens of the same model run colocated (exit 0), else parity=FAILED naming "
        "the request (exit 1).",
        abbrev=True,
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
    parser.add_argument("--backend", choices=_BACKENDS, default="asyncio")
    parser.add_argument("--quiet", action="store_true", help="no per-request lines")
    parser.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error")
    )


def _add_bench(commands: Commands) -> None:
    parser = _command(
        commands,
        "bench",
        _run_bench,
        "run the benchmark suite of a source checkout (python -m benchmarks)",
        "Run the benchmarks in the 'benchmarks' folder of the source checkout in the "
        "current directory (or a parent) with 'python -m benchmarks'; results land in "
        "benchmarks/results/ and the table of docs/benchmarks.md is rewritten.",
        abbrev=True,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated benchmarks to run")
    parser.add_argument("--skip", metavar="NAMES", help="comma-separated benchmarks to leave out")
    parser.add_argument("--out", metavar="DIR", help="results folder")
    parser.add_argument("--soak", action="store_true", help="also run the reliability soak")
    parser.add_argument("--list", action="store_true", help="list the benchmarks")


def _add_encode(commands: Commands) -> None:
    parser = _command(
        commands,
        "encode",
        _run_encode,
        "encode media files on a running encoder server and print tokens and grids",
        "POST /encode the files to a running encoder server (one part, in order) and print "
        "each item's token count and grid. With --send, the server then delivers the "
        "embedding to a ZMQ receiver (such as `encdisagg receive`); with --keep it stays "
        "staged for a receiver that fetches it (`encdisagg receive --from`); otherwise it "
        "is released. Exit status 1 if the server refused or failed the request.",
    )
    parser.add_argument("url", help="the encoder's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("files", nargs="+", metavar="FILE", help="image, video or audio files")
    parser.add_argument(
        "--modality",
        choices=("image", "video", "audio"),
        help="the files' modality (default: from the first file's extension)",
    )
    parser.add_argument("--req-id", help="the request id (default: a fresh random one)")
    delivery = parser.add_mutually_exclusive_group()
    delivery.add_argument(
        "--send", metavar="ENDPOINT", help="ZMQ endpoint to deliver to, e.g. tcp://127.0.0.1:5555"
    )
    delivery.add_argument(
        "--keep",
        action="store_true",
        help="leave the embedding staged for a receiver to fetch (encdisagg receive --from)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument("--timeout-s", type=_positive_float, default=60.0, help="per call")
    _common(parser)


def _add_receive(commands: Commands) -> None:
    parser = _command(
        commands,
        "receive",
        _run_receive,
        "a ZMQ or Mooncake embedding receiver that prints what arrives",
        "Bind a ZMQ PULL socket, print its endpoint, then one line per embedding part "
        "that arrives: its id, shape, dtype, bytes and a SHA-256 prefix of its bytes. "
        "Stops after --count parts, after --timeout-s without one, or on Ctrl-C. "
        "With --from URL PART_ID..., fetch parts staged on that server (`encdisagg "
        "encode --keep`) over --transfer (mooncake: into memory this process registers "
        "with its own Mooncake engine; zmq: a push to the bound socket) and print the "
        "same line for each; exit status 1 if any could not be fetched.",
    )
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="endpoint; port 0 = free")
    parser.add_argument("part_ids", nargs="*", metavar="PART_ID", help="with --from: parts")
    parser.add_argument("--from", dest="source", metavar="URL", help="the server to fetch from")
    parser.add_argument(
        "--transfer",
        choices=("zmq", "mooncake"),
        default="zmq",
        help="with --from: how the parts travel (default zmq)",
    )
    parser.add_argument(
        "--mooncake-host", default="127.0.0.1", help="this side's Mooncake engine host"
    )
    parser.add_argument("--api-key", help="sent as a Bearer token (with --from)")
    parser.add_argument("--count", type=_positive_int, help="stop after this many parts")
    parser.add_argument("--timeout-s", type=_positive_float, help="stop after this long idle")
    parser.add_argument("--json", action="store_true", help="one JSON object a line")
    parser.add_argument("--backend", choices=_BACKENDS, default="asyncio", help="event loop")


def _add_loadgen(commands: Commands) -> None:
    parser = _command(
        commands,
        "loadgen",
        _run_loadgen,
        "a bounded load against running encoders: latency percentiles and errors",
        "Send --requests encodes of generated PNG images, --concurrency at a time, to the "
        "encoders (spread as a prefill would) and release each; show a progress bar on "
        "stderr, then throughput, latency percentiles and errors by status. With --plot, "
        "also write an SVG histogram of the latencies.",
    )
    parser.add_argument("urls", nargs="+", metavar="URL", help="encoder base URLs")
    parser.add_argument("--requests", type=_positive_int, default=100)
    parser.add_argument("--concurrency", type=_positive_int, default=8)
    parser.add_argument("--images", type=_positive_int, default=1, help="images per request")
    parser.add_argument("--size", type=_size, default=(448, 448), help="WIDTHxHEIGHT")
    parser.add_argument(
        "--repeat", type=_fraction, default=0.0, help="share of images repeated (cache hits)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=_positive_float, default=60.0, help="per call")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--plot", metavar="FILE.svg", help="write a latency histogram")
    _common(parser)


# The handlers: each imports the module doing the work only when its command runs.


def _run_serve(args: argparse.Namespace) -> int:
    from ._serve import run_serve

    return run_serve(args)


def _run_demo(args: argparse.Namespace) -> int:
    from ._demo_command import run_demo_command

    return run_demo_command(args)


def _run_encode(args: argparse.Namespace) -> int:
    from ._encode import run_encode

    return run_encode(args)


def _run_receive(args: argparse.Namespace) -> int:
    from ._receive import run_receive

    return run_receive(args)


def _run_loadgen(args: argparse.Namespace) -> int:
    from ._loadgen import run_loadgen

    return run_loadgen(args)


def _run_bench(args: argparse.Namespace) -> int:
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
