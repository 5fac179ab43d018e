"""The flags of ``encdisagg encode``, ``receive`` and ``loadgen``; no heavy import here."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_encode", "add_loadgen", "add_receive"]

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


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=_BACKENDS, default="asyncio", help="event loop")
    parser.add_argument("--api-key", help="sent as a Bearer token (servers run with --api-key)")


def add_encode(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "encode",
        allow_abbrev=False,
        help="encode media files on a running encoder server and print tokens and grids",
        description=(
            "POST /encode the files to a running encoder server (one part, in order) and print "
            "each item's token count and grid. With --send, the server then delivers the "
            "embedding to a ZMQ receiver (such as `encdisagg receive`); with --keep it stays "
            "staged for a receiver that fetches it (`encdisagg receive --from`); otherwise it "
            "is released. Exit status 1 if the server refused or failed the request."
        ),
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
    parser.set_defaults(handler=_run_encode)


def add_receive(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "receive",
        allow_abbrev=False,
        help="a ZMQ or Mooncake embedding receiver that prints what arrives",
        description=(
            "Bind a ZMQ PULL socket, print its endpoint, then one line per embedding part "
            "that arrives: its id, shape, dtype, bytes and a SHA-256 prefix of its bytes. "
            "Stops after --count parts, after --timeout-s without one, or on Ctrl-C. "
            "With --from URL PART_ID..., fetch parts staged on that server (`encdisagg "
            "encode --keep`) over --transfer (mooncake: into memory this process registers "
            "with its own Mooncake engine; zmq: a push to the bound socket) and print the "
            "same line for each; exit status 1 if any could not be fetched."
        ),
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
    parser.set_defaults(handler=_run_receive)


def add_loadgen(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "loadgen",
        allow_abbrev=False,
        help="a bounded load against running encoders: latency percentiles and errors",
        description=(
            "Send --requests encodes of generated PNG images, --concurrency at a time, to the "
            "encoders (spread as a prefill would) and release each; show a progress bar on "
            "stderr, then throughput, latency percentiles and errors by status. With --plot, "
            "also write an SVG histogram of the latencies."
        ),
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
    parser.set_defaults(handler=_run_loadgen)


def _run_encode(args: argparse.Namespace) -> int:
    from ._encode import run_encode

    return run_encode(args)


def _run_receive(args: argparse.Namespace) -> int:
    from ._receive import run_receive

    return run_receive(args)


def _run_loadgen(args: argparse.Namespace) -> int:
    from ._loadgen import run_loadgen

    return run_loadgen(args)
